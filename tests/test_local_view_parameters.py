"""Attentions holding a per-head parameter run head-parallel as local views (issue 30, unseen
community code): timm's Swin (tests/models/zoo/swin_timm.py) reads a relative-position-bias
table ``[(2W-1)^2, heads]`` at a buffer of indices and adds it, permuted, to each window's scores;
HF GPT-OSS concatenates a ``sinks`` logit per head to its scores (proven so; the model is
refused for its experts). Neither is a projection's weight, so the proof offers each cut to the
rank's heads along a dim of ``heads`` entries (``per_head_weights``) and keeps the cut only where
the ranks' runs reassemble the global run. The size names a candidate, the proof decides: CaiT's
talking heads (tests/models/talking_heads.py), ``Linear(heads, heads)`` mixing every head's
scores, is refused however it is cut.

Swin trained on 2 gloo ranks as its local views: tests/test_train_zoo.py.
"""

from __future__ import annotations

import msgspec
import pytest

from autodist.planner.driver import load
from autodist.planner.local_view_proof import NotProven, per_head_weights, verify
from autodist.schemas import LocalAttribute, LocalView, LocalWeight
from harness.planning import gloo_mp2_request, plan_target

SWIN = "tests/models/zoo/swin_timm.py"
TALKING_HEADS = "tests/models/talking_heads.py"


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
    offered = per_head_weights(layer, base, params, heads=4, mp=2)
    assert offered and all(
        {w.param.rpartition(".")[0] for w in o} == {f"{name}.proj_l", f"{name}.proj_w"} for o in offered
    )
    for extra in offered:
        with pytest.raises(NotProven, match="running it failed|differs from the global run's"):
            verify(layer, msgspec.structs.replace(base, weights=base.weights + extra), params, 2, [3, 5])
