"""Attention masks as people spell them: the padding mask reaches the head-split scores through
``expand_as``, ``expand``, ``broadcast_to`` or ``where``'s own broadcasting, comes from the batch
or is built inside the model. Each only broadcasts a whole mask over the heads, which Paddle does
without communication (measured on 2 ranks, docs/paddle-notes.md, "Masks"), so the attention is
split by heads in every case. ``masked_fill`` has no SPMD rule in Paddle 3.3 and gathers its
input: that attention is refused, naming the op."""

from __future__ import annotations

import paddle
import paddle.nn.functional as F
import pytest

from autodist.planner.graph import build_graph
from autodist.planner.recognise.analysis import analyze
from autodist.planner.trace import trace_model

B, S, D, H = 2, 8, 32, 4


def broadcast(mask, scores, spelling):
    mask = (mask == 0).reshape([B, 1, 1, S])
    if spelling == "expand_as":
        return mask.expand_as(scores)
    if spelling == "expand":
        return mask.expand([B, H, S, S])
    if spelling == "broadcast_to":
        return paddle.broadcast_to(mask, scores.shape)
    return mask  # broadcast by where itself


class Attention(paddle.nn.Layer):
    def __init__(self, spelling):
        super().__init__()
        self.spelling = spelling
        self.q, self.k, self.v, self.o = (paddle.nn.Linear(D, D) for _ in range(4))

    def forward(self, x, mask):
        def heads(t):
            return t.reshape([B, S, H, D // H]).transpose([0, 2, 1, 3])

        q, k, v = heads(self.q(x)), heads(self.k(x)), heads(self.v(x))
        scores = paddle.matmul(q, k, transpose_y=True) / (D // H) ** 0.5
        masked = broadcast(mask, scores, self.spelling.split("+")[0])
        fill = paddle.full_like(scores, -1e9)
        if self.spelling.endswith("+masked_fill"):
            scores = paddle.masked_fill(scores, masked, -1e9)
        else:
            scores = paddle.where(masked, fill, scores)
        context = paddle.matmul(F.softmax(scores, axis=-1), v)
        return self.o(context.transpose([0, 2, 1, 3]).reshape([B, S, D]))


class Encoder(paddle.nn.Layer):
    def __init__(self, spelling, mask_from_batch):
        super().__init__()
        self.mask_from_batch = mask_from_batch
        self.layers = paddle.nn.LayerList([Attention(spelling) for _ in range(2)])

    def forward(self, x, mask):
        mask = mask if self.mask_from_batch else paddle.ones([B, S], "int64")
        for layer in self.layers:
            x = x + layer(x, mask)
        return x


def analysis_of(spelling, mask_from_batch):
    model = Encoder(spelling, mask_from_batch)
    spec = [paddle.static.InputSpec([B, S, D], "float32", "x"), paddle.static.InputSpec([B, S], "int64", "mask")]
    program = trace_model(model, spec)
    return analyze(program, build_graph(program), model)


@pytest.mark.parametrize("mask_from_batch", [True, False], ids=["batch-mask", "built-mask"])
@pytest.mark.parametrize("spelling", ["expand_as", "expand", "broadcast_to", "implicit"])
def test_a_broadcast_mask_keeps_the_attention_split(spelling, mask_from_batch):
    a = analysis_of(spelling, mask_from_batch)
    assert [b.description for b in a.blocks] == ["attention(q|k|v)"] * 2, a.notes
    assert {(lin.name, lin.role, lin.split_dim) for lin in a.blocks[1].linears} == {
        ("q", "column", 1),
        ("k", "column", 1),
        ("v", "column", 1),
        ("o", "row", 0),
    }


def test_masked_fill_gathers_in_paddle_and_its_attention_is_refused():
    a = analysis_of("expand_as+masked_fill", True)
    assert a.blocks == []
    assert [n for n in a.notes if "stops" in n] == [
        "layers.*.o: op masked_fill (first seen in layers.0) stops the tensor-parallel split before this "
        "projection; it and the projections feeding it stay replicated"
    ]
