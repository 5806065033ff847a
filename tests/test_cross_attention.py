"""Attention in every shape is recognised (issue #30, item 4): HF's Perceiver IO
(tests/models/zoo/perceiver_hf.py) cross-attends from learned queries at widths that differ
from its keys' and values', and two of its four attentions are lone layers, not in a LayerList.

- Its encoder's ``cross_attention``: queries from the learned latents (``q_dim`` 40), keys and
  values from the embedded inputs (``kv_dim`` 48, ``qk_channels`` 48, 2 heads); its decoder's
  ``decoding_cross_attention``: learned output queries (``q_dim`` 48) over the latents
  (``kv_dim`` 40, ``qk_channels`` 32, ``v_channels`` 48, 4 heads). Each is a block of its own
  (``analysis.lone_blocks``), its q/k/v named by which factor of the scores and of the context
  product each projection reaches, and split Megatron's way, as the self-attentions are.
- The decisions are the same traced at 2 x 16 and at 3 x 12 tokens.
- Trained on 2 gloo ranks and on 4 (dp2 x mp2): losses and parameters within 1e-5 of one
  device, each rank's output projection of every attention reading half its heads' width.
"""

from __future__ import annotations

import pytest

from autodist.schemas import Plan, save_plan
from harness.cases import Trained, check_against_reference
from harness.jobs import TrainRun
from harness.planning import gloo_mp2_request, plan_target
from harness.runner import train_by_world

PERCEIVER = "tests/models/zoo/perceiver_hf.py"
#: Each attention of the model and its output projection's input width on one rank of two (half
#: its v_channels), read from the model: the encoder's cross-attention 48, its self-attentions
#: 40 (d_latents), the decoder's cross-attention 48 (d_model).
ATTENTIONS = {
    "perceiver.encoder.cross_attention": 48 // 2,
    "perceiver.encoder.self_attends.0": 40 // 2,
    "perceiver.encoder.self_attends.1": 40 // 2,
    "perceiver.decoder.decoding_cross_attention": 48 // 2,
}
#: (heads, KV heads, head dim) of each block's attention: 2 heads of 24 in the encoder's
#: cross-attention, 4 of 10 in the self-attentions, 4 of 8 (values 12 wide) in the decoder's.
HEADS = {
    "perceiver.encoder.cross_attention": (2, 2, 24),
    "perceiver.encoder.self_attends.0": (4, 4, 10),
    "perceiver.encoder.self_attends.1": (4, 4, 10),
    "perceiver.decoder.decoding_cross_attention": (4, 4, 8),
}


#: The trainings: dp1 x mp2 on 2 ranks, dp2 x mp2 on 4.
DPS = (1, 2)


def _planned(spec: str | None = None, dp: int = 1) -> Plan:
    return plan_target(PERCEIVER, [spec] if spec else None, gloo_mp2_request(dp), {"target": PERCEIVER}).plan


def _mp_placements(plan: Plan) -> dict[str, str]:
    axis = plan.mesh.axes.index("mp")
    return {fqn: p.placements[axis] for fqn, p in plan.params.items()}


def test_lone_cross_attentions_are_blocks_split_by_heads_at_any_input_spec():
    """Every attention of the model is a block whose q, k and v are split by columns and whose
    output is split by rows, the two lone cross-attentions included; traced at 2 x 16 and at
    3 x 12, the plans place every parameter alike."""
    plans = [_planned(), _planned("inputs:int64:3x12")]
    assert [block.layer for block in plans[0].blocks] == list(ATTENTIONS)
    placements = _mp_placements(plans[0])
    assert placements == _mp_placements(plans[1])
    for layer in ATTENTIONS:
        for name in ("self.query", "self.key", "self.value"):
            assert placements[f"{layer}.attention.{name}.weight"] == "S(1)", (layer, name)
        assert placements[f"{layer}.attention.output.dense.weight"] == "S(0)", layer


def test_query_key_and_value_are_told_apart_by_dataflow_and_heads_counted_from_the_scores():
    """The recognised sizes: the heads from the scores, the head dim from the query's side of
    them, the KV heads from the key (and the value's own head width, wider than the query's in
    the decoder): none from a width that happens to equal another."""
    from autodist.planner.driver import analyse, load, trace

    loaded = load(PERCEIVER)
    analysis = analyse(loaded.model, trace(loaded.model, loaded.input_specs))
    found = {}
    for block in analysis.blocks:
        [attention] = [s for s in block.sublayers if s.kind == "attention"]
        assert [c.name for c in attention.columns] == ["q", "k", "v"]
        found[block.layer] = (attention.num_heads, attention.num_kv_heads, attention.head_dim)
    assert found == HEADS


def test_a_lone_attention_of_one_head_stays_replicated_with_a_note_and_the_rest_is_split():
    """HF's text classifier (``build_for_sequence_classification``): its decoder's cross-attention
    has HF's default one head, which no mp divides. Made a block, it would refuse every mp > 1 for
    the whole model; it stays replicated with a note naming it (found under the decoder's
    ``final_layer`` classifier, which the search looks past), and the encoder is split at mp2."""
    target = f"{PERCEIVER}:build_for_sequence_classification"
    plan = plan_target(target, None, gloo_mp2_request(), {"target": target}).plan
    assert plan.strategy.mp == 2
    assert [block.layer for block in plan.blocks] == list(ATTENTIONS)[:3]
    decoder = "perceiver.decoder.decoder.decoding_cross_attention"
    assert f"{decoder}: an attention written once, with 1 head(s), which mp=2 does not divide" in "\n".join(plan.notes)
    placements = _mp_placements(plan)
    assert {placements[fqn] for fqn in placements if fqn.startswith("perceiver.decoder.")} == {"R"}
    assert placements["perceiver.encoder.cross_attention.attention.self.query.weight"] == "S(1)"


@pytest.fixture(scope="module")
def trained(tmp_path_factory, reference_runs):
    """``{dp: Trained}``, one launch per world size."""
    workdir = tmp_path_factory.mktemp("xattn")
    runs, plans = [], {}
    for dp in DPS:
        plans[dp] = _planned(dp=dp)
        save_plan(plans[dp], workdir / f"perceiver_dp{dp}.json")
        runs.append(
            (
                TrainRun(
                    f"zoo_perceiver_hf_dp{dp}_mp2_xattn",
                    "zoo_perceiver_hf",
                    plan=str(workdir / f"perceiver_dp{dp}.json"),
                ),
                2 * dp,
            )
        )
    everything = [run for run, _ in runs]
    outputs = train_by_world(runs, workdir, timeout_s=600.0, references=(reference_runs, everything))
    return {dp: Trained(run, plans[dp], outputs[run.name]) for dp, run in zip(DPS, everything)}


@pytest.mark.multiprocess
@pytest.mark.parametrize("dp", DPS)
def test_perceiver_trains_like_one_device_with_every_attention_on_half_its_heads(trained, reference_runs, dp):
    """On ``2 * dp`` gloo ranks (dp x mp2): losses and parameters within 1e-5 of one device; on
    each rank, every attention's output projection reads half its heads' width, and the
    self-attentions' scores (square: latents against latents) hold 2 of their 4 heads."""
    run = trained[dp]
    assert (run.plan.strategy.dp, run.plan.strategy.mp) == (dp, 2)
    check_against_reference(run, reference_runs)
    for output in run.outputs:
        widths = output["linear_input_widths"]
        assert {layer: widths[f"{layer}.attention.output.dense"] for layer in ATTENTIONS} == {
            layer: [width] for layer, width in ATTENTIONS.items()
        }, widths
        assert output["score_shapes"] and {shape[1] for shape in output["score_shapes"]} == {2}, output
