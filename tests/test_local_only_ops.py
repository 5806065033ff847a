"""Ops Paddle 3.3 does not run on distributed tensors (``einsum``, ``x[mask]``: docs/paddle-notes.md)
are planned around, or refused with their layer named, instead of a plan that fails inside Paddle
at the first step.

- inside an MoE layer (fairscale's GShard dispatches by ``einsum("sec,sm->ecm")``; HF Switch
  Transformers' and Ling's experts read their tokens through a boolean mask, ``x[mask]``, which
  the trace shows as ``gather_nd(x, nonzero(mask))``): the MoE layers run on local tensors, whole
  on every rank, under every strategy apply_plan can run them so (dp, ep, or mp alone, without
  ZeRO, pp or sequence parallelism), and the others are not planned; before, ``--mp 2`` gave a
  plan whose first step raised ``PreconditionNotMet: Arg must be a vector of TensorDistAttr``
  (GShard) or ``NotImplementedError: Only support reshape operation on DenseTensor now``
  (Switch, Ling); they now train at mp2 like one device (tests/test_train_zoo.py);
- anywhere else (attention written with einsum, as lucidrains' x-transformers writes it): only
  as a local view (the sub-layer run on plain tensors, mp > 1 under the strategies local views
  run under, schemas/local_view.py); without local views no plan can train, and planning says so;
- but an einsum on constants and buffers alone (HF Falcon's rotary table, ``einsum("i,j->ij", t,
  self.inv_freq)`` with ``t`` an ``arange``) never sees a distributed tensor, so it refuses
  nothing (issue #22, item 3); before, Falcon was refused whatever the strategy.
"""

from __future__ import annotations

import msgspec
import paddle
import paddle.nn as nn
import paddle.nn.functional as F
import pytest

from autodist.applier.modes.expert_dispatch import expert_structure_problems
from autodist.planner.cost.hardware import PROFILES
from autodist.planner.cost.search import SearchRequest
from autodist.planner.driver import plan
from harness.planning import plan_target
from models.zoo import gpt_oss_hf
from autodist.planner.errors import PlannerError
from autodist.schemas.checks import check_plan

H100 = PROFILES["h100-sxm"]
GSHARD = "tests/models/zoo/gshard_fairscale.py"


def test_an_moe_layer_that_dispatches_by_einsum_is_planned_only_where_it_runs_on_local_tensors():
    request = SearchRequest(devices_per_node=4, dp=1, mp=2, pp=2, micro_batches=2, device=H100)
    with pytest.raises(PlannerError) as refused:
        plan_target(GSHARD, None, request, {"target": GSHARD})
    assert str(refused.value) == "no strategy satisfies the constraints on 4 devices"
    assert any(
        line.endswith(
            "einsum in decoder.layers.1.moe_layer runs on distributed tensors here, which Paddle 3.3 cannot do: "
            "the MoE layers run on local tensors only without ZeRO, pp or sequence parallelism"
        )
        for line in refused.value.detail.splitlines()
    ), refused.value.detail
    for request in (SearchRequest(devices_per_node=2, device=H100), SearchRequest(devices_per_node=2, dp=2, mp=1)):
        searched = plan_target(GSHARD, None, request, {"target": GSHARD}).plan
        assert [(h.action, h.layer) for h in searched.hooks if h.action.startswith("expert")] == [
            ("expert_dispatch", "decoder.layers.1.moe_layer"),
            ("expert_combine", "decoder.layers.1.moe_layer"),
        ]


#: MoE layers whose experts read their tokens through a boolean mask (``x[mask]``), and Qwen3-MoE's,
#: which reads them through integer positions (``x[None, top_x]``, a ``gather_nd`` of stacked
#: indices: Paddle runs it on DistTensors, and at mp2 its experts stay split over mp).
MASKED = {
    "tests/models/zoo/switch_transformers_hf.py": "encoder.block.1.layer.1.mlp",
    "tests/models/zoo/bailing_moe_hf.py": "model.layers.0.mlp",
    "tests/models/zoo/qwen3_moe_hf.py": None,
}


@pytest.mark.parametrize("target", list(MASKED))
def test_an_moe_layer_reading_tokens_through_a_boolean_mask_runs_on_local_tensors_under_mp(target):
    """What the planner picks at --devices 2 (mp2: its attention split over mp) runs the MoE
    layers whole on every rank as plain tensors, where Paddle runs ``x[mask]``: an expert
    dispatch at ep 1 around each, every parameter under it whole. Decided by the dataflow (a
    ``gather_nd`` indexed by a ``nonzero``), not by the model's names."""
    made = plan_target(target, None, SearchRequest(devices_per_node=2, device=PROFILES["cpu"]), {"target": target})
    assert (made.plan.strategy.dp, made.plan.strategy.mp, made.plan.strategy.ep) == (1, 2, 1)
    moe_layers = made.analysis.moe_layers
    dispatched = [h.layer for h in made.plan.hooks if h.action == "expert_dispatch"]
    under = {tuple(p.placements) for f, p in made.plan.params.items() if f.startswith(tuple(moe_layers))}
    if MASKED[target] is None:
        assert (made.analysis.moe_local_only, dispatched, ("S(1)",) in under) == ("", [], True)
        return
    assert made.analysis.moe_local_only == f"x[mask] (gather_nd of a boolean mask's positions) in {MASKED[target]}"
    assert (dispatched, under) == (moe_layers, {("R",)})
    assert MASKED[target] in [h.reason for h in made.plan.hooks if h.layer == MASKED[target]][0]
    assert f"{made.analysis.moe_local_only}: Paddle 3.3 runs it on plain tensors only" in " ".join(made.plan.notes)


class EinsumAttention(nn.Layer):
    """Attention as lucidrains' x-transformers writes it: einsum for the scores and the mix."""

    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.heads, self.scale = heads, (dim // heads) ** -0.5
        self.to_q, self.to_k, self.to_v = (nn.Linear(dim, dim, bias_attr=False) for _ in range(3))
        self.to_out = nn.Linear(dim, dim, bias_attr=False)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = (
            t(x).reshape([b, n, self.heads, -1]).transpose([0, 2, 1, 3]) for t in (self.to_q, self.to_k, self.to_v)
        )
        dots = paddle.einsum("bhid,bhjd->bhij", q, k) * self.scale
        out = paddle.einsum("bhij,bhjd->bhid", F.softmax(dots, axis=-1), v)
        return self.to_out(out.transpose([0, 2, 1, 3]).reshape([b, n, -1]))


class Block(nn.Layer):
    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(32), nn.LayerNorm(32)
        self.attn = EinsumAttention()
        self.ff = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.ff(self.norm2(x))


class EinsumTransformer(nn.Layer):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.layers = nn.LayerList([Block() for _ in range(2)])
        self.to_logits = nn.Linear(32, 64)

    def forward(self, tokens):
        x = self.emb(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.to_logits(x)


def test_an_einsum_attention_runs_as_a_local_view_and_is_split_so():
    """einsum has no SPMD rule: the attention is named with Megatron's roles (its scores and mix
    are einsums) and proven as a local view, where einsum runs on plain tensors. A strategy
    under which local views do not run (mp 1: DistTensors over dp) is rejected, naming einsum."""
    planned = plan(EinsumTransformer(), ["tokens:int64:2x8"], devices=2, device="h100-sxm")
    assert (planned.strategy.mp, [v.layer for v in planned.local_view]) == (2, ["layers.0.attn", "layers.1.attn"])
    axis = planned.mesh.axes.index("mp")
    placements = {f: p.placements[axis] for f, p in planned.params.items() if f.startswith("layers.0.attn.")}
    assert placements == {
        **{f"layers.0.attn.to_{n}.weight": "S(1)" for n in "qkv"},
        "layers.0.attn.to_out.weight": "S(0)",
    }
    assert any(
        "einsum in layers.0.attn runs on distributed tensors here" in r.reason and r.strategy.mp == 1
        for r in planned.alternatives.rejected
    ), planned.alternatives.rejected


def test_einsum_outside_an_moe_layer_without_local_views_is_one_error_naming_its_layer():
    with pytest.raises(PlannerError) as refused:
        plan(EinsumTransformer(), ["tokens:int64:2x8"], devices=2, device="h100-sxm", local_view=False)
    assert str(refused.value).startswith(
        "einsum in layers.0.attn: Paddle 3.3 does not run it on the distributed tensors apply_plan trains "
        "with (docs/paddle-notes.md), so no plan of this model can train; write it with matmul and transposes; "
        "model code: EinsumAttention.forward at tests/test_local_only_ops.py:"
    )


FALCON = "tests/models/zoo/falcon_hf.py"


def test_an_einsum_on_constants_and_buffers_refuses_nothing():
    """The zoo's Falcon builds its rotary table with einsum in its rotary layer's forward; it is
    planned with tensor parallelism (tests/test_zoo.py's placements) and trains at mp2 on two
    ranks to the single-device losses (tests/test_train_zoo.py)."""
    made = plan_target(FALCON, None, SearchRequest(devices_per_node=2, mp=2, device=H100), {"target": FALCON})
    assert made.plan.strategy.mp == 2
    assert made.plan.params["transformer.h.0.self_attention.query_key_value.weight"].placements == ["S(1)"]
    einsums = [d["layer"] for _, d in made.analysis.graph.nodes(data=True) if d["op"] == "pd_op.einsum"]
    assert einsums == [f"transformer.h.{i}.self_attention.maybe_rotary" for i in range(2)]


class PositionEinsum(nn.Layer):
    """The same table from position ids the model is given: they arrive distributed."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.register_buffer("inv_freq", 1.0 / (10000.0 ** (paddle.arange(0, 32, 2).astype("float32") / 32)))
        self.head = nn.Linear(32, 64)

    def forward(self, tokens, position_ids):
        freqs = paddle.einsum("bi,j->bij", position_ids.astype("float32"), self.inv_freq)
        return self.head(self.emb(tokens) * paddle.concat([freqs, freqs], axis=-1).cos())


def test_an_einsum_on_a_model_input_still_refuses():
    with pytest.raises(
        PlannerError, match=r"^einsum in the model's top level \(its own forward\): Paddle 3.3 does not run it"
    ):
        plan(PositionEinsum(), ["tokens:int64:2x8", "position_ids:int64:2x8"], devices=2, device="h100-sxm")


def test_an_einsum_that_only_reorders_dims_runs_on_local_values_and_keeps_its_split():
    """DiT's unpatchify, ``einsum("nhwpqc->nchpwq")`` in the model's own forward: apply_plan runs
    it on each rank's local value, its split dim moved with it and its gradient back the same way
    (the zoo's dit.py trains at mp2 on two ranks to the single-device losses,
    tests/test_train_zoo.py); an einsum that contracts still goes to Paddle, which refuses it."""
    import paddle.distributed as dist

    from autodist.applier.modes.local_einsum import run_permutations_locally

    mesh = dist.ProcessMesh([0], dim_names=["mp"])
    whole = paddle.rand([2, 3, 5])
    x = dist.shard_tensor(whole, mesh, [dist.Shard(1)])
    x.stop_gradient = False
    run_permutations_locally()
    y = paddle.einsum("abc->cab", x)
    assert y.is_dist() and y.placements == [dist.Shard(2)]
    assert paddle.equal_all(y._local_value(), whole.transpose([2, 0, 1])).item()
    (y * paddle.arange(30, dtype="float32").reshape([5, 2, 3])).sum().backward()
    assert paddle.equal_all(
        x.grad._local_value(), paddle.arange(30, dtype="float32").reshape([5, 2, 3]).transpose([1, 2, 0])
    ).item()
    with pytest.raises(Exception, match="TensorDistAttr"):
        paddle.einsum("abc,cd->abd", x, paddle.rand([5, 4]))


class MaskedTokens(nn.Layer):
    """Logits of the non-padding tokens only, read through a boolean mask in the model's forward."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.head = nn.Linear(32, 64)

    def forward(self, tokens):
        return self.head(self.emb(tokens)[tokens > 0])


def test_a_boolean_mask_read_outside_an_moe_layer_is_one_error_naming_its_layer():
    with pytest.raises(PlannerError) as refused:
        plan(MaskedTokens(), ["tokens:int64:2x8"], devices=2, device="h100-sxm")
    assert str(refused.value).startswith(
        "x[mask] (gather_nd of a boolean mask's positions) in the model's top level (its own forward): Paddle 3.3 "
        "does not run it on the distributed tensors apply_plan trains with (docs/paddle-notes.md), so no plan of "
        "this model can train; write it without a boolean index (paddle.where, or a multiply by the mask); "
        "model code: MaskedTokens.forward at tests/test_local_only_ops.py:"
    )


GPT_OSS = "tests/models/zoo/gpt_oss_hf.py"


def test_batched_experts_indexed_by_a_computed_position_run_whole_on_local_tensors():
    """HF GPT-OSS's experts are one layer's batched weights (``gate_up_proj [4, 40, 48]``, ...) read
    by a loop over the experts that got tokens, ``self.gate_up_proj[expert_idx]``: an ``x[t]`` Paddle
    runs on plain tensors only. The dataflow finds them (that op in the layer, its parameters split
    by nothing the plan splits, one leading dim of 4 that its parent's ``topk`` selects over), so
    the parent, router and experts, runs whole on every rank as plain tensors under mp (the rest
    head-parallel); before, the model was refused in one line. What cannot run so is left out in
    the owner's words: expert parallelism (no rank can drop some of a batched weight: apply_plan
    refuses such a plan), ZeRO (check_plan refuses a plan edited to it)."""
    request = SearchRequest(devices_per_node=2, mp=2, device=PROFILES["cpu"])
    made = plan_target(GPT_OSS, None, request, {}, local_view=True)  # its attention: a local view
    experts = [b.experts for b in made.analysis.blocks]
    assert [(e.layer, e.count, e.top_k, e.batched) for e in experts if e] == [
        (f"model.layers.{i}.mlp.experts", 4, 2, True) for i in (0, 1)
    ]
    assert made.analysis.moe_local_only == (
        "x[i] (a slice at a position computed from the model's data) in model.layers.0.mlp.experts"
    )
    mlps = ["model.layers.0.mlp", "model.layers.1.mlp"]
    assert [h.layer for h in made.plan.hooks if h.action == "expert_dispatch"] == mlps
    assert {tuple(p.placements) for f, p in made.plan.params.items() if ".mlp." in f} == {("R",)}
    assert made.plan.params["model.layers.0.self_attn.q_proj.weight"].placements == ["S(1)"]
    with pytest.raises(PlannerError, match=r"^--ep 2: the experts of model.layers.0 are one layer's batched weights"):
        plan_target(GPT_OSS, None, SearchRequest(devices_per_node=4, dp=2, mp=2, ep=2), {})
    with pytest.raises(PlannerError, match=r"^--dp 2 with --sharding-stage 1: data parallelism of an MoE model"):
        plan_target(GPT_OSS, None, SearchRequest(devices_per_node=4, dp=2, mp=2, sharding_stage=1), {})
    spread = msgspec.structs.replace(made.plan, strategy=msgspec.structs.replace(made.plan.strategy, dp=2, ep=2))
    assert expert_structure_problems(gpt_oss_hf.build_model(), spread) == [  # apply_plan's refusal
        f'experts: "model.layers.{i}.mlp.experts" has 0 numbered sub-layers, the plan spreads 4 experts over ep ranks'
        for i in (0, 1)
    ]
    assert expert_structure_problems(gpt_oss_hf.build_model(), made.plan) == []
    zero = msgspec.structs.replace(made.plan.strategy, dp=2, sharding_stage=1)
    edited = msgspec.structs.replace(made.plan, strategy=zero)  # its mesh left as it was: refused for that too
    assert "$.strategy: dp=2 with sharding_stage=1: data parallelism of an MoE model is not built with ZeRO" in (
        " ".join(check_plan(edited))
    )
