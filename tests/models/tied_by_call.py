"""A nanoGPT-style GPT whose embedding and LM head share one weight through a function call,
in the other two spellings people write (nanogpt.py has the third, ``paddle.matmul(x,
self.transformer["wte"].weight, transpose_y=True)``):

- ``build_linear_head()``: the head is ``F.linear(x, self.wte.weight.T)``, torch's
  ``F.linear(x, self.wte.weight)`` written for Paddle (whose ``F.linear`` takes ``[in, out]``);
- ``build_embedding_from_head()``: the head is an ``nn.Linear(n_embd, vocab)`` and the token
  embedding reads its weight, ``F.embedding(idx, self.lm_head.weight.T)``.

There is one Parameter under one name in each: nothing but the trace (the parameter feeding ops
in two layers) says the weight is tied.

    >>> model = build_linear_head()
    >>> list(model(paddle.randint(0, VOCAB, [2, 8])).shape)
    [2, 8, 64]
    >>> list(build_embedding_from_head()(paddle.randint(0, VOCAB, [2, 8])).shape)
    [2, 8, 64]
"""

import paddle
import paddle.nn as nn
import paddle.nn.functional as F

VOCAB, BLOCK_SIZE, N_LAYER, N_HEAD, N_EMBD = 64, 16, 2, 4, 32


class CausalSelfAttention(nn.Layer):
    def __init__(self):
        super().__init__()
        self.c_attn = nn.Linear(N_EMBD, 3 * N_EMBD)
        self.c_proj = nn.Linear(N_EMBD, N_EMBD)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(3, axis=2)
        q, k, v = (y.reshape([b, t, N_HEAD, c // N_HEAD]) for y in (q, k, v))  # Paddle's sdpa: [b, t, h, d]
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.reshape([b, t, c]))


class Block(nn.Layer):
    def __init__(self):
        super().__init__()
        self.ln_1 = nn.LayerNorm(N_EMBD)
        self.attn = CausalSelfAttention()
        self.ln_2 = nn.LayerNorm(N_EMBD)
        self.mlp = nn.Sequential(nn.Linear(N_EMBD, 4 * N_EMBD), nn.GELU(), nn.Linear(4 * N_EMBD, N_EMBD))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class LinearHeadGPT(nn.Layer):
    """The head ``F.linear(x, self.wte.weight.T)``."""

    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, N_EMBD)
        self.wpe = nn.Embedding(BLOCK_SIZE, N_EMBD)
        self.h = nn.LayerList([Block() for _ in range(N_LAYER)])
        self.ln_f = nn.LayerNorm(N_EMBD)

    def forward(self, idx):
        pos = paddle.arange(0, idx.shape[1], dtype="int64")
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        return F.linear(self.ln_f(x), self.wte.weight.T)


class EmbeddingFromHeadGPT(nn.Layer):
    """The token embedding ``F.embedding(idx, self.lm_head.weight.T)``."""

    def __init__(self):
        super().__init__()
        self.wpe = nn.Embedding(BLOCK_SIZE, N_EMBD)
        self.h = nn.LayerList([Block() for _ in range(N_LAYER)])
        self.ln_f = nn.LayerNorm(N_EMBD)
        self.lm_head = nn.Linear(N_EMBD, VOCAB, bias_attr=False)

    def forward(self, idx):
        pos = paddle.arange(0, idx.shape[1], dtype="int64")
        x = F.embedding(idx, self.lm_head.weight.T) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def build_linear_head():
    return LinearHeadGPT()


def build_embedding_from_head():
    return EmbeddingFromHeadGPT()


build_model = build_linear_head


def input_spec():
    return [paddle.static.InputSpec([2, 8], "int64", "idx")]


def logits_loss(logits, labels):
    """Mean token cross-entropy of the logits (a pipeline's ``loss_fn``)."""
    return F.cross_entropy(logits.reshape([-1, VOCAB]), labels.reshape([-1]))


def loss(model, tokens, labels):
    return logits_loss(model(tokens), labels)
