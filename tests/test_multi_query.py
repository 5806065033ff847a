"""Multi-query attention (issue #22, item 3): with fewer KV heads than ranks, K/V stay whole.

HF Gemma's 2B shape has one KV head shared by all query heads (tests/models/zoo/gemma_mqa_hf.py).
Megatron and HF split such an attention by replicating K/V and splitting Q by heads and the
output projection by rows. Before, the planner left the whole attention replicated (the replay
of q, k and v all split by columns met the score matmul of a half-head K); a plan with K/V split
could not exist at all (one head does not divide over two ranks).

tests/test_zoo.py holds the model's placements and tests/test_train_zoo.py trains it at mp2 on two
gloo ranks to the single-device losses and parameters; here: the roles, what Paddle's SPMD rules
make of the attention core under them, what the cost model charges, and mp4.
"""

from __future__ import annotations

import paddle

from autodist.planner.cost.graph_cost import model_cost
from autodist.planner.cost.search import SearchRequest
from autodist.planner.recognise.match import constant_nodes, short_op
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
