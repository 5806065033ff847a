"""``autodist-plan ckpt info PATH``: what a checkpoint holds and the plan it was saved under,
read from the metadata only, with every string from it escaped for the terminal."""

from __future__ import annotations

import doctest
import hashlib
import json

import pytest
from click.testing import CliRunner
from harness.plans import tensor_parallel_plan
from harness.workloads import WORKLOADS, make_loader, make_optimizer, train

import autodist.planner.review.checkpoint_info
from autodist import apply_plan, save_checkpoint
from autodist.planner.cli import cli
from autodist.schemas import dump_plan
from autodist.schemas.checkpoint import METADATA_FILE

WORKLOAD = WORKLOADS["docstring_llama"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint of the docstring Llama after 3 AdamW steps under a one-rank plan."""
    model = WORKLOAD.build(2024)
    optimizer, schedule = make_optimizer("adamw", model.parameters())
    plan = tensor_parallel_plan(model)
    model, optimizer, loader = apply_plan(model, optimizer, make_loader(WORKLOAD, 3, 2024), plan)
    train(WORKLOAD, model, optimizer, schedule, loader, 3)
    path = tmp_path_factory.mktemp("info") / "ckpt"
    save_checkpoint(model, optimizer, path, step=3)
    return path, plan


def info(*args: str):
    return CliRunner().invoke(cli, ["ckpt", "info", *map(str, args)])


def test_info_names_step_model_plan_optimizer_scheduler_and_parameters(saved):
    path, plan = saved
    result = info(path)
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    fingerprint = hashlib.sha256(dump_plan(plan)).hexdigest()[:12]
    assert lines[1] == "step        3"
    assert lines[2].startswith("model       Model, 21 parameters (24.7k values), fingerprint ")
    assert (
        lines[4]
        == f"plan        {fingerprint}: mesh dp = 1; dp1 · mp1 · pp1, sequence parallel off, ZeRO stage 0, 1 micro-batch"
    )
    assert lines[5] == "optimizer   AdamW, states of 21 parameters: beta1_pow_acc, beta2_pow_acc, moment1, moment2"
    assert lines[6] == "scheduler   StepDecay (last_epoch=3, last_lr=0.0005)"
    assert "layers.*.self_attn.q_proj.weight [32, 32] float32, 4.0 KiB, 1 shard" in [
        " ".join(line.split()) for line in lines
    ]


def test_info_json_is_plain_data(saved):
    path, plan = saved
    result = info(path, "--json")
    data = json.loads(result.output)
    assert data["step"] == 3 and data["plan"]["strategy"]["mp"] == 1 and data["plan"]["mesh"]["axes"] == ["dp"]
    assert data["params"]["embed_tokens.weight"] == {"shape": [64, 32], "dtype": "float32", "shards": 1}


def test_control_characters_from_the_metadata_are_escaped(saved, tmp_path):
    path, _ = saved
    evil = tmp_path / "evil"
    evil.mkdir()
    raw = json.loads((path / METADATA_FILE).read_text())
    (evil / raw["data"]).symlink_to(path / raw["data"])
    raw["scheduler"]["state"]["last_lr"] = "\x1b[2J\r\x9bowned"  # values are free; names have a grammar
    (evil / METADATA_FILE).write_text(json.dumps(raw))
    result = info(evil)
    assert result.exit_code == 0, result.output
    assert not any(c in result.output for c in "\x1b\r\x9b"), repr(result.output)
    assert "last_lr=\\x1b[2J\\r\\x9bowned" in result.output

    for where, edit in [
        ("$.model.class_name", lambda raw: raw["model"].update(class_name="Model\x1b[2J")),
        ("$.params", lambda raw: raw["params"].update({"layer\x1b]0;owned\x07.weight": raw["params"]["norm.weight"]})),
    ]:
        bad = json.loads((path / METADATA_FILE).read_text())
        edit(bad)
        (evil / METADATA_FILE).write_text(json.dumps(bad))
        refused = info(evil)
        assert refused.exit_code == 2 and refused.output.count("\n") == 1, refused.output
        assert "\x1b" not in refused.output and "\x07" not in refused.output, refused.output
        assert where in refused.output, refused.output


def test_a_bad_checkpoint_is_one_escaped_error_line(saved, tmp_path):
    path, _ = saved
    raw = json.loads((path / METADATA_FILE).read_text())
    raw["\x1b[2Jsurprise"] = 1
    (tmp_path / METADATA_FILE).write_text(json.dumps(raw))
    result = info(tmp_path)
    assert result.exit_code == 2
    assert result.output.startswith("error: ") and result.output.count("\n") == 1 and "\x1b" not in result.output
    assert "unknown field" in result.output

    missing = info(tmp_path / "nowhere")
    assert missing.exit_code == 2 and "not a checkpoint (no checkpoint.json in it)" in missing.output


def test_docstring_examples():
    failed, _ = doctest.testmod(autodist.planner.review.checkpoint_info)
    assert failed == 0
