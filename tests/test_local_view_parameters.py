"""Attentions holding a per-head parameter or buffer run head-parallel as local views (issue 30,
unseen community code): timm's Swin (tests/models/zoo/swin_timm.py) reads a relative-position-bias
table ``[(2W-1)^2, heads]`` at a buffer of indices and adds it, permuted, to each window's scores;
HF GPT-OSS concatenates a ``sinks`` logit per head to its scores (proven so; the model is
refused for its experts); timm's BEiT (tests/models/zoo/beit_timm.py) reads its ``qkv``'s weight
by ``F.linear`` with the bias ``concat(q_bias, k_bias, v_bias)``, ``k_bias`` a zero buffer. None
is a projection's weight, so the proof offers each cut to the rank's heads along a dim of
``heads`` entries or of the heads' width (``per_head_cuts``; a float buffer cut, then whole) and
keeps the cut only where the ranks' runs reassemble the global run. The size names a candidate,
the proof decides: CaiT's talking heads (tests/models/talking_heads.py), ``Linear(heads, heads)``
mixing every head's scores, is refused however it is cut; BEiT's ``k_bias`` taken whole is refused,
and a buffer of the heads' width subtracted from the whole input is refused cut and kept whole.

Swin and BEiT trained on 2 gloo ranks as their local views (BEiT on 4 too): tests/test_train_zoo.py;
BEiT under selective recompute with micro-batches and under full recompute: here.
"""

from __future__ import annotations

import msgspec
import paddle
import pytest

from autodist.planner.driver import load
from autodist.planner.local_view_proof import NotProven, per_head_cuts, verify
from autodist.schemas import LocalAttribute, LocalBuffer, LocalView, LocalWeight, save_plan
from harness.cases import Trained, check_against_reference
from harness.jobs import TrainRun
from harness.planning import gloo_mp2_request, plan_target
from harness.runner import train_by_world

SWIN = "tests/models/zoo/swin_timm.py"
TALKING_HEADS = "tests/models/talking_heads.py"
BEIT = "tests/models/zoo/beit_timm.py"
CENTRED = "tests/models/talking_heads.py:build_centred"
BEIT_ATTENTIONS = ["blocks.0.attn", "blocks.1.attn"]


def _swin_plan():
    return plan_target(SWIN, None, gloo_mp2_request(1), {"target": SWIN}, local_view=True).plan


def test_swin_attention_runs_as_a_local_view_its_table_split_by_heads():
    plan = _swin_plan()
    layers = [f"layers.{stage}.blocks.{block}.attn" for stage in (0, 1) for block in (0, 1)]
    assert [view.layer for view in plan.local_view] == layers, plan.notes
    for view in plan.local_view:
        table = f"{view.layer}.relative_position_bias_table"
        assert [(w.dim, w.segments) for w in view.weights if w.param == table] == [(1, 1)]
        assert plan.params[table].placements == ["S(1)"]
    assert not any("attn: no pattern matched" in note for note in plan.notes)  # the table is placed


def test_the_proof_refuses_the_swin_table_taken_whole():
    """Each rank adding the whole table (all heads) to its heads' scores: the proof refuses it."""
    plan = _swin_plan()
    view = plan.local_view[-1]  # a shifted window's attention: called with its mask too
    layer = dict(load(SWIN).model.named_sublayers())[view.layer]
    params = {fqn: (p.shape, p.dtype) for fqn, p in plan.params.items()}
    assert "equal the global run" in verify(layer, view, params, 2, [3, 5])
    whole = [msgspec.structs.replace(w, dim=None) if w.param.endswith("_table") else w for w in view.weights]
    with pytest.raises(NotProven, match="running it failed|differs from the global run's"):
        verify(layer, msgspec.structs.replace(view, weights=whole), params, 2, [3, 5])


def test_a_parameter_mixing_the_heads_is_offered_cut_and_refused_by_the_proof():
    model = load(TALKING_HEADS).model
    layer = model.blocks[0].attn
    name = "blocks.0.attn"
    params = {f"{name}.{fqn}": (p.shape, p.dtype) for fqn, p in layer.named_parameters()}
    base = LocalView(
        layer=name,
        weights=[
            LocalWeight(param=f"{name}.qkv.weight", dim=1, segments=3),
            LocalWeight(param=f"{name}.proj.weight", dim=0),
            LocalWeight(param=f"{name}.proj.bias", summed=True),
        ],
        attributes=[LocalAttribute(layer=name, name="num_heads", whole=4, local=2)],
    )
    offered = per_head_cuts(layer, base, params, {4, 4 * 6}, mp=2)
    assert offered and all(
        {w.param.rpartition(".")[0] for w in o.weights} == {f"{name}.proj_l", f"{name}.proj_w"} for o in offered
    )
    for extra in offered:
        with pytest.raises(NotProven, match="running it failed|differs from the global run's"):
            verify(layer, msgspec.structs.replace(base, weights=base.weights + extra.weights), params, 2, [3, 5])


def _beit_plan(target: str = BEIT, **strategy):
    return plan_target(target, None, gloo_mp2_request(1, **strategy), {"target": target}, local_view=True).plan


def test_beit_attention_runs_as_a_local_view_its_biases_split_and_its_zero_buffer_cut():
    """Both builds: q|k|v read by F.linear split rank by rank (``q_r|k_r|v_r``), the table by heads;
    with biases, ``q_bias`` and ``v_bias`` split by heads (placed ``S(0)``) and ``k_bias``, a
    buffer, cut the same way for the call."""
    for target, biased in ((BEIT, True), (f"{BEIT}:build_without_qkv_bias", False)):
        plan = _beit_plan(target)
        assert [view.layer for view in plan.local_view] == BEIT_ATTENTIONS, plan.notes
        for view in plan.local_view:
            own = {w.param.removeprefix(view.layer + "."): (w.dim, w.segments) for w in view.weights}
            want = {"qkv.weight": (1, 3), "relative_position_bias_table": (1, 1), "proj.weight": (0, 1)}
            assert {k: v for k, v in own.items() if k in want} == want
            assert ("q_bias" in own, "v_bias" in own) == (biased, biased)
            cut = [LocalBuffer(name=f"{view.layer}.k_bias", dim=0, shape=[40])] if biased else []
            assert view.buffers == cut and view.input_width == "local"
            assert [(a.name, a.local) for a in view.attributes] == [("num_heads", 2)]
        if biased:
            assert plan.params["blocks.0.attn.q_bias"].placements == ["S(0)"]


def test_the_proof_refuses_the_beit_k_bias_taken_whole():
    """Each rank concatenating the whole ``k_bias`` between its heads' ``q_bias`` and ``v_bias``: its
    bias no longer fits its 1/mp of the fused projection's output, and the proof says so."""
    plan = _beit_plan()
    view = plan.local_view[0]
    layer = dict(load(BEIT).model.named_sublayers())[view.layer]
    params = {fqn: (p.shape, p.dtype) for fqn, p in plan.params.items()}
    assert "equal the global run" in verify(layer, view, params, 2, [3, 65])
    with pytest.raises(NotProven, match="running it failed"):
        verify(layer, msgspec.structs.replace(view, buffers=[]), params, 2, [3, 65])


def test_apply_plan_refuses_a_model_whose_cut_buffer_differs():
    """The plan's ``k_bias`` ``[40]`` against a model whose buffer is ``[48]``, or missing: one line each."""
    from autodist.applier.modes.local_calls import local_view_problems

    plan = _beit_plan()
    model = load(BEIT).model
    assert local_view_problems(model, plan) == []
    model.blocks[0].attn.k_bias = paddle.zeros([48])
    del model.blocks[1].attn._buffers["k_bias"]
    assert local_view_problems(model, plan) == [
        "local_view blocks.0.attn: buffer blocks.0.attn.k_bias should have shape [40], cut along dim 0 into 2 "
        "equal slices; the model's is [48]",
        "local_view blocks.1.attn: buffer blocks.1.attn.k_bias should have shape [40], cut along dim 0 into 2 "
        "equal slices; the model's is missing",
    ]


#: BEiT trained under the other strategies the search may pick with local views: its attention
#: recomputed inside the view with 2 micro-batches of accumulation, and its blocks recomputed whole.
COMPOSED = {"selective_m2": {"recompute": "selective", "micro_batches": 2}, "full": {"recompute": "full"}}


@pytest.fixture(scope="module")
def beit_composed(tmp_path_factory, reference_runs):
    workdir = tmp_path_factory.mktemp("beit")
    runs, plans = [], {}
    for name, strategy in COMPOSED.items():
        plans[name] = _beit_plan(**strategy)
        save_plan(plans[name], workdir / f"{name}.json")
        runs.append((TrainRun(f"zoo_beit_timm_{name}", "zoo_beit_timm", plan=str(workdir / f"{name}.json")), 2))
    everything = [run for run, _ in runs]
    outputs = train_by_world(runs, workdir, timeout_s=600.0, references=(reference_runs, everything))
    return {name: Trained(run, plans[name], outputs[run.name]) for name, run in zip(COMPOSED, everything)}


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", sorted(COMPOSED))
def test_beit_local_views_train_like_one_device_under_recompute_and_micro_batches(beit_composed, reference_runs, name):
    """On 2 gloo ranks: losses and parameters as one device; each rank's scores hold 2 of the 4
    heads for its micro-batch's rows, computed again in the backward (3 steps, 2 blocks)."""
    run = beit_composed[name]
    strategy = run.plan.strategy
    assert {field: getattr(strategy, field) for field in COMPOSED[name]} == COMPOSED[name]
    assert [view.layer for view in run.plan.local_view] == BEIT_ATTENTIONS
    assert run.plan.recompute == (BEIT_ATTENTIONS if strategy.recompute == "selective" else ["blocks.0", "blocks.1"])
    check_against_reference(run, reference_runs)
    rows = run.run.batch // strategy.micro_batches
    for output in run.outputs:
        shapes = output["score_shapes"]
        assert len(shapes) == run.run.steps * strategy.micro_batches * 2 * 2, len(shapes)
        assert {tuple(s) for s in shapes} == {(rows, 2, 65, 65)}


def test_a_buffer_of_the_heads_width_read_whole_is_offered_cut_and_kept_whole():
    """The centred attention's ``mean`` ``[24]`` (4 heads of 6, tests/models/talking_heads.py) is
    offered cut like BEiT's ``k_bias``; subtracted from the whole input each rank takes, cut it does
    not fit, and the view keeps it whole."""
    plan = plan_target(CENTRED, None, gloo_mp2_request(1), {"target": CENTRED}, local_view=True).plan
    assert [view.layer for view in plan.local_view] == ["blocks.0.attn", "blocks.1.attn"], plan.notes
    view = plan.local_view[0]
    assert view.buffers == []
    layer = dict(load(CENTRED).model.named_sublayers())[view.layer]
    params = {fqn: (p.shape, p.dtype) for fqn, p in plan.params.items()}
    (offered,) = [cut.buffers for cut in per_head_cuts(layer, view, params, {4, 4 * 6}, mp=2) if cut.buffers]
    assert offered == [LocalBuffer(name="blocks.0.attn.mean", dim=0, shape=[24])]
    with pytest.raises(NotProven, match="running it failed"):
        verify(layer, msgspec.structs.replace(view, buffers=offered), params, 2, [3, 5])


def test_a_table_cached_by_the_first_call_is_made_again_by_each_rank_in_the_proof():
    """HF Falcon's rotary layer caches its cos/sin table in its first forward, from its
    ``inv_freq`` ``[4]`` (as many entries as the attention's 4 heads, so offered cut). Each rank's
    first step makes the table again from its own ``inv_freq``: cut, the table is half as wide and
    the rotary does not broadcast. The proof once reused the global run's cached table in the
    ranks' runs, proved the cut, and the plan failed at step 1; each run now starts from the
    layer as it was, and the cut is refused."""
    target = "tests/models/zoo/falcon_hf.py"
    plan = plan_target(target, None, gloo_mp2_request(1), {"target": target}, local_view=True).plan
    assert [view.layer for view in plan.local_view] == [
        "transformer.h.0.self_attention",
        "transformer.h.1.self_attention",
    ]
    assert [view.buffers for view in plan.local_view] == [[], []]
    view = plan.local_view[0]
    layer = dict(load(target).model.named_sublayers())[view.layer]
    params = {fqn: (p.shape, p.dtype) for fqn, p in plan.params.items()}
    cut = [LocalBuffer(name=f"{view.layer}.maybe_rotary.inv_freq", dim=0, shape=[4])]
    with pytest.raises(NotProven):
        verify(layer, msgspec.structs.replace(view, buffers=cut), params, 2, [3, 5])
