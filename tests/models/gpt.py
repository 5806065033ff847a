"""A GPT-2-style language model written for the tests.

Each block: LayerNorm -> one fused qkv Linear (with bias) -> explicit softmax attention ->
output projection (with bias) -> residual -> LayerNorm -> GELU MLP (fc_in, fc_out with bias) ->
residual. Token + position embedding in front, final LayerNorm and LM head after.

Usable as a planner target: ``autodist-plan tests/models/gpt.py``.

Example::

    >>> model = build_model(GPTConfig(num_layers=2))
    >>> logits = model(paddle.randint(0, 64, [2, 8]))
    >>> logits.shape
    [2, 8, 64]
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import paddle
import paddle.nn as nn
import paddle.nn.functional as F


@dataclass
class GPTConfig:
    vocab_size: int = 64
    hidden_size: int = 32
    num_heads: int = 4
    num_layers: int = 2
    max_positions: int = 32
    mlp_ratio: int = 4
    batch_size: int = 2
    seq_len: int = 8
    #: attention through ``F.scaled_dot_product_attention`` instead of the explicit softmax
    sdpa: bool = False


class GPTAttention(nn.Layer):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.num_heads = cfg.num_heads
        self.head_dim = cfg.hidden_size // cfg.num_heads
        self.sdpa = cfg.sdpa
        self.qkv_proj = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.out_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, x):
        b, s, h = x.shape
        qkv = self.qkv_proj(x).reshape([b, s, 3, self.num_heads, self.head_dim])
        q, k, v = qkv.unbind(axis=2)
        if self.sdpa:  # [b, s, heads, head_dim] in and out
            return self.out_proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).reshape([b, s, h]))
        q, k, v = (t.transpose([0, 2, 1, 3]) for t in (q, k, v))
        scores = paddle.matmul(q, k, transpose_y=True) / math.sqrt(self.head_dim)
        # An additive causal mask: built from constants only, so it folds away in the graph.
        scores = scores + paddle.triu(paddle.full([s, s], -1e4, dtype=scores.dtype), diagonal=1)
        probs = F.softmax(scores, axis=-1)
        out = paddle.matmul(probs, v).transpose([0, 2, 1, 3]).reshape([b, s, h])
        return self.out_proj(out)


class GPTMLP(nn.Layer):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc_in = nn.Linear(cfg.hidden_size, cfg.mlp_ratio * cfg.hidden_size)
        self.fc_out = nn.Linear(cfg.mlp_ratio * cfg.hidden_size, cfg.hidden_size)

    def forward(self, x):
        return self.fc_out(F.gelu(self.fc_in(x)))


class GPTBlock(nn.Layer):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.hidden_size)
        self.attn = GPTAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.hidden_size)
        self.mlp = GPTMLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPTModel(nn.Layer):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.wpe = nn.Embedding(cfg.max_positions, cfg.hidden_size)
        self.blocks = nn.LayerList([GPTBlock(cfg) for _ in range(cfg.num_layers)])
        self.ln_f = nn.LayerNorm(cfg.hidden_size)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias_attr=False)

    def forward(self, input_ids):
        positions = paddle.arange(input_ids.shape[1], dtype="int64").unsqueeze(0)
        x = self.wte(input_ids) + self.wpe(positions)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def build_model(cfg: GPTConfig | None = None, **overrides) -> GPTModel:
    """A tiny GPT; ``overrides`` replace config fields (``build_model(num_layers=8)``)."""
    cfg = cfg or GPTConfig()
    if overrides:
        cfg = GPTConfig(**{**cfg.__dict__, **overrides})
    return GPTModel(cfg)


def input_spec(cfg: GPTConfig | None = None) -> list[paddle.static.InputSpec]:
    cfg = cfg or GPTConfig()
    return [paddle.static.InputSpec([cfg.batch_size, cfg.seq_len], "int64", "input_ids")]
