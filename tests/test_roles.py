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
