"""A pipeline only where the blocks chain as the pipeline runtime hands them on
(planner/recognise/chaining.py, docs/pipelines.md).

A stage after a cut gets the previous block's first output, as its first block's first input,
and the model's inputs; nothing else. The zoo's encoder-decoders do not chain so: T5's and
Whisper's first decoder block starts from the decoder's token embedding and the later ones read
the encoder's output beside their hidden state (T5's also the position bias of the block
before), and Perceiver IO's decoder cross-attends from a learned query array. Planned before
this check, each got a pp2 plan (the default search picked pp2 VPP for T5 on 2 GPUs) that would
have handed the wrong tensor from stage to stage. Decoder-only models chain at every cut and keep
their pipelines.
"""

from __future__ import annotations

import dataclasses
import os
from unittest import mock

import pytest
from click.testing import CliRunner

from autodist.planner import driver
from autodist.planner.cli import cli
from autodist.planner.cost.hardware import PROFILES
from autodist.planner.cost.search import SearchRequest
from autodist.planner.review.check import check_plan_for_target
from harness.planning import _analysed, plan_command, plan_target

A100 = PROFILES["a100-80g"]
ZOO = "tests/models/zoo"

#: Each encoder-decoder, the block the 1F1B split of ``--pp 2`` starts its second stage at (two
#: stages of its four blocks), and what the refusal says is read there.
UNCHAINED = {
    "t5": ("decoder.block.0", "its first input is a value decoder.dropout computes"),
    "whisper": ("decoder.blocks.0", "its first input is a value decoder computes"),
    "perceiver_hf": (
        "perceiver.encoder.self_attends.1",
        "reads parameter perceiver.decoder.output_position_encodings.position_embeddings",
    ),
}


def _analysis(name: str):
    target = f"{ZOO}/{name}.py"
    environment = tuple(sorted((k, v) for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"))
    return _analysed(target, None, environment)[1]


@pytest.mark.parametrize("name", sorted(UNCHAINED))
def test_pp2_of_an_encoder_decoder_is_refused_in_one_line_naming_the_block_and_its_input(name, tmp_path):
    block, read = UNCHAINED[name]
    output = tmp_path / "plan.json"
    command = [f"{ZOO}/{name}.py", "--devices", "2", "--device", "a100-80g", "--pp", "2", "-o", str(output)]
    with mock.patch.object(driver, "plan_target", plan_target):
        done = CliRunner().invoke(cli, command)
    assert done.exit_code == 2, done.output
    errors = [line for line in done.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, done.output
    assert errors[0].startswith(f"error: --pp 2: a pipeline cannot cut before {block}"), errors[0]
    assert read in errors[0], errors[0]
    assert f"{ZOO}/{name}.py:" in errors[0], errors[0]  # the model's line
    assert not output.exists()


def test_every_cut_of_t5_names_what_crosses_it():
    unchained = _analysis("t5").unchained
    assert sorted(unchained) == [1, 2, 3]
    # encoder.block.1 reads the position bias encoder.block.0 computed in its first layer's attention
    assert "encoder.block.1 (T5Block.forward" in unchained[1] and "a value encoder.block.0 computes" in unchained[1]
    assert "decoder.block.1 (T5Block.forward" in unchained[3] and "a value decoder.block.0 computes" in unchained[3]


def test_whisper_decoder_blocks_read_the_encoder_output_across_the_cut():
    unchained = _analysis("whisper").unchained
    assert "decoder.blocks.1" in unchained[3] and "reads a value encoder.ln_post computes" in unchained[3]


@pytest.mark.parametrize("name", sorted(UNCHAINED))
def test_the_search_offers_no_pipeline_to_an_encoder_decoder(name):
    target = f"{ZOO}/{name}.py"
    result = plan_target(target, None, SearchRequest(devices_per_node=2, device=A100), {"target": target}).result
    assert result.best.strategy.pp == 1
    assert [c.strategy for c in result.accepted if c.strategy.pp > 1] == []
    assert any(r.strategy.pp == 2 for r in result.rejected)


@pytest.mark.parametrize("name", ["gpt2_hf", "llama_meta"])
def test_decoder_only_models_chain_at_every_cut_and_keep_their_pipelines(name, tmp_path):
    assert _analysis(name).unchained == {}
    plan = plan_command(
        f"{ZOO}/{name}.py", ["--devices", "2", "--device", "a100-80g", "--pp", "2"], tmp_path / "p.json"
    )
    assert '"pp": 2' in plan.read_text()


def test_check_refuses_a_pipeline_plan_cutting_where_the_blocks_do_not_chain():
    """A pp2 plan of T5 as the planner made it before the check (its analysis without the cuts it
    now finds): ``autodist-plan check`` recognises the blocks again and names the cut."""
    target = f"{ZOO}/t5.py"
    environment = tuple(sorted((k, v) for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"))
    traced, analysis, model = _analysed(target, None, environment)
    request = SearchRequest(devices_per_node=2, device=A100, pp=2, schedule="1F1B")
    unchecked = dataclasses.replace(analysis, unchained={})
    plan = driver.plan_analysed(unchecked, traced, request, {"target": target}, model=model, local_view=False).plan
    assert [b.stage for b in plan.blocks] == [0, 0, 1, 1]
    reasons = check_plan_for_target(plan, target)
    assert reasons == [f"$.blocks: {analysis.unchained[2]}"]
    assert reasons[0].startswith("$.blocks: a pipeline cannot cut before decoder.block.0 (T5Block.forward")
