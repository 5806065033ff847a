"""Attentions handed per-head biases and gradient-carrying inputs run head-parallel (issue 30,
items 2 and 3).

- MPT (tests/models/zoo/mpt_alibi.py) builds its ALiBi bias ``[1, H, 1, S]`` once in the model
  and adds it to every attention's scores; BLOOM (tests/models/zoo/bloom_hf.py) builds it
  ``[B * H, 1, S]`` (``build_alibi_tensor``) and adds it by ``baddbmm(alibi, q, k)``. Planned at
  mp2, each attention is a local view whose call cuts that input to the rank's heads
  (``CallInput.heads_at``): dim 1 of MPT's, dim 0 of BLOOM's (two heads of each batch row).
- BLOOM also hands its attention the residual, which it adds to the output (``dropout_add``):
  it carries a gradient, and the proof finds each rank must take 1/mp of it
  (``gradient="share"``), so the ranks' partial sums add it once, and its gradient is the whole
  one on each rank, as the output's. Taken whole, the output would hold it twice: the proof
  refuses that.

Trained on 2 gloo ranks (and BLOOM on 4, dp2 x mp2): losses and parameters as one device, each
rank's output projection reading its 2 heads of 4, MPT's scores holding 2 heads and BLOOM's
(``baddbmm``) and mix (``bmm``), over merged ``[batch * heads, ...]`` tensors, the rank's batch
rows times 2 heads.
"""

from __future__ import annotations

import msgspec
import paddle
import pytest

import autodist

from autodist.planner.driver import load
from autodist.planner.local_view_proof import NotProven, verify
from autodist.schemas import Plan, save_plan
from harness.cases import Trained, check_against_reference
from harness.jobs import TrainRun
from harness.planning import gloo_mp2_request, plan_target
from harness.runner import train_by_world
from harness.workloads import BATCH

MPT = "tests/models/zoo/mpt_alibi.py"
BLOOM = "tests/models/zoo/bloom_hf.py"
#: target -> (its attentions, their output projection, its input width on one rank: 2 of 4 heads),
#: read from the models: MPT's 4 heads over d_model 40, BLOOM's 4 heads over hidden 32.
ATTENTIONS = {
    MPT: ([f"transformer.blocks.{i}.attn" for i in (0, 1)], "out_proj", 40 // 2),
    BLOOM: ([f"transformer.h.{i}.self_attention" for i in (0, 1)], "dense", 32 // 2),
}
WORKLOAD = {MPT: "zoo_mpt_alibi", BLOOM: "zoo_bloom_hf"}
TRAININGS = [(MPT, 1), (BLOOM, 1), (BLOOM, 2)]


def _planned(target: str, dp: int = 1, spec: str | None = None) -> Plan:
    return plan_target(target, [spec] if spec else None, gloo_mp2_request(dp), {"target": target}, local_view=True).plan


def _calls(plan: Plan) -> list[list[tuple]]:
    """Each local view's call: the role, per-head dim and gradient of each argument."""
    return [[(c.role, c.heads_at, c.heads, c.gradient) for c in view.call] for view in plan.local_view]


def test_a_per_head_bias_and_a_residual_are_cut_and_shared_as_the_proof_finds():
    """MPT's ALiBi cut along its heads dim 1; BLOOM's along dim 0 (batch x heads), its residual
    a 1/mp share, its bool causal mask whole; the same decisions traced at 4 x 16, where BLOOM's
    ``[B * H, 1, S]`` has dim 0 equal to the sequence (16), and at 6 x 12."""
    want = {
        MPT: [("hidden", None, 0, ""), ("tensor", 1, 4, "")],
        BLOOM: [("hidden", None, 0, ""), ("tensor", None, 0, "share"), ("tensor", 0, 4, ""), ("mask", None, 0, "")],
    }
    for target, call in want.items():
        layers = ATTENTIONS[target][0]
        for spec in (None, "input_ids:int64:4x16", "input_ids:int64:6x12"):
            plan = _planned(target, spec=spec)
            assert [view.layer for view in plan.local_view] == layers, (target, spec, plan.notes)
            assert _calls(plan) == [call] * len(layers), (target, spec)
            assert all(a.name in ("num_heads", "n_heads", "d_model") for v in plan.local_view for a in v.attributes)


@pytest.mark.parametrize("target", [MPT, BLOOM])
def test_the_proof_refuses_a_per_head_bias_taken_whole_and_a_residual_added_on_every_rank(target):
    """The cut and the share are what the proof holds to: the bias given whole to each rank does
    not broadcast against (or does not equal) its heads' scores; BLOOM's residual taken whole by
    every rank is added twice in the summed output."""
    plan = _planned(target)
    view = plan.local_view[0]
    layer = dict(load(target).model.named_sublayers())[view.layer]
    params = {fqn: (p.shape, p.dtype) for fqn, p in plan.params.items()}
    assert "equal the global run" in verify(layer, view, params, 2, [3, 5])
    whole = [msgspec.structs.replace(c, heads_at=None, heads=0) for c in view.call]
    with pytest.raises(NotProven, match="running it failed|differs from the global run's"):
        verify(layer, msgspec.structs.replace(view, call=whole), params, 2, [3, 5])
    if target == BLOOM:
        added = [msgspec.structs.replace(c, gradient="whole" if c.gradient else "") for c in view.call]
        with pytest.raises(NotProven, match="the local runs' output differs"):
            verify(layer, msgspec.structs.replace(view, call=added), params, 2, [3, 5])


def _name(target: str, dp: int) -> str:
    return f"{WORKLOAD[target]}_dp{dp}_mp2_heads"


@pytest.fixture(scope="module")
def trained(tmp_path_factory, reference_runs):
    """The :data:`TRAININGS`, one launch per world size: ``{run name: Trained}``."""
    workdir = tmp_path_factory.mktemp("heads")
    runs, plans = [], {}
    for target, dp in TRAININGS:
        name = _name(target, dp)
        plans[name] = _planned(target, dp)
        save_plan(plans[name], workdir / f"{name}.json")
        runs.append((TrainRun(name, WORKLOAD[target], plan=str(workdir / f"{name}.json")), 2 * dp))
    everything = [run for run, _ in runs]
    outputs = train_by_world(runs, workdir, timeout_s=600.0, references=(reference_runs, everything))
    return {run.name: Trained(run, plans[run.name], outputs[run.name]) for run in everything}


@pytest.mark.multiprocess
@pytest.mark.parametrize("target, dp", TRAININGS)
def test_attentions_with_per_head_biases_train_like_one_device_on_half_the_heads(trained, reference_runs, target, dp):
    """On ``2 * dp`` gloo ranks: losses and parameters within 1e-5 of one device, each rank's
    output projection reading 2 heads' width, MPT's scores (a 4-D matmul) 2 heads deep, BLOOM's
    scores (``baddbmm``) and mix (``bmm``) ``batch * 2`` rows deep (``batch * 4`` gathered)."""
    run = trained[_name(target, dp)]
    layers, row, width = ATTENTIONS[target]
    assert (run.plan.strategy.dp, run.plan.strategy.mp) == (dp, 2)
    assert [view.layer for view in run.plan.local_view] == layers
    check_against_reference(run, reference_runs)
    for output in run.outputs:
        widths = output["linear_input_widths"]
        assert [widths[f"{layer}.{row}"] for layer in layers] == [[width]] * len(layers), widths
        if target == MPT:
            assert output["score_shapes"] and {shape[1] for shape in output["score_shapes"]} == {2}, output
        else:  # BLOOM scores by baddbmm and mixes by bmm over [batch * heads, ...]: its dp rows x 2 heads
            products = output["batched_products"]
            rows = {shape[0] for op in ("baddbmm", "bmm") for shape in products[op]}
            assert products["baddbmm"] and rows == {BATCH // dp * 2}, products


class _OffsetAttention(paddle.nn.Layer):
    """An attention whose queries get a learned per-token offset shared by all heads (``[1, T,
    head_dim]``, broadcast over the heads), handed in by the model: the input carries a gradient
    and each rank's heads read it whole. Not ported from a community model (none found that does
    this with a fused q|k|v); it shows the proof's ``whole`` and its price."""

    def __init__(self, width: int = 32, heads: int = 4):
        super().__init__()
        self.num_heads, self.head_dim = heads, width // heads
        self.qkv = paddle.nn.Linear(width, 3 * width)
        self.o = paddle.nn.Linear(width, width)

    def forward(self, x, offset):
        b, t, _ = x.shape
        q, k, v = (
            z.reshape([b, t, self.num_heads, self.head_dim]).transpose([0, 2, 1, 3])
            for z in self.qkv(x).split(3, axis=-1)
        )
        q = q + offset.unsqueeze(1)
        weights = paddle.nn.functional.softmax(q @ k.transpose([0, 1, 3, 2]) / self.head_dim**0.5, axis=-1)
        return self.o((weights @ v).transpose([0, 2, 1, 3]).reshape([b, t, -1]))


class _OffsetModel(paddle.nn.Layer):
    def __init__(self, learned: bool, layers: int = 2):
        super().__init__()
        self.embed, self.offsets = paddle.nn.Embedding(64, 32), paddle.nn.Embedding(16, 8)
        if not learned:  # a fixed table instead: the same sizes, no gradient
            self.offsets = None
            self.register_buffer("table", paddle.randn([16, 8]))
        self.attns = paddle.nn.LayerList([_OffsetAttention() for _ in range(layers)])
        self.head = paddle.nn.Linear(32, 64)

    def forward(self, input_ids):
        x = self.embed(input_ids)
        positions = paddle.arange(input_ids.shape[1])
        offset = (self.offsets(positions) if self.offsets is not None else self.table[positions]).unsqueeze(0)
        for attn in self.attns:
            x = x + attn(x, offset)
        return self.head(x)


def test_an_input_the_heads_read_whole_is_proven_whole_and_its_gradient_sum_priced():
    """A gradient-carrying input each rank's heads read whole (``CallInput.gradient`` "whole",
    Megatron's ``f``) is proven so, its dim 0 (1, broadcast) not the batch, and its gradient's
    all-reduce over mp is in the plan's estimate (planner/cost/graph_cost.py ``_memory``): the mp
    bytes exceed those of the same model with a fixed table as the input by one all-reduce of the
    ``[1, 16, 8]`` float32 input per attention (2 x (mp - 1) / mp x 512 bytes at mp2)."""
    planned = {}
    for learned in (True, False):
        paddle.seed(0)
        planned[learned] = autodist.plan(
            _OffsetModel(learned), ["input_ids:int64:4x16"], devices=2, device="cpu", dp=1, mp=2, pp=1,
            sharding_stage=0,
        )  # fmt: skip
    calls = [[(c.role, c.gradient, c.batch) for c in view.call] for view in planned[True].local_view]
    assert calls == [[("hidden", "", True), ("tensor", "whole", False)]] * 2, planned[True].notes
    assert [[c.gradient for c in view.call] for view in planned[False].local_view] == [["", ""]] * 2
    extra = planned[True].estimate.comm_bytes.mp - planned[False].estimate.comm_bytes.mp
    assert extra == 2 * 512, extra
