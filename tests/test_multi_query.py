"""Multi-query attention (issue #22, item 3): with fewer KV heads than ranks, K/V stay whole.

HF Gemma's 2B shape has one KV head shared by all query heads (tests/models/zoo/gemma_mqa_hf.py).
Megatron and HF split such an attention by replicating K/V and splitting Q by heads and the
output projection by rows. Before, the planner left the whole attention replicated (the replay
of q, k and v all split by columns met the score matmul of a half-head K); a plan with K/V split
could not exist at all (one head does not divide over two ranks).

tests/test_zoo.py holds the model's placements and tests/test_train_zoo.py trains it at mp2 on two
gloo ranks to the single-device losses and parameters; here: the roles, what Paddle's SPMD rules
make of the attention core under them, what the cost model charges, and mp4. Falcon fuses its
multi-query q | k | v in one projection: gathered in the global view, and, as a local view,
Megatron's ``q_r|k|v`` with the weight held whole (its training: tests/test_local_view.py).
"""

from __future__ import annotations

import paddle
import pytest

from autodist.planner.cost.graph_cost import model_cost
from autodist.planner.cost.search import SearchRequest
from autodist.planner.recognise.match import constant_nodes
from autodist.planner.ops import short_op
from autodist.planner.recognise.reshards import implicit_comm, weight_dists
from autodist.planner.recognise.spmd import Replay
from harness.planning import plan_target

TARGET = "tests/models/zoo/gemma_mqa_hf.py"
ATTENTION = "model.layers.0.self_attn"


def _planned(mp: int):
    request = SearchRequest(devices_per_node=mp, dp=1, mp=mp, pp=1, sequence_parallel=False)
    return plan_target(TARGET, None, request, {"target": TARGET})


def test_k_and_v_are_whole_q_by_columns_o_by_rows():
    made = _planned(2)
    attention = made.analysis.blocks[0].sublayers[0]
    assert (attention.kind, attention.num_heads, attention.num_kv_heads) == ("attention", 4, 1)
    assert {p.name: p.role for p in attention.projections} == {
        "q": "column",
        "k": "replicate",
        "v": "replicate",
        "o": "row",
    }
    assert [h for h in made.plan.hooks if h.action == "reshard"] == []  # no fused projection gathered


def test_the_attention_core_keeps_the_query_heads_split_against_whole_k_and_v():
    """Replayed through Paddle's SPMD rules with the plan's roles: the scores and the context
    (the two 4-D matmuls of activations) are split on the head dim, their K and V operands
    arrive whole (Paddle slices them locally: no collective), and nothing is communicated
    besides the row projection's all-reduce."""
    made = _planned(2)
    analysis, block = made.analysis, made.analysis.blocks[0]
    graph = analysis.graph
    mesh = paddle.distributed.ProcessMesh([0, 1], dim_names=["mp"])
    replay = Replay(graph, block.nodes, weight_dists(block, analysis.params), mesh, constant_nodes(graph))
    reshards = replay.run()
    core = [
        n
        for n in sorted(block.nodes)
        if short_op(graph.nodes[n]["op"]) == "matmul"
        and graph.nodes[n]["layer"] == ATTENTION
        and len(graph.nodes[n]["shapes"][0]) == 4
    ]
    assert len(core) == 2  # scores = q @ k^T, context = probs @ v
    for node in core:
        assert replay.values[node, 0].dims[1] == 0, graph.nodes[node]["shapes"][0]  # [b, heads, ...] by heads
        operands = dict(replay.operands(node))
        assert operands[0].dims[1] == 0 and operands[1].is_replicated  # split q (probs) against whole k (v)
    assert all(r.collective is None for r in reshards if r.node in core)
    assert implicit_comm(analysis, mp=2) == []


def test_the_cost_model_prices_k_and_v_whole_on_every_rank():
    made = _planned(2)
    block = model_cost(made.analysis).blocks[0]
    params = made.analysis.params
    kv = [f"{ATTENTION}.{name}.weight" for name in ("k_proj", "v_proj")]
    split = [f"{ATTENTION}.{name}.weight" for name in ("q_proj", "o_proj")]
    kv_elements = sum(params[w][0][0] * params[w][0][1] for w in kv)
    norms = 2 * 32  # input_layernorm, post_attention_layernorm
    assert block.params_whole == kv_elements + norms
    # the block's matmuls with a weight, in program order: q, k, v, o, gate, up, down
    assert [g.split for g in block.gemms] == ["column", "none", "none", "row", "column", "column", "row"]
    assert not block.kv_split  # no KV head is split, so none constrains mp
    assert all(w in made.analysis.params for w in split)


def test_more_ranks_than_kv_heads_split_the_query_heads():
    """mp4: each rank holds one query head and the whole K/V."""
    plan = _planned(4).plan
    axis = plan.mesh.axes.index("mp")
    placements = {fqn: p.placements[axis] for fqn, p in plan.params.items() if fqn.startswith(ATTENTION)}
    assert placements == {
        f"{ATTENTION}.q_proj.weight": "S(1)",
        f"{ATTENTION}.k_proj.weight": "R",
        f"{ATTENTION}.v_proj.weight": "R",
        f"{ATTENTION}.o_proj.weight": "S(0)",
    }


FALCON = "tests/models/zoo/falcon_hf.py"


def test_a_fused_multi_query_projection_is_gathered_and_its_kv_head_constrains_nothing():
    """Falcon-7B fuses q | k | v with one KV head in ``query_key_value``: split by columns and
    gathered right after it, like every fused projection, so the attention core gets K/V whole
    and only the fused weight's features must divide. Before: ``--mp 2 does not divide the 1 KV
    heads of transformer.h.0``."""
    request = SearchRequest(devices_per_node=2, mp=2, pp=1, sequence_parallel=False)
    made = plan_target(FALCON, None, request, {"target": FALCON})
    block = made.analysis.blocks[0]
    assert (block.num_heads, block.num_kv_heads) == (4, 1)
    assert not model_cost(made.analysis).blocks[0].kv_split
    attention = "transformer.h.0.self_attention"
    assert made.plan.params[f"{attention}.query_key_value.weight"].placements == ["S(1)"]
    assert [h.layer for h in made.plan.hooks if h.action == "reshard"] == [
        f"transformer.h.{i}.self_attention.query_key_value" for i in range(2)
    ]


FALCON_ATTENTION = "transformer.h.{}.self_attention"
#: Read from tests/models/zoo/falcon_hf.py: HIDDEN 32 over HEADS 4 of HEAD_DIM 8, one KV head;
#: query_key_value's [32, 32 + 2 * 8] weight holds q of the 4 heads, then k, then v.
FALCON_Q, FALCON_KV = 4 * 8, 8


def _weight_layout(view) -> dict:
    """``{weight name in the sub-layer: (dim, segments, sizes, replicated segments, summed)}``."""
    return {
        w.param.removeprefix(view.layer + "."): (w.dim, w.segments, w.sizes, w.replicated, w.summed)
        for w in view.weights
    }


def _falcon_local_plan():
    request = SearchRequest(devices_per_node=2, mp=2, pp=1, sequence_parallel=False)
    return plan_target(FALCON, None, request, {"target": FALCON}, local_view=True).plan


def test_a_fused_multi_query_attention_is_a_local_view_with_k_and_v_whole():
    """Megatron's layout for Falcon's fused multi-query ``query_key_value``: each rank computes
    with its 2 query heads' columns and the one K and V head whole (``q_r|k|v``), so the weight
    is held replicated over mp; the heads' counts and widths the forward reads are halved, the
    fused projection's gather is gone, and the note says the estimate prices it so."""
    plan = _falcon_local_plan()
    views = {view.layer: view for view in plan.local_view}
    assert sorted(views) == [FALCON_ATTENTION.format(i) for i in (0, 1)]
    view = views[FALCON_ATTENTION.format(0)]
    weights = _weight_layout(view)
    assert weights == {
        "query_key_value.weight": (1, 3, [FALCON_Q, FALCON_KV, FALCON_KV], [1, 2], False),
        "dense.weight": (0, 1, [], [], False),
    }
    # its forward reads only num_heads (hidden_size and split_size, 32, only its __init__)
    assert {(a.name, a.whole, a.local) for a in view.attributes} == {("num_heads", 4, 2)}
    assert "equal the global run" in view.verified
    axis = plan.mesh.axes.index("mp")
    assert plan.params[f"{view.layer}.query_key_value.weight"].placements[axis] == "R"
    assert plan.params[f"{view.layer}.dense.weight"].placements[axis] == "S(0)"
    assert [h for h in plan.hooks if h.action == "reshard"] == []
    held = [note for note in plan.notes if "held whole on every mp rank" in note]
    assert len(held) == 1 and "priced so" in held[0] and "not priced" not in held[0], plan.notes


def test_a_multi_query_weight_held_whole_is_priced_whole():
    """Falcon's local-view plan at mp2 (dp1, one micro-batch, bf16, Adam) priced as it runs
    against the same plan priced with its fused weights split (``multi_query_params`` emptied,
    the price before). Worked out by hand from tests/models/zoo/falcon_hf.py: each of the 2
    layers' ``query_key_value`` weights is [HIDDEN 32, 32 + 2 x HEAD_DIM 8] = 32 x 48 = 1536
    elements, no bias; 3072 in all. Held whole, a rank holds 3072 of them where split it held
    1536: 1536 elements more, 1536 x 2 bytes = 3072 more of parameters, as many of gradients,
    1536 x 12 (fp32 master copy, momentum, variance) = 18432 more of optimizer states. Their
    gradient, each rank's share, is all-reduced over mp in each micro-batch's backward: 3072 x 2 =
    6144 bytes, each of the 2 ranks sending 2 x (2 - 1) / 2 of them, 6144 more mp bytes, twice as
    many with 2 micro-batches. No dp: nothing more there."""
    from dataclasses import replace

    from autodist.planner.cost.search import kernels_for, price, search

    request = SearchRequest(
        devices_per_node=2, mp=2, pp=1, sequence_parallel=False, sharding_stage=0, micro_batches=1, dtype="bf16"
    )
    made = plan_target(FALCON, None, request, {"target": FALCON}, local_view=True)
    assert len(made.plan.local_view) == 2
    priced = price(made.analysis, kernels_for(made.analysis, request), local_view=True)

    def split(runs):
        cost = priced.cost_of(runs)
        return replace(cost, blocks=tuple(replace(b, multi_query_params=()) for b in cost.blocks))

    whole, as_split = (search(p, request).best for p in (priced, replace(priced, cost_as=split)))
    assert whole.strategy == as_split.strategy == made.plan.strategy
    assert whole.estimate == made.plan.estimate  # the plan's estimate is this price
    got, before = whole.estimate, as_split.estimate
    assert got.memory.params - before.memory.params == 1536 * 2
    assert got.memory.grads - before.memory.grads == 1536 * 2
    assert got.memory.optimizer - before.memory.optimizer == 1536 * 12
    assert got.comm_bytes.mp - before.comm_bytes.mp == 3072 * 2
    assert got.comm_bytes.dp == before.comm_bytes.dp == 0
    assert got.step_time_s > before.step_time_s
    accumulating = replace(request, micro_batches=2)
    got, before = (search(p, accumulating).best.estimate for p in (priced, replace(priced, cost_as=split)))
    assert got.comm_bytes.mp - before.comm_bytes.mp == 2 * 3072 * 2


def test_the_multi_query_proof_fails_for_another_layout():
    """The proof decides: Falcon's attention with three equal segments (GPT-2's ``q_r|k_r|v_r``)
    cannot run (each rank's 24 columns are no whole heads); with 32 columns a rank but the wrong
    ones (the first and last 8 whole, half of the 32 between), it runs and computes something else."""
    import msgspec

    from autodist.planner.driver import load
    from autodist.planner.local_view_proof import NotProven, verify

    plan = _falcon_local_plan()
    view = plan.local_view[0]
    layer = dict(load(FALCON).model.named_sublayers())[view.layer]
    params = {fqn: (p.shape, p.dtype) for fqn, p in plan.params.items()}
    qkv = view.weights[0]

    def with_qkv(**fields):
        return msgspec.structs.replace(view, weights=[msgspec.structs.replace(qkv, **fields), *view.weights[1:]])

    with pytest.raises(NotProven, match="running it failed: ValueError"):
        verify(layer, with_qkv(sizes=[], replicated=[]), params, 2, [2, 8, 32])
    with pytest.raises(NotProven, match="output differs from the global run's"):
        verify(layer, with_qkv(sizes=[FALCON_KV, FALCON_Q, FALCON_KV], replicated=[0, 2]), params, 2, [2, 8, 32])
    assert "equal the global run" in verify(layer, view, params, 2, [2, 8, 32])


BIGCODE = "tests/models/zoo/gpt_bigcode_hf.py"
BIGCODE_ATTENTION = "transformer.h.{}.attn"
#: Read from tests/models/zoo/gpt_bigcode_hf.py: N_EMBD 32 over N_HEAD 4 of head_dim 8, one KV
#: head (multi_query); c_attn's [32, 32 + 2 * 8] weight (and its bias) holds q of the 4 heads, then
#: k, then v, cut by ``split([embed_dim, 2 * kv_dim])`` and ``split([head_dim, head_dim])``.
BIGCODE_Q, BIGCODE_KV = 4 * 8, 8


def test_gpt_bigcode_s_fused_multi_query_attention_is_a_local_view_with_k_and_v_whole():
    """HF GPT-BigCode scores by ``baddbmm`` with the heads folded beside the query
    (``[batch, q_len * heads, head_dim]`` against the one key) and mixes by ``bmm``: an attention
    of 4 query heads and 1 KV head, its ``c_attn`` a 3-segment fused column, and as a local view
    Megatron's ``q_r|k|v`` as for Falcon: each rank its 2 query heads' columns (and bias) with
    the one K and V head whole, the weight held whole over mp, ``c_proj`` split by rows, no
    gather. Before, the attention was an MLP (``fc_in`` fused in two, no heads) and its local view
    failed to run (``Sum of Attr(num_or_sections) must be equal to the input's``): the plan
    gathered ``c_attn``."""
    request = SearchRequest(devices_per_node=2, mp=2, pp=1, sequence_parallel=False)
    made = plan_target(BIGCODE, None, request, {"target": BIGCODE}, local_view=True)
    block = made.analysis.blocks[0]
    assert (block.num_heads, block.num_kv_heads) == (4, 1)
    assert not model_cost(made.analysis).blocks[0].kv_split
    plan = made.plan
    views = {view.layer: view for view in plan.local_view}
    assert sorted(views) == [BIGCODE_ATTENTION.format(i) for i in (0, 1)]
    view = views[BIGCODE_ATTENTION.format(0)]
    weights = _weight_layout(view)
    segments = [BIGCODE_Q, BIGCODE_KV, BIGCODE_KV]
    assert weights == {
        "c_attn.weight": (1, 3, segments, [1, 2], False),
        "c_attn.bias": (0, 3, segments, [1, 2], False),
        "c_proj.weight": (0, 1, [], [], False),
        "c_proj.bias": (None, 1, [], [], True),
    }
    assert {(a.name, a.whole, a.local) for a in view.attributes} == {("num_heads", 4, 2), ("embed_dim", 32, 16)}
    assert "equal the global run" in view.verified
    axis = plan.mesh.axes.index("mp")
    placements = {n: plan.params[f"{view.layer}.{n}"].placements[axis] for n in weights}
    assert placements == {"c_attn.weight": "R", "c_attn.bias": "R", "c_proj.weight": "S(0)", "c_proj.bias": "R"}
    assert [h for h in plan.hooks if h.action == "reshard"] == []
    held = [note for note in plan.notes if "held whole on every mp rank" in note]
    assert len(held) == 1 and "priced so" in held[0], plan.notes
