"""The first hour with `autodist-plan` (issue #21, item 6): `show` tells the truth about the global
batch and the experts each rank holds, the node and device flags read like
`paddle.distributed.launch`, rule errors name the rule and its line, suggest the close layer name
and come all at once, and a mistyped command is named with the closest one."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from harness.cli import DOCSTRING, run, tiny_docstring  # noqa: F401 (autouse fixture)

from test_rules import MODEL as NORMED_MLP

from autodist.schemas import load_plan

MIXTRAL = "tests/models/zoo/mixtral_moe.py"
VIT = "tests/models/zoo/vit.py"
ROOT = Path(__file__).resolve().parents[1]

# -- show ---------------------------------------------------------------------------------------------


def test_show_prints_the_global_batch_not_the_traced_one(tmp_path):
    """A plan made with --global-batch-size 256 showed only the input spec's batch (4x16 here)."""
    out = tmp_path / "plan.json"
    made = run(
        DOCSTRING, "--nproc-per-node", 4, "--dp", 4, "--global-batch-size", 256, "--micro-batches", 2, "-q", "-o", out
    )
    assert made.exit_code == 0, made.output
    assert load_plan(out).data.global_batch_size == 256
    text = run("show", out).output
    assert "traced with input_ids int64 4x16" in text
    assert (
        "global batch 256 samples per optimizer step (what the loader yields): 64 per dp rank, 2 micro-batches of 32"
        in text
    )


def test_show_says_which_experts_each_rank_holds(tmp_path):
    """An ep2 plan read "all 41 parameters replicated" although each rank holds half the experts."""
    out = tmp_path / "plan.json"
    made = run(MIXTRAL, "--nproc-per-node", 2, "--dp", 2, "--mp", 1, "--ep", 2, "--device", "cpu", "-q", "-o", out)
    assert made.exit_code == 0, made.output
    text = run("show", out).output
    assert "parameters replicated (R on every mesh axis)" in text and "all 41 parameters" not in text
    assert "experts: each rank holds 1/2 of each MoE layer's experts (ep2, over dp)" in text
    assert "layers.*.block_sparse_moe.experts.*  4 experts: 0-1 on rank 0; 2-3 on rank 1" in text
    shown = json.loads(run("show", "--json", out).output)["experts"]
    assert shown == [
        {
            "experts": "layers.*.block_sparse_moe.experts",
            "count": 4,
            "held": [{"experts": [0, 1], "ranks": [0]}, {"experts": [2, 3], "ranks": [1]}],
        }
    ]


# -- the node and device flags --------------------------------------------------------------------------


def test_the_launch_words_plan_what_the_old_names_plan(tmp_path):
    plans = {}
    for name, flags in {
        "launch": ["--nnodes", 2, "--nproc-per-node", 2],
        "underscore": ["--nnodes", 2, "--nproc_per_node", 2],
        "aliases": ["--nodes", 2, "--devices", 2],
    }.items():
        out = tmp_path / f"{name}.json"
        assert run(DOCSTRING, *flags, "--device", "h100-sxm", "-q", "-o", out).exit_code == 0
        plans[name] = out.read_bytes()
    assert plans["launch"] == plans["underscore"] == plans["aliases"]
    plan = load_plan(plans["launch"])
    assert (plan.cluster.nodes, plan.cluster.devices_per_node) == (2, 2)
    helptext = " ".join(run("plan", "--help").output.split())
    assert "--nproc-per-node, --nproc_per_node, --devices N" in helptext and "--nnodes, --nodes N" in helptext
    assert "paddle.distributed.launch --nproc_per_node" in helptext


# -- a mistyped command ---------------------------------------------------------------------------------


@pytest.mark.parametrize("typed, meant", [("shwo", "show"), ("dif", "diff"), ("rendr", "render"), ("scheme", "schema")])
def test_a_mistyped_command_names_the_closest(typed, meant):
    """`autodist-plan shwo plan.json` said "got unexpected extra argument"."""
    result = run(typed, "plan.json")
    assert result.exit_code == 2
    assert result.stderr == f"error: no such command '{typed}'; did you mean '{meant}'? (see autodist-plan --help)\n"


def test_a_model_file_is_still_the_default_command(tmp_path, monkeypatch):
    """A file (or an importable module) named like a command is a model to plan, not a typo."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "shwo").write_text("")
    result = run("shwo")
    assert "no such command" not in result.stderr


# -- rules ----------------------------------------------------------------------------------------------


def plan_with_rules(tmp_path, target, text):
    rules = tmp_path / "rules.toml"
    rules.write_text(text)
    return run(target, "--nproc-per-node", 2, "--mp", 2, "--rules", rules, "-q", "-o", tmp_path / "plan.json"), rules


def test_a_rule_restating_inference_is_accepted_in_a_block_with_a_fused_qkv(tmp_path):
    """On timm's ViT every rule was refused naming the attention ("pd_op.reshape in blocks.0.attn
    would need a all_gather"): the replay ignored the gather the plan's own hook makes after the
    fused qkv projection."""
    result, _ = plan_with_rules(tmp_path, VIT, '"blocks.*.mlp.fc1" = "colwise"\n"blocks.*.mlp.fc2" = "rowwise"\n')
    assert result.exit_code == 0, result.output


def test_every_bad_rule_is_named_with_its_line_at_once(tmp_path):
    text = (
        "# rules for the ViT\n"
        '"blocks.*.mpl.fc1" = "colwise"\n'  # mistyped glob
        '"blokcs.*.mlp.fc2" = "rowwise"\n'  # mistyped glob
        '"blocks.*.attn.qkv" = "colwize"\n'  # unknown word
        '"head" = "colwise"\n'  # outside the blocks
    )
    result, rules = plan_with_rules(tmp_path, VIT, text)
    assert result.exit_code == 2
    lines = result.stderr.splitlines()
    assert lines[0] == "error: 4 rules are refused"
    assert lines[1:] == (  # in the file's order
        [
            f'  - --rules {rules} line 2: "blocks.*.mpl.fc1" = "colwise": matches no layer with a 2-D weight; '
            'did you mean "blocks.*.mlp.fc1"?',
            f'  - --rules {rules} line 3: "blokcs.*.mlp.fc2" = "rowwise": matches no layer with a 2-D weight; '
            'did you mean "blocks.*.mlp.fc2"?',
            f'  - --rules {rules} line 4: "blocks.*.attn.qkv" = "colwize": a placement is one of ColWiseParallel, '
            "RowWiseParallel, colwise, replicate, rowwise",
            f'  - --rules {rules} line 5: "head" = "colwise": head is outside the repeated blocks; rules place '
            "projections inside blocks (the embedding and LM head are placed by the planner)",
        ]
    )


def test_a_wrong_rule_is_named_not_the_op_it_upsets(tmp_path):
    """Splitting fc1's columns puts a split axis under the LayerNorm after it (test_rules' model):
    the rule is named with its line, once (not once per block), then what Paddle would do."""
    model = tmp_path / "net.py"
    model.write_text(NORMED_MLP)
    result, rules = plan_with_rules(tmp_path, str(model), '"blocks.*.fc2" = "rowwise"\n"blocks.*.fc1" = "colwise"\n')
    assert result.exit_code == 2
    assert result.stderr == (
        f'error: --rules {rules} line 2: "blocks.*.fc1" = "colwise": with it pd_op.layer_norm in blocks.0.norm would '
        "need an all_gather of operand 0 (S(2) -> R) that Paddle adds on its own; split the projections that feed "
        "it and the one that contracts it together (in blocks.0)\n"
    )


# -- autodist.plan() is as quiet as the command line ------------------------------------------------------

QUIET_SCRIPT = """
import sys
import paddle
import autodist

sys.path.insert(0, "tests/models/zoo")  # run from the repository's root
import vit

class Loud(vit.VisionTransformer):
    def forward(self, x):
        print("the model's own line", file=sys.stderr)
        return super().forward(x)

model = vit.build_model()
print("=== planning", file=sys.stderr, flush=True)
autodist.plan(model, vit.input_spec(), devices=2, device="cpu")
autodist.plan(Loud(), vit.input_spec(), devices=2, device="cpu")
print("=== done", file=sys.stderr, flush=True)
"""


def test_plan_from_python_prints_nothing_the_command_hides(tmp_path):
    """autodist.plan() printed Paddle's `W... Paddle static graph(PIR) not support input out tensor
    for now!!!!` and networkx's hashing warning, which the command line hides; what the model
    itself prints is still shown."""
    script = tmp_path / "plan_it.py"  # a file: to_static reads the forward's source
    script.write_text(QUIET_SCRIPT)
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=600, cwd=ROOT, check=False
    )
    assert result.returncode == 0, result.stderr[-3000:]
    planning = result.stderr.split("=== planning\n", 1)[1]
    assert planning == "the model's own line\n=== done\n", planning
