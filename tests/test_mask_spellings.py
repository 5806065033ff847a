"""Attention masks as people spell them: the padding mask reaches the head-split scores through
``expand_as``, ``expand``, ``broadcast_to`` or ``where``'s own broadcasting, comes from the batch
or is built inside the model. Each only broadcasts a whole mask over the heads, which Paddle does
without communication (measured on 2 ranks, docs/paddle-notes.md, "Masks"), so the attention is
split by heads in every case. ``masked_fill`` has no SPMD rule in Paddle 3.3 and gathers its
input: that attention is split only as a local view the planner proves (each rank running the
forward on its heads); one it cannot prove stays replicated, the notes naming the op and why."""

from __future__ import annotations

import paddle
import paddle.nn.functional as F
import pytest

from autodist.planner.cost.search import SearchRequest
from autodist.planner.driver import plan_model
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
        self.num_heads, self.head_dim = H, D // H
        self.q, self.k, self.v, self.o = (paddle.nn.Linear(D, D) for _ in range(4))

    def heads(self, t):
        return t.reshape([B, S, self.num_heads, self.head_dim]).transpose([0, 2, 1, 3])

    def forward(self, x, mask):
        q, k, v = self.heads(self.q(x)), self.heads(self.k(x)), self.heads(self.v(x))
        scores = paddle.matmul(q, k, transpose_y=True) / (D // H) ** 0.5
        masked = broadcast(mask, scores, self.spelling.split("+")[0])
        fill = paddle.full_like(scores, -1e9)
        if self.spelling.endswith("+masked_fill"):
            scores = paddle.masked_fill(scores, masked, -1e9)
        else:
            scores = paddle.where(masked, fill, scores)
        context = paddle.matmul(F.softmax(scores, axis=-1), v)
        return self.o(context.transpose([0, 2, 1, 3]).reshape([B, S, -1]))


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


def test_masked_fill_gathers_in_paddle_and_its_attention_is_left_to_a_local_view():
    """Paddle's global view gathers the heads at masked_fill (no SPMD rule): the attention is
    named with Megatron's roles all the same, but kept apart (``stopped``), its projections
    replicated unless a plan proves it as a local view."""
    a = analysis_of("expand_as+masked_fill", True)
    assert [(b.linears, [(s.description, s.stopped_by) for s in b.stopped]) for b in a.blocks] == [
        ([], [("attention(q|k|v)", "masked_fill")])
    ] * 2
    assert [n for n in a.notes if "stops" in n] == [
        "layers.*.o: op masked_fill (first seen in layers.0) stops the tensor-parallel split before this "
        "projection; Paddle has no SPMD rule for masked_fill: the sub-layer runs as a local view where the "
        "planner proves one, else it and the projections feeding it stay replicated"
    ]


def planned(model: paddle.nn.Layer):
    spec = [paddle.static.InputSpec([B, S, D], "float32", "x"), paddle.static.InputSpec([B, S], "int64", "mask")]
    request = SearchRequest(devices_per_node=2, dp=1, mp=2, pp=1, sequence_parallel=False)
    plan = plan_model(model, spec, request, {"target": type(model).__name__}).plan
    axis = plan.mesh.axes.index("mp")
    return plan, {fqn: p.placements[axis] for fqn, p in plan.params.items() if fqn.startswith("layers.0.")}


def test_a_masked_fill_attention_is_split_as_a_proven_local_view():
    """Planned at mp2, the masked_fill attention runs as a local view (proven called with its
    int64 mask): q/k/v split by columns, o by rows, as Megatron splits an attention."""
    plan, placements = planned(Encoder("expand_as+masked_fill", True))
    assert [v.layer for v in plan.local_view] == ["layers.0", "layers.1"]
    assert "equal the global run" in plan.local_view[0].verified
    assert placements == {
        **{f"layers.0.{p}.weight": "S(1)" for p in "qkv"},
        **{f"layers.0.{p}.bias": "S(0)" for p in "qkv"},
        "layers.0.o.weight": "S(0)",
        "layers.0.o.bias": "R",
    }


class ModuleConstantHeads(Attention):
    """The head count read from the module's constant, as scripts often write it: no attribute
    of the layer says it, so a rank's local run cannot be told it holds half of the heads."""

    def heads(self, t):
        return t.reshape([B, S, H, D // H]).transpose([0, 2, 1, 3])


def test_an_attention_no_local_view_can_run_stays_replicated_with_the_reason():
    model = Encoder("expand_as+masked_fill", True)
    for i, layer in enumerate(model.layers):
        model.layers[i] = ModuleConstantHeads(layer.spelling)
    plan, placements = planned(model)
    assert plan.local_view == [] and set(placements.values()) == {"R"}
    why = [n for n in plan.notes if n.startswith("local view: layers.0")]
    assert len(why) == 1 and "stay global (replicated: Paddle has no SPMD rule for masked_fill): running it" in why[0]
    assert "[2, 8, 16]" in why[0]  # its local width, 16 of 32, reshaped into the 4 heads of the whole
    assert any("op masked_fill (first seen in layers.0) stops" in n for n in plan.notes)
