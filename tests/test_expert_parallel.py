"""Expert parallelism: recognised on the Mixtral-style zoo model, priced from first principles
(an all-gather and an all-reduce per MoE layer each way, so any backend runs it, gloo on CPU
included), chosen only with pp 1, ZeRO 0 and no sequence parallelism (any mp: the MoE layers
then run whole on every mp rank), written into the plan as hooks and placements, and explained
when asked for where it cannot run."""

from __future__ import annotations

import dataclasses

import msgspec
import pytest

from autodist.planner.cost.blocks import BlockCost, ModelCost, Saved
from autodist.planner.cost.graph_cost import model_cost
from autodist.planner.cost.hardware import PROFILES
from autodist.planner.cost.search import SearchRequest, expert_problem, search
from autodist.schemas.describe import strategy_text
from autodist.planner.cost.step_time import Setup, StageTable, estimate
from autodist.planner.cost.strategy_analysis import RunsAs
from autodist.planner.recognise.analysis import experts_whole
from harness.planning import plan_target
from autodist.planner.errors import PlannerError
from autodist.schemas import ExpertCombine, ExpertDispatch, Strategy, check_plan, dump_plan, load_plan

H100 = PROFILES["h100-sxm"]
MIXTRAL = "tests/models/zoo/mixtral_moe.py"
BAILING = "tests/models/zoo/bailing_moe_hf.py"


def moe_model(experts: int = 8, expert_params: int = 4_000_000) -> ModelCost:
    """Two MoE blocks of 1000 hidden, written by hand: 30 parameter tensors each, of which the
    experts' 24 (8 experts of 3) and the router's 1 of 4000 elements; each MoE layer's router
    saves 3000 elements per token for backward."""
    block = BlockCost(
        layer="b",
        params_split=expert_params + 1_000_000,
        params_whole=2000,
        flops_per_token=1e6,
        param_tensors=30,
        experts=experts,
        expert_params=expert_params,
        expert_tensors=24,
        router_params=4000,
        router_tensors=1,
        dispatch_per_token=1000,
        saved_router=Saved(floats=3000),
    )
    return ModelCost(blocks=(block, block), hidden_size=1000, traced_batch=8, traced_seq=128)


def setup(world: int = 8, batch: int = 8, recompute: str = "none") -> Setup:
    return Setup(device=H100, devices_per_node=world, nodes=1, seq_len=128, global_batch=batch, recompute=recompute)


def test_an_all_gather_and_an_all_reduce_per_moe_layer_each_way_of_the_ep_groups_tokens():
    # What the plan's hooks do, per MoE layer and micro-batch, with B the bytes of the layer's
    # input on one rank: expert_dispatch all-gathers the 4 ranks' inputs (4B, each rank sending
    # 3B on a ring), expert_combine all-reduces the 4B output (a ring all-reduce sends twice
    # 3/4 of it, 6B); the backward gathers the output gradient and all-reduces the input
    # gradient, the same again. So 2 x (3B + 6B) = 6 (ep-1) B per layer, written out here by hand
    # from the ring formulas (Thakur et al.) rather than by calling the cost model's helpers.
    plain = estimate(StageTable(moe_model()), Strategy(dp=8), setup())
    spread = estimate(StageTable(moe_model()), Strategy(dp=8, ep=4), setup())
    tokens, width = 1 * 128, 2  # one sample of 128 per dp rank, bf16
    b = tokens * 1000 * width  # one MoE layer's input on one rank
    assert spread.estimate.comm_bytes.ep == 2 * 6 * 3 * b  # 2 layers
    assert plain.estimate.comm_bytes.ep == 0
    alpha, bandwidth = H100.intra_node_latency_s, H100.intra_node_bandwidth  # 4 neighbours in a node
    gather = 3 * alpha + 3 * b / bandwidth  # (p-1) steps, (p-1)/p of 4B
    all_reduce = 6 * alpha + 6 * b / bandwidth  # 2(p-1) steps, 2(p-1)/p of 4B
    assert spread.ep_comm_s == pytest.approx(2 * 2 * (gather + all_reduce))  # 2 layers, forward and backward
    # each rank holds a quarter of the experts: their states shrink by 3/4
    saved = 2 * 4_000_000 * 3 / 4
    assert plain.estimate.memory.params - spread.estimate.memory.params == round(saved * width)
    # each router's 3000 saved elements per token are now for 4 x the tokens: 3 x more per layer
    extra = 2 * 3 * 3000 * width * tokens
    assert spread.estimate.memory.activations - plain.estimate.memory.activations == extra
    # full recompute runs the forward's gather and all-reduce once more in the backward
    again = estimate(StageTable(moe_model()), Strategy(dp=8, ep=4, recompute="full"), setup(recompute="full"))
    assert again.estimate.comm_bytes.ep == 2 * 9 * 3 * b


def test_with_mp_the_moe_layer_runs_whole_on_each_mp_rank_of_the_ep_group():
    # Two blocks of 1000 hidden written by hand, as the trace gives them: at mp 2 without ep the
    # attention and the experts' MLPs are both split (an all-reduce of 1000 elements per token
    # each way for each); under ep (the analysis as ep runs it) the MoE layer runs whole on every mp rank: its
    # experts' 4M elements are whole (then 1 / ep of them held), its MLPs have no all-reduce,
    # only the attention's is left.
    def block(experts_split: bool) -> BlockCost:
        return BlockCost(
            layer="b",
            params_split=1_000_000 + (4_000_000 if experts_split else 0),
            params_whole=2000 + (0 if experts_split else 4_000_000),
            flops_per_token=1e6,
            allreduce_fwd_per_token=2000 if experts_split else 1000,
            allreduce_bwd_per_token=2000 if experts_split else 1000,
            allreduce_fwd_count=2 if experts_split else 1,
            allreduce_bwd_count=2 if experts_split else 1,
            param_tensors=30,
            experts=8,
            expert_params=4_000_000,
            expert_tensors=24,
            router_params=4000,
            router_tensors=1,
            dispatch_per_token=1000,
            saved_router=Saved(floats=3000),
        )

    whole = ModelCost(blocks=(block(False),) * 2, hidden_size=1000, traced_batch=8, traced_seq=128)
    model = ModelCost(blocks=(block(True),) * 2, hidden_size=1000, traced_batch=8, traced_seq=128)
    # (ZeRO-1 keeps the MoE layers as DistTensors at ep 1: runs_moe_locally; params are not split by it)
    split = estimate(StageTable(model), Strategy(dp=4, mp=2, sharding_stage=1), setup())
    spread = estimate(StageTable(whole), Strategy(dp=4, mp=2, ep=2), setup())  # the model as ep runs it
    tokens, width = 2 * 128, 2  # two samples of 128 per dp rank, bf16
    # a ring all-reduce over mp 2 sends 2 (2-1)/2 of the tensor: once per 1000 elements per token
    assert split.estimate.comm_bytes.mp == 2 * 2 * 2000 * tokens * width * 1
    assert spread.estimate.comm_bytes.mp == 2 * 2 * 1000 * tokens * width * 1
    # per rank: the attention's 1M over mp, the norms' 2000, half the experts (ep 2) undivided by mp
    assert split.estimate.memory.params == 2 * (5_000_000 // 2 + 2000) * width
    assert spread.estimate.memory.params == 2 * (1_000_000 // 2 + 2000 + 4_000_000 // 2) * width
    # the ep group: 2 ranks mp = 2 apart on the dp axis, in the node; B the layer's input on one
    # rank: an all-gather (B sent) and an all-reduce of 2B (2B sent) each way, per layer
    b = tokens * 1000 * width
    assert spread.estimate.comm_bytes.ep == 2 * 2 * (b + 2 * b)
    alpha, bandwidth = H100.intra_node_latency_s, H100.intra_node_bandwidth
    assert spread.ep_comm_s == pytest.approx(2 * 2 * ((alpha + b / bandwidth) + (2 * alpha + 2 * b / bandwidth)))


def test_the_shared_experts_are_priced_on_the_ep_groups_first_rank_for_its_ep_times_the_tokens():
    # Each MoE layer's shared experts do 1e6 forward FLOPs per token. Under ep 4 the group's
    # first rank runs them on 4 x its tokens and the others not at all: the slowest rank does 3 x
    # 1e6 x the tokens more per layer, at the compute roof, forward once and backward twice
    # (full recompute: once more).
    plain, shared = (
        moe_model(),
        dataclasses.replace(
            moe_model(), blocks=(dataclasses.replace(moe_model().blocks[0], shared_flops_per_token=1e6),) * 2
        ),
    )
    tokens = 1 * 128  # one sample of 128 per dp rank
    roof = H100.peak_flops["bf16"] * H100.matmul_efficiency
    for recompute, passes in (("none", 3), ("full", 4)):
        without = estimate(StageTable(plain), Strategy(dp=8, ep=4, recompute=recompute), setup(recompute=recompute))
        spread = estimate(StageTable(shared), Strategy(dp=8, ep=4, recompute=recompute), setup(recompute=recompute))
        assert spread.compute_s - without.compute_s == pytest.approx(passes * 2 * 3 * 1e6 * tokens / roof)
    # at ep 1 every rank runs them on its own tokens, already in the block's FLOPs
    assert (
        estimate(StageTable(shared), Strategy(dp=8), setup()).compute_s
        == estimate(StageTable(plain), Strategy(dp=8), setup()).compute_s
    )


def test_the_routers_gradients_are_summed_over_dp_and_each_experts_over_the_ranks_holding_it():
    # apply_plan sums the MoE layers' gradients after the backward: the routers' over the 8 dp
    # ranks, each held expert's over the 8 / 4 = 2 ranks holding it; the rest of the model's
    # are all-reduced over dp as without ep. A ring all-reduce over p ranks: 2(p-1) latencies per
    # tensor and 2(p-1)/p of the bytes sent; on the cpu profile nothing overlaps the backward, so
    # the time is the sum. Written out by hand from those formulas.
    cpu = PROFILES["cpu"]
    on_cpu = Setup(device=cpu, devices_per_node=8, nodes=1, seq_len=128, global_batch=8)
    plain = estimate(StageTable(moe_model()), Strategy(dp=8), on_cpu)
    spread = estimate(StageTable(moe_model()), Strategy(dp=8, ep=4), on_cpu)
    width, every = 2, 2 * (5_000_000 + 2000)  # bf16; both blocks' elements
    assert plain.estimate.comm_bytes.dp == round(2 * 7 / 8 * every * width)
    held, router = 2 * 4_000_000 / 4, 2 * 4000  # per rank: a quarter of the experts, both routers
    rest = every - 2 * 4_000_000 - router
    assert spread.estimate.comm_bytes.dp == round((2 * 7 / 8 * rest + 2 * 7 / 8 * router + 2 * 1 / 2 * held) * width)
    alpha, bandwidth = cpu.intra_node_latency_s, cpu.intra_node_bandwidth  # all 8 ranks in a node
    # tensors per rank: every expert's left out of the rest (a quarter held, the others dropped)
    tensors = {"rest": 2 * 30 - 2 * 24 - 2 * 1, "router": 2 * 1, "experts": 2 * 24 // 4}
    assert spread.dp_comm_s == pytest.approx(
        2 * 7 * alpha * tensors["rest"]
        + 2 * 7 / 8 * rest * width / bandwidth
        + 2 * 7 * alpha * tensors["router"]
        + 2 * 7 / 8 * router * width / bandwidth
        + 2 * 1 * alpha * tensors["experts"]
        + 2 * 1 / 2 * held * width / bandwidth
    )


def test_the_search_takes_ep_on_any_backend_with_any_mp_but_never_with_pp_or_zero():
    model = moe_model(expert_params=400_000_000)  # experts dominate memory: spreading them pays
    for device in (H100, PROFILES["cpu"]):  # gloo (cpu) has no all-to-all; ep needs none
        result = search(model, SearchRequest(devices_per_node=8, dp=8, mp=1, pp=1, ep=None, device=device))
        assert result.best.strategy.ep > 1, device.name
        assert "ep" in strategy_text(result.best.strategy, "short")
    # --ep auto with mp fixed at 2: the MoE layers run whole on each mp rank, ep still spreads them.
    with_mp = search(model, SearchRequest(devices_per_node=8, dp=4, mp=2, pp=1, ep=None, device=H100))
    assert (with_mp.best.strategy.mp, with_mp.best.strategy.ep > 1) == (2, True)
    # --ep 2 with the mesh searched: no mesh is refused for its mp; pp and ZeRO still are.
    fixed = search(model, SearchRequest(devices_per_node=4, pp=None, ep=2, device=H100))
    assert fixed.best.strategy.ep == 2
    assert not [r.reason for r in fixed.rejected if "with mp" in r.reason]
    assert any("ep=2 with pp=2" in r.reason for r in fixed.rejected)


def test_an_ep_with_what_it_cannot_go_with_is_one_error_naming_why():
    cases = {
        ("--pp", 2): "--ep 2 with --pp 2: expert parallelism inside a pipeline is not built",
        ("--sharding-stage", 1): "--ep 2 with --sharding-stage 1: ZeRO over the dp group with expert parallelism "
        "is not built (an expert's gradients are summed over other ranks than the rest)",
        ("--sequence-parallel", None): "--ep 2 with --sequence-parallel: sequence parallelism with expert "
        "parallelism is not built",
    }
    fields = {
        "--pp": "pp",
        "--sharding-stage": "sharding_stage",
        "--sequence-parallel": "sequence_parallel",
    }
    for (option, value), message in cases.items():
        asked = {fields[option]: True if value is None else value}
        request = SearchRequest(devices_per_node=4, ep=2, device=H100, **asked)
        with pytest.raises(PlannerError) as refused:
            plan_target(MIXTRAL, None, request, {"target": MIXTRAL})
        assert str(refused.value) == message


def test_data_parallelism_of_an_moe_model_never_goes_with_zero_a_pipeline_or_sequence_parallelism():
    """Under dp the MoE layers must run on each rank's own tokens (Paddle 3.3 routes dp-split
    DistTensors wrongly: HF Qwen3-MoE drifted from step 0 at dp2), which apply_plan does only
    without ZeRO, pp and sequence parallelism. So the search never pairs them, and asking for it
    is one error naming why."""

    def strategies(model: ModelCost) -> list[Strategy]:
        result = search(model, SearchRequest(devices_per_node=4, dp=2, device=H100))
        return [result.best.strategy, *(c.strategy for c in result.accepted)]

    moe = strategies(moe_model())
    assert all(s.pp == 1 and not s.sharding_stage and not s.sequence_parallel for s in moe), moe
    # the same blocks without experts take ZeRO and a pipeline there: the rule is what stops them
    dense = strategies(dataclasses.replace(moe_model(), blocks=(BlockCost(layer="b", params_split=5_002_000),) * 2))
    assert any(s.sharding_stage for s in dense) and any(s.pp > 1 for s in dense), dense

    why = "data parallelism of an MoE model is not built {} (its MoE layers run on each rank's own tokens)"
    cases = {
        (("sharding_stage", 1),): "--dp 2 with --sharding-stage 1: " + why.format("with ZeRO over the dp group"),
        (("pp", 2),): "--dp 2 with --pp 2: " + why.format("inside a pipeline"),
        (("mp", 2), ("sequence_parallel", True)): "--dp 2 with --sequence-parallel: "
        + why.format("with sequence parallelism"),
    }
    for asked, message in cases.items():
        request = SearchRequest(devices_per_node=8, dp=2, device=H100, **dict(asked))
        with pytest.raises(PlannerError) as refused:
            plan_target(MIXTRAL, None, request, {"target": MIXTRAL})
        assert str(refused.value) == message
    # without dp every rank sees every token: pipelines stay open
    alone = search(moe_model(), SearchRequest(devices_per_node=4, dp=1, device=H100))
    assert any(c.strategy.pp > 1 for c in [alone.best, *alone.accepted])


def test_sequence_parallelism_never_goes_with_an_moe_model():
    """Sequence parallelism hands the MoE layers their tokens split over mp, which Paddle 3.3
    routes wrongly as it does dp-split ones (HF Qwen3-MoE's MoE layer answered up to 4.3 away
    from one device on 2 ranks, docs/paddle-notes.md): never searched, one error when asked,
    refused in a plan."""
    alone = search(moe_model(), SearchRequest(devices_per_node=4, dp=1, device=H100))
    assert not any(c.strategy.sequence_parallel for c in [alone.best, *alone.accepted])
    dense = dataclasses.replace(moe_model(), blocks=(BlockCost(layer="b", params_split=5_002_000),) * 2)
    plain = search(dense, SearchRequest(devices_per_node=4, dp=1, device=H100))
    assert any(c.strategy.sequence_parallel for c in [plain.best, *plain.accepted])  # the rule stops it
    request = SearchRequest(devices_per_node=2, dp=1, mp=2, sequence_parallel=True, device=H100)
    with pytest.raises(PlannerError) as refused:
        plan_target(MIXTRAL, None, request, {"target": MIXTRAL})
    assert str(refused.value) == (
        "--sequence-parallel of an MoE model is not built (its MoE layers would route tokens split over mp, "
        "which Paddle 3.3 indexes wrongly)"
    )
    made = plan_target(MIXTRAL, None, SearchRequest(devices_per_node=2, dp=1, mp=2, device=H100), {"target": MIXTRAL})
    with_sp = msgspec.structs.replace(
        made.plan, strategy=msgspec.structs.replace(made.plan.strategy, sequence_parallel=True)
    )
    assert (
        "$.strategy: sequence parallelism of an MoE model is not built (its MoE layers would route tokens split "
        "over mp, which Paddle 3.3 indexes wrongly)"
    ) in check_plan(with_sp)


def test_ep_is_not_searched_unless_asked_and_must_divide_the_experts():
    model = moe_model(expert_params=400_000_000)
    default = search(model, SearchRequest(devices_per_node=8, dp=8, mp=1, pp=1, device=H100))
    assert default.best.strategy.ep == 1
    assert any("expert parallelism was not searched" in n for n in default.notes)
    assert expert_problem(moe_model(experts=6), 4, "--ep 4") == "--ep 4 does not divide the 6 experts of a block"
    plain = ModelCost(blocks=(BlockCost(layer="b"),), hidden_size=8)
    assert "no block has experts" in expert_problem(plain, 2, "--ep 2")


@pytest.mark.parametrize(
    "target, routing",
    [
        (MIXTRAL, ["layers.{}.block_sparse_moe.gate"]),
        ("tests/models/zoo/qwen2_moe_hf.py", ["model.layers.{}.mlp.gate", "model.layers.{}.mlp.shared_expert_gate"]),
    ],
)
def test_an_moe_layers_routing_is_whole_by_design_and_not_reported_as_unrecognised(target, routing):
    """The router (and Qwen2-MoE's shared-expert gate) stays whole on purpose: each token's top-k
    needs all its scores. Before, every MoE model's plan warned that an op stopped its split and
    that no pattern matched it, two warnings per MoE model that said nothing to act on."""
    made = plan_target(target, None, SearchRequest(devices_per_node=2, mp=2, device=H100), {"target": target})
    layers = [layer.format(i) for layer in routing for i in range(2)]
    assert all(made.plan.params[f"{layer}.weight"].placements == ["R"] for layer in layers)
    said = [*made.analysis.refusals, *made.analysis.unmatched, *made.plan.notes]
    assert not [line for line in said for layer in routing if layer.format("*") in line or layer.format(0) in line]


def test_mixtral_experts_are_recognised_and_recorded_in_the_plan():
    made = plan_target(
        MIXTRAL, None, SearchRequest(devices_per_node=2, dp=2, mp=1, pp=1, ep=2, device=H100), {"target": MIXTRAL}
    )
    plan = made.plan
    # written from the model: block_sparse_moe.experts is a LayerList of 4, paddle.topk(..., TOP_K=2)
    assert [(b.experts, b.num_experts, b.top_k) for b in plan.blocks] == [
        (f"layers.{i}.block_sparse_moe.experts", 4, 2) for i in range(2)
    ]
    assert plan.strategy.ep == 2 and plan.estimate.comm_bytes.ep > 0
    # what the cost model reads from the trace, per block: 4 experts of w1, w2, w3 (HIDDEN 32 x
    # INTER 64 each), the router gate (32 x 4), and the MoE layer's input of HIDDEN per token
    costs = model_cost(made.analysis).blocks
    assert {
        (b.expert_params, b.expert_tensors, b.router_params, b.router_tensors, b.dispatch_per_token) for b in costs
    } == {(4 * 3 * 32 * 64, 12, 32 * 4, 1, 32)}
    # The MoE layer is MixtralSparseMoeBlock (the experts' parent): its input is gathered over
    # the ep group before it, its output summed after it, in block order.
    moe = [f"layers.{i}.block_sparse_moe" for i in range(2)]
    assert [(type(h), h.layer, h.when, getattr(h, "experts", None)) for h in plan.hooks] == [
        hook
        for layer in moe
        for hook in ((ExpertDispatch, layer, "pre", f"{layer}.experts"), (ExpertCombine, layer, "post", None))
    ]
    # Everything under the MoE layer is whole (one mesh axis, dp): the router gate replicated,
    # each expert's w1, w2, w3 ExpertParallel; the attention and norms untouched at mp=1.
    expected = {f"{layer}.gate.weight": (["R"], "Replicate") for layer in moe}
    expected |= {
        f"{layer}.experts.{e}.{w}.weight": (["R"], "ExpertParallel")
        for layer in moe
        for e in range(4)
        for w in ("w1", "w2", "w3")
    }
    under_moe = {fqn: (p.placements, p.style) for fqn, p in plan.params.items() if fqn.startswith(tuple(moe))}
    assert under_moe == expected
    assert {p.style for fqn, p in plan.params.items() if fqn not in expected} == {"Replicate"}
    assert check_plan(load_plan(dump_plan(plan))) == []


@pytest.mark.parametrize(
    "target, moe, attention, shared_flops",
    [
        (MIXTRAL, "layers.{}.block_sparse_moe", "layers.{}.self_attn", 0),
        # its shared expert: gate_proj, up_proj, down_proj of HIDDEN 32 x SHARED_INTER 32
        ("tests/models/zoo/qwen2_moe_hf.py", "model.layers.{}.mlp", "model.layers.{}.self_attn", 3 * 2 * 32 * 32),
    ],
)
def test_with_mp_the_attention_is_split_and_everything_under_the_moe_layer_whole(target, moe, attention, shared_flops):
    def plan(ep: int, dp: int = 2):
        request = SearchRequest(
            devices_per_node=dp * 2,
            dp=dp,
            mp=2,
            pp=1,
            ep=ep,
            sequence_parallel=False,
            sharding_stage=0,
            device=H100,
        )
        # local_view: the token lookup runs on local tensors (as autodist-plan's default does)
        return plan_target(target, None, request, {"target": target}, local_view=True)

    # pure mp keeps the MoE layers as DistTensors (runs_moe_locally): the experts split over mp
    made, plain, local = plan(2), plan(1, dp=1), plan(1)
    layers = tuple(moe.format(i) + "." for i in range(2))
    assert (made.plan.strategy.mp, made.plan.strategy.ep) == (2, 2)
    # written from the models: q, k, v split by columns, o by rows, on the mesh's mp axis
    projections = {f"{attention.format(i)}.{p}_proj.weight": ["R", "S(1)"] for i in range(2) for p in "qkv"}
    projections |= {f"{attention.format(i)}.o_proj.weight": ["R", "S(0)"] for i in range(2)}
    assert {fqn: made.plan.params[fqn].placements for fqn in projections} == projections
    under = {fqn: p for fqn, p in made.plan.params.items() if fqn.startswith(layers)}
    assert {tuple(p.placements) for p in under.values()} == {("R", "R")}
    # without ep and dp, mp splits the experts' MLPs (so the rule above is the local MoE layers');
    # with dp and without ep they run locally, whole, on each rank's tokens
    assert any("S(" in "".join(plain.plan.params[fqn].placements) for fqn in under)
    assert {tuple(local.plan.params[fqn].placements) for fqn in under} == {("R", "R")}
    assert [h.action for h in local.plan.hooks if h.layer.startswith(moe.format(0))] == [
        "expert_dispatch",
        "expert_combine",
    ]
    assert not [h for h in made.plan.hooks if h.layer.startswith(layers) and type(h).__name__ == "Reshard"]
    # priced so: the experts' MLPs leave the mp all-reduces (pure mp's rank sees twice the tokens:
    # its attention alone would send twice made's bytes), each rank holds half the experts whole
    under_ep = model_cost(experts_whole(made.analysis))
    assert all(b.params_whole >= b.expert_params for b in under_ep.blocks)
    assert [b.shared_flops_per_token for b in under_ep.blocks] == [shared_flops] * 2
    # (the token lookup's all-reduce too: both look up on local tensors, its output by the tokens)
    assert made.plan.vocab_lookup and plain.plan.vocab_lookup
    assert made.plan.strategy.micro_batches == plain.plan.strategy.micro_batches == 1
    assert 2 * made.plan.estimate.comm_bytes.mp < plain.plan.estimate.comm_bytes.mp
    assert check_plan(load_plan(dump_plan(made.plan))) == []


def test_a_fused_attention_runs_as_a_local_view_beside_dispatched_moe_layers_and_is_priced_so():
    """Ling (BailingMoe) at dp2 x mp2 ep2: its fused ``query_key_value`` attention is a local view
    and its MoE layers are dispatched over ep, whole on each mp rank; the cost model prices the
    two together (``RunsAs(local=views, moe_whole=True)``): each block as the local view prices
    its attention (the core on 1/mp of the heads, no gather of q|k|v) and as the whole MoE layers
    price their parameters (held whole, out of the mp all-reduces)."""
    request = SearchRequest(
        devices_per_node=4, dp=2, mp=2, pp=1, ep=2, sequence_parallel=False, sharding_stage=0, device=H100
    )
    made = plan_target(BAILING, None, request, {"target": BAILING}, local_view=True)
    views = frozenset(v.layer for v in made.plan.local_view)
    assert views == {"model.layers.0.attention", "model.layers.1.attention"}
    assert {(h.action, h.layer) for h in made.plan.hooks} == {
        (action, f"model.layers.{i}.mlp") for action in ("expert_dispatch", "expert_combine") for i in range(2)
    }  # no reshard gathering q|k|v: the views compute on each rank's heads
    priced = made.priced
    assert priced is not None
    runs = priced.runs_as(made.plan.strategy, views)
    assert runs == RunsAs(views, moe_whole=True)
    both, views_alone, moe_alone = (priced.cost_of(r) for r in (runs, RunsAs(views), RunsAs(moe_whole=True)))
    for block, view, whole in zip(both.blocks, views_alone.blocks, moe_alone.blocks):
        # the attention as its local view: core on 1/mp of the heads, no gather, one all-reduce
        # (the gathered attention's core runs whole on every rank after one gather)
        assert (block.core_whole, block.gather_fwd_count) == (view.core_whole, view.gather_fwd_count) == (0.0, 0)
        assert (whole.core_whole, whole.gather_fwd_count) == (1.0, 1)
        # the MoE layer whole: its experts' and router's parameters held whole, not split over mp
        assert (block.params_split, block.params_whole) == (whole.params_split, whole.params_whole)
        assert block.params_whole >= block.expert_params + block.router_params > view.params_whole
        assert block.allreduce_fwd_count == whole.allreduce_fwd_count < view.allreduce_fwd_count
    assert check_plan(load_plan(dump_plan(made.plan))) == []


def test_a_plan_without_ep_reads_as_ep_1_and_a_bad_ep_is_named():
    made = plan_target(
        MIXTRAL, None, SearchRequest(devices_per_node=2, dp=2, mp=1, pp=1, device=H100), {"target": MIXTRAL}
    )
    data = msgspec.json.decode(dump_plan(made.plan))
    del data["strategy"]["ep"]
    old = load_plan(msgspec.json.encode(data))
    assert old.strategy.ep == 1 and check_plan(old) == []
    data["strategy"]["ep"] = 3
    problems = check_plan(msgspec.convert(data, type(old)))
    assert "$.strategy: ep=3 does not divide dp=2 (experts spread over dp ranks)" in problems
    assert "$.strategy.ep: 3 does not divide the 4 experts of a block" in problems


def test_show_and_export_say_what_ep_does():
    from autodist.planner.review.export import ExportError, export_parallelize
    from autodist.schemas.describe import strategy_text

    made = plan_target(
        MIXTRAL, None, SearchRequest(devices_per_node=2, dp=2, mp=1, pp=1, ep=2, device=H100), {"target": MIXTRAL}
    )
    assert strategy_text(made.plan.strategy).endswith("experts over 2 dp ranks (ep2)")
    with pytest.raises(ExportError, match=r"expert parallelism \(ep=2\): dist.parallelize has no key for it"):
        export_parallelize(made.plan)


def test_the_ep_option_of_the_command(tmp_path):
    from click.testing import CliRunner

    from autodist.planner.cli import cli

    def run(*args):
        return CliRunner().invoke(cli, ["plan", MIXTRAL, "--devices", "2", "--dp", "2", "--mp", "1", *args])

    on_cpu = run("--ep", "2", "--device", "cpu", "-o", str(tmp_path / "cpu.json"))
    assert on_cpu.exit_code == 0, on_cpu.output
    assert load_plan((tmp_path / "cpu.json").read_bytes()).strategy.ep == 2
    with_mp = CliRunner().invoke(
        cli, ["plan", MIXTRAL, "--devices", "4", "--mp", "2", "--ep", "2", "-o", str(tmp_path / "mp.json")]
    )
    assert with_mp.exit_code == 0, with_mp.output
    made_mp = load_plan((tmp_path / "mp.json").read_bytes()).strategy
    assert (made_mp.mp, made_mp.ep) == (2, 2)
    refused = CliRunner().invoke(
        cli, ["plan", MIXTRAL, "--devices", "4", "--pp", "2", "--ep", "2", "-o", str(tmp_path / "pp.json")]
    )
    assert refused.exit_code == 2 and "--ep 2 with --pp 2: expert parallelism inside a pipeline" in refused.output
    assert not (tmp_path / "pp.json").exists()
    bad = run("--ep", "two", "--device", "h100-sxm")
    assert bad.exit_code == 2 and "--ep must be a positive integer or auto, got 'two'" in bad.output
    made = run("--ep", "auto", "--device", "h100-sxm", "-o", str(tmp_path / "auto.json"))
    assert made.exit_code == 0, made.output
    plan = load_plan((tmp_path / "auto.json").read_bytes())
    assert plan.provenance.arguments["ep"] == "auto"
    assert any(c.strategy.ep == 2 for c in [plan, *plan.alternatives.accepted] if hasattr(c, "strategy"))


@pytest.fixture(scope="module")
def ep_plan():
    """The Mixtral zoo model's dp2 ep2 plan; its hooks are dispatch, combine of layers.0, then of layers.1."""
    request = SearchRequest(devices_per_node=2, dp=2, mp=1, pp=1, ep=2, device=PROFILES["cpu"])
    plan = plan_target(MIXTRAL, None, request, {"target": MIXTRAL}).plan
    assert check_plan(plan) == []
    return plan


def _with_param(plan, fqn: str, **changes):
    return msgspec.structs.replace(
        plan, params={**plan.params, fqn: msgspec.structs.replace(plan.params[fqn], **changes)}
    )


def test_check_plan_names_each_broken_expert_rule(ep_plan):
    """Each rule of schemas/checks.py check_experts, broken by hand, and the exact message."""
    moe0, hooks = "layers.0.block_sparse_moe", ep_plan.hooks
    replace = msgspec.structs.replace

    # At ep 1 the hooks may stay: the MoE layers then run on each rank's own tokens (plain dp).
    assert check_plan(replace(ep_plan, strategy=replace(ep_plan.strategy, ep=1))) == []

    combine_before = replace(ep_plan, hooks=[hooks[0], replace(hooks[1], when="pre"), *hooks[2:]])
    assert check_plan(combine_before) == ["$.hooks[1].when: an expert_combine hook runs 'post', not 'pre'"]

    experts_elsewhere = replace(
        ep_plan, hooks=[replace(hooks[0], experts="layers.1.block_sparse_moe.experts"), *hooks[1:]]
    )
    assert (
        "$.hooks[0].experts: 'layers.1.block_sparse_moe.experts' is not inside its layer 'layers.0.block_sparse_moe'"
        in check_plan(experts_elsewhere)
    )

    no_combine = replace(ep_plan, hooks=[hooks[0], *hooks[2:]])
    assert check_plan(no_combine) == [f"$.hooks[0]: an expert_dispatch on '{moe0}' without an expert_combine on it"]

    no_dispatch = check_plan(replace(ep_plan, hooks=hooks[1:]))
    assert f"$.hooks[0]: an expert_combine on '{moe0}' without an expert_dispatch on it" in no_dispatch
    assert f"$.blocks[0].experts: '{moe0}.experts' has no expert_dispatch hook, but $.strategy.ep is 2" in no_dispatch
    assert f'$.params["{moe0}.experts.0.w1.weight"].style: ExpertParallel, but no expert_dispatch hook holds it' in (
        no_dispatch
    )

    attention_as_expert = _with_param(ep_plan, "layers.0.self_attn.q_proj.weight", style="ExpertParallel")
    assert check_plan(attention_as_expert) == [
        '$.params["layers.0.self_attn.q_proj.weight"].style: ExpertParallel, but no expert_dispatch hook holds it'
    ]

    # At ep 1 with dp 2 too: the MoE layers then run on each rank's own tokens, between the hooks.
    zero_without_hooks = replace(ep_plan, strategy=replace(ep_plan.strategy, ep=1, sharding_stage=1), hooks=[])
    assert (
        f"$.blocks[0].experts: '{moe0}.experts' has no expert_dispatch hook, but $.strategy.dp is 2 "
        "(under data parallelism the MoE layers run on each rank's own tokens)"
    ) in check_plan(zero_without_hooks)

    split_router = _with_param(ep_plan, f"{moe0}.gate.weight", placements=["S(0)"])  # [32, 4] over dp=2
    assert check_plan(split_router) == [
        f"$.params[\"{moe0}.gate.weight\"].placements: ['S(0)'], but an MoE layer under expert parallelism runs "
        "whole on each rank (all R)"
    ]


def test_an_expert_parallel_plan_is_the_same_bytes_when_made_again(ep_plan):
    request = SearchRequest(devices_per_node=2, dp=2, mp=1, pp=1, ep=2, device=PROFILES["cpu"])
    again = plan_target(MIXTRAL, None, request, {"target": MIXTRAL}).plan
    assert dump_plan(again) == dump_plan(ep_plan)


def test_explain_says_what_the_ep_gathers_and_sums_cost():
    from autodist.planner.review.explain import explain_table
    from autodist.planner.review.format import human_seconds

    model = moe_model(expert_params=400_000_000)
    spread = search(model, SearchRequest(devices_per_node=8, dp=8, mp=1, pp=1, ep=4, device=H100))
    line = next(text for text in explain_table(spread).splitlines() if text.startswith("where the time of #1 goes"))
    assert f"ep gathers and sums {human_seconds(spread.breakdowns[0].ep_comm_s)}, " in line
    plain = search(model, SearchRequest(devices_per_node=8, dp=8, mp=1, pp=1, ep=1, device=H100))
    assert "ep gathers" not in explain_table(plain)
