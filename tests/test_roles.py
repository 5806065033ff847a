"""Dataflow roles on hand-built graphs: the fused attention kernels a GPU trace of
``F.scaled_dot_product_attention`` or PaddleFormers attention contains (no GPU needed)."""

from __future__ import annotations

import networkx as nx
import pytest

from autodist.planner.recognise.roles import BlockRecogniser

HIDDEN, HEADS, HEAD_DIM, BATCH, SEQ = 32, 4, 8, 2, 8


class GraphBuilder:
    """Nodes and edges with the attributes :func:`autodist.planner.graph.build_graph` gives."""

    def __init__(self):
        self.graph = nx.DiGraph()

    def op(self, op_name: str, layer: str, shapes, inputs=(), param=None, **attrs) -> int:
        node = len(self.graph)
        self.graph.add_node(
            node,
            op=op_name,
            layer=layer,
            shapes=[list(s) if s else None for s in shapes],
            dtypes=["float32"] * len(shapes),
            attrs=attrs,
            param=param,
            consts={},
        )
        for operand, source in enumerate(inputs):
            if source is not None:
                self.graph.add_edge(source, node, operand=operand, result=0)
        return node

    def linear(self, layer: str, x: int, shape) -> int:
        weight = self.op("builtin.parameter", layer, [[HIDDEN, HIDDEN]], param=f"{layer}.weight")
        return self.op("pd_op.matmul", layer, [shape], [x, weight], transpose_x=False, transpose_y=False)


def attention_block(kernel: str) -> tuple[nx.DiGraph, dict]:
    b = GraphBuilder()
    x = b.op("pd_op.data", "", [[BATCH, SEQ, HIDDEN]], name="x")
    heads = [BATCH, SEQ, HEADS, HEAD_DIM]
    q, k, v = (
        b.op("pd_op.reshape", "layers.0.attn", [heads], [b.linear(f"layers.0.attn.{n}", x, [BATCH, SEQ, HIDDEN])])
        for n in ("q", "k", "v")
    )
    out = b.op(f"pd_op.{kernel}", "layers.0.attn", [heads, [BATCH, HEADS, SEQ]], [q, k, v], causal=True)
    merged = b.op("pd_op.reshape", "layers.0.attn", [[BATCH, SEQ, HIDDEN]], [out])
    o = b.linear("layers.0.attn.o", merged, [BATCH, SEQ, HIDDEN])
    b.op("pd_op.add", "layers.0", [[BATCH, SEQ, HIDDEN]], [x, o])
    params = {f"layers.0.attn.{n}.weight": ([HIDDEN, HIDDEN], "float32") for n in "qkvo"}
    return b.graph, params


@pytest.mark.parametrize("kernel", ["flash_attn", "memory_efficient_attention", "fused_dot_product_attention"])
def test_a_fused_attention_kernel_is_an_attention_split_by_heads(kernel):
    graph, params = attention_block(kernel)
    (block,) = BlockRecogniser().recognise(graph, ["layers.0"], params)
    (attention,) = block.roles.sublayers
    assert attention.kind == "attention"
    assert [(p.name, p.role, p.split_dim) for p in attention.projections] == [
        ("q", "column", 1),
        ("k", "column", 1),
        ("v", "column", 1),
        ("o", "row", 0),
    ]
    assert (attention.num_heads, attention.num_kv_heads, attention.head_dim) == (HEADS, HEADS, HEAD_DIM)


def test_an_unknown_kernel_between_projections_is_refused_with_its_name():
    graph, params = attention_block("some_custom_attention")
    (block,) = BlockRecogniser().recognise(graph, ["layers.0"], params)
    assert block.roles.sublayers == []
    assert [(r.row, r.op) for r in block.roles.refusals] == [("layers.0.attn.o", "some_custom_attention")]


ZOO = "tests/models/zoo"
#: Attentions scored and mixed by batched products, read from the zoo files: target -> (the
#: attention, heads, KV heads, head dim, its projections as (layer, name, role, weight dim split)).
#: HF OPT: q_proj, k_proj, v_proj and out_proj over 4 heads of 8, ``bmm`` over merged
#: ``[bsz * heads, tgt, head_dim]`` for the scores and the context. fairscale's (GShard's)
#: MultiheadAttention: the same over sequence-first ``[T, B * heads, d]``. HF GPT-BigCode:
#: ``c_attn`` is q of 4 heads of 8, then one K and one V head (multi-query), the scores a
#: ``baddbmm(empty, q, k)`` of the query reshaped to ``[batch, q_len * heads, head_dim]`` against
#: the one key, the context a ``bmm``. HF GPT-NeoX: q, k, v of 4 heads interleaved head by head in
#: ``query_key_value``, scores by ``baddbmm`` over ``[batch * heads, q, head_size]``, context by
#: ``matmul``. Paddle ``Linear`` weights are ``[in, out]``: columns split dim 1, rows dim 0.
BATCHED_PRODUCTS = {
    f"{ZOO}/opt_hf.py": (
        "model.decoder.layers.0.self_attn",
        (4, 4, 8),
        [("q_proj", "q", "column", 1), ("k_proj", "k", "column", 1), ("v_proj", "v", "column", 1)]
        + [("out_proj", "o", "row", 0)],
    ),
    f"{ZOO}/gshard_fairscale.py": (
        "decoder.layers.0.self_attn",
        (4, 4, 8),
        [("q_proj", "q", "column", 1), ("k_proj", "k", "column", 1), ("v_proj", "v", "column", 1)]
        + [("out_proj", "o", "row", 0)],
    ),
    f"{ZOO}/gpt_bigcode_hf.py": (
        "transformer.h.0.attn",
        (4, 1, 8),
        [("c_attn", "qkv", "column", 1), ("c_proj", "o", "row", 0)],
    ),
    f"{ZOO}/gpt_neox_hf.py": (
        "gpt_neox.layers.0.attention",
        (4, 4, 8),
        [("query_key_value", "qkv", "column", 1), ("dense", "o", "row", 0)],
    ),
}


@pytest.mark.parametrize("target", list(BATCHED_PRODUCTS))
def test_an_attention_scored_by_batched_products_is_an_attention_with_its_heads(target):
    """``bmm`` and ``baddbmm`` (whose first operand is the tensor it adds) are products of two
    activations like ``matmul``, and the heads are the scores' elements over (query tokens x keys)
    whether the scores are ``[batch * heads, q, k]`` or ``[batch, q * heads, k]``. Before, OPT's,
    GShard's and GPT-BigCode's attentions were MLPs with no heads (``in0``, ``in1``, ``in2`` /
    ``fc_in``), and GPT-NeoX's fused column was ``qk`` (the ``matmul`` of the context taken for
    the scores)."""
    from autodist.planner.cost.search import SearchRequest
    from harness.planning import plan_target

    layer, sizes, projections = BATCHED_PRODUCTS[target]
    request = SearchRequest(devices_per_node=4, dp=2, mp=2, pp=1)  # GShard plans only with dp (einsum)
    attention = plan_target(target, None, request, {"target": target}).analysis.blocks[0].sublayers[0]
    assert attention.kind == "attention"
    assert (attention.num_heads, attention.num_kv_heads, attention.head_dim) == sizes
    assert [(p.layer, p.name, p.role, p.split_dim) for p in attention.projections] == [
        (f"{layer}.{name}", *rest) for name, *rest in projections
    ]
    fused = [p.fused for p in attention.columns if p.name == "qkv"]
    assert fused in ([], [3])
