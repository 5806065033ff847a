"""A plan is trained, so the planner judges the code training runs, not only what its eval-mode
trace holds (issue #30).

The planner traces in eval mode (dropout is the identity there). Where the model's own code reads
a layer's ``training`` flag, it traces the forward again in train mode and checks that program
too for ops Paddle 3.3 cannot run on the distributed tensors apply_plan trains with
(planner/recognise/crashes.py). PaddleFormers' GPT-OSS is such a model: its experts run ``bmm``
over every expert in evaluation and, ``if self.training:``, a loop over the experts that got tokens
reading ``self.gate_up_proj[expert_idx]``, an ``x[t]`` with ``t`` a tensor that raised ``Tensor in
indexing only support DenseTensor`` at the first training step of the plan written from the
eval-mode trace alone. Seen in the train-mode trace, that op makes its experts layer an MoE layer's
batched experts, run on plain tensors (tests/test_local_only_ops.py, tests/test_train_zoo.py); the
small model below routes in its block's own forward (no MoE layer inside the block), so it stays
refused.
"""

from __future__ import annotations

import paddle
import paddle.nn as nn
import paddle.nn.functional as F
import pytest

from autodist.planner.driver import plan
from autodist.planner.errors import PlannerError
from autodist.planner.trace import trace_model

VOCAB, HIDDEN, FFN, EXPERTS, TOP_K = 50, 16, 12, 5, 2


class BatchedExperts(nn.Layer):
    """Experts held as ``[experts, in, out]`` weights, written as the community writes them for
    training and for inference: in training a loop over the experts that got tokens (less memory),
    in evaluation every expert on every token by ``bmm``, weighted by the router's scores."""

    def __init__(self):
        super().__init__()
        self.up = self.create_parameter([EXPERTS, HIDDEN, FFN])
        self.down = self.create_parameter([EXPERTS, FFN, HIDDEN])

    def forward(self, hidden_states, scores):  # [tokens, hidden], [tokens, experts]
        if self.training:
            out = paddle.zeros_like(hidden_states)
            expert_hit = paddle.nonzero(scores.sum(axis=0) > 0)
            for expert_idx in expert_hit:
                expert_idx = expert_idx[0]
                token_idx = paddle.nonzero(scores[:, expert_idx] > 0)[:, 0]
                h = F.silu(hidden_states[token_idx] @ self.up[expert_idx]) @ self.down[expert_idx]
                out = paddle.index_add(out, token_idx, 0, h * scores[token_idx, expert_idx, None])
            return out
        tiled = paddle.tile(hidden_states[None], [EXPERTS, 1, 1])
        h = paddle.bmm(F.silu(paddle.bmm(tiled, self.up)), self.down)
        return (h * scores.T[..., None]).sum(axis=0)


class MoEBlock(nn.Layer):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.router = nn.Linear(HIDDEN, EXPERTS)
        self.experts = BatchedExperts()

    def forward(self, x):
        h = self.norm(x).reshape([-1, HIDDEN])
        top, chosen = paddle.topk(self.router(h), TOP_K)
        scores = paddle.put_along_axis(paddle.zeros([h.shape[0], EXPERTS]), chosen, F.softmax(top), 1)
        return x + self.experts(h, scores).reshape(x.shape)


class TinyMoE(nn.Layer):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.LayerList([MoEBlock() for _ in range(2)])
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


SPEC = ["tokens:int64:4x7"]


def test_a_branch_only_training_runs_is_refused_in_one_line_naming_it():
    """Planned from the eval-mode trace alone, this model got a dp2 plan (its ``bmm`` runs on
    distributed tensors); trained, that plan's first step raises in Paddle (``self.up[expert_idx]``
    of DistTensors: ``Tensor in indexing only support DenseTensor``, even on a one-rank mesh).
    Now one line, before any placement: the op, its layer, that only training runs it, the rewrite."""
    with pytest.raises(PlannerError) as refused:
        plan(TinyMoE(), SPEC, devices=2, device="cpu")
    message = str(refused.value)
    assert message.startswith(
        "x[i] (a slice at a position computed from the model's data) in layers.0.experts, "
        "in code only training runs (self.training): Paddle 3.3 does not run it"
    ), message
    assert "numbered layers" in message and "\n" not in message


def test_only_the_models_own_reads_of_the_training_flag_trace_it_again():
    """The layers whose flag the model's code read are named; a model whose only reads are Paddle's
    own layers' (``nn.Dropout``) is traced once, in eval mode, as before."""
    model = TinyMoE()
    traced = trace_model(model, [paddle.static.InputSpec([4, 7], "int64", "tokens")])
    assert traced.training_readers == ["layers.0.experts", "layers.1.experts"]
    assert traced.training is not None and traced.training_untraced == ""
    assert model.training and "training" not in vars(nn.Layer)  # the flag and the class as they were

    with_dropout = nn.Sequential(nn.Embedding(VOCAB, HIDDEN), nn.Dropout(0.1), nn.Linear(HIDDEN, VOCAB))
    traced = trace_model(with_dropout, [paddle.static.InputSpec([4, 7], "int64", "tokens")])
    assert (traced.training_readers, traced.training) == ([], None)


class TrainsElsewhere(TinyMoE):
    """:class:`TinyMoE` with a training branch the planner cannot trace: it raises there."""

    def forward(self, tokens):
        if self.training:
            raise NotImplementedError("train this model with its own loop")
        return super().forward(tokens)


def test_a_training_branch_that_does_not_trace_is_said_in_the_plan():
    """Planned from the eval-mode trace, with a note that training's code was not checked."""
    planned = plan(TrainsElsewhere(), SPEC, devices=2, device="cpu")
    [note] = [n for n in planned.notes if n.startswith("code only training runs")]
    readers = "the model, layers.0.experts, layers.1.experts"
    assert note.startswith(f"code only training runs ({readers} read self.training) was not checked: ")
    assert "NotImplementedError" in note
