"""Llama as Meta's original ``model.py`` writes it (``wq``/``wk``/``wv``/``wo``, ``w1``/``w2``/
``w3``, ``tok_embeddings``, ``output``), with precomputed real rotary tables applied to
interleaved pairs, ``repeat_kv`` by expand + reshape, and the causal mask applied with
``paddle.where``.

    >>> model = build_model()
    >>> model(paddle.randint(0, VOCAB, [2, 8])).shape
    [2, 8, 64]
"""

import math

import paddle
import paddle.nn as nn
import paddle.nn.functional as F

VOCAB, DIM, N_LAYERS, N_HEADS, N_KV_HEADS, HIDDEN, MAX_SEQ = 64, 32, 2, 4, 2, 64, 16


class RMSNorm(nn.Layer):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = self.create_parameter([dim], default_initializer=nn.initializer.Constant(1.0))

    def _norm(self, x):
        return x * paddle.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        return self._norm(x.astype("float32")).astype(x.dtype) * self.weight


def precompute_freqs(dim, end, theta=10000.0):
    freqs = 1.0 / (theta ** (paddle.arange(0, dim, 2)[: (dim // 2)].astype("float32") / dim))
    freqs = paddle.outer(paddle.arange(end).astype("float32"), freqs)
    return paddle.cos(freqs), paddle.sin(freqs)


def apply_rotary_emb(xq, xk, freqs_cos, freqs_sin):
    def rotate(x):
        x_r, x_i = x.reshape(x.shape[:-1] + [-1, 2]).unbind(-1)
        cos = freqs_cos.reshape([1, x.shape[1], 1, -1])
        sin = freqs_sin.reshape([1, x.shape[1], 1, -1])
        out_r = x_r * cos - x_i * sin
        out_i = x_r * sin + x_i * cos
        return paddle.stack([out_r, out_i], axis=-1).flatten(3)

    return rotate(xq), rotate(xk)


def repeat_kv(x, n_rep):
    bs, slen, n_kv_heads, head_dim = x.shape
    if n_rep == 1:
        return x
    return (
        x[:, :, :, None, :]
        .expand([bs, slen, n_kv_heads, n_rep, head_dim])
        .reshape([bs, slen, n_kv_heads * n_rep, head_dim])
    )


class Attention(nn.Layer):
    def __init__(self):
        super().__init__()
        self.n_kv_heads, self.n_heads = N_KV_HEADS, N_HEADS
        self.n_rep = N_HEADS // N_KV_HEADS
        self.head_dim = DIM // N_HEADS
        self.wq = nn.Linear(DIM, N_HEADS * self.head_dim, bias_attr=False)
        self.wk = nn.Linear(DIM, N_KV_HEADS * self.head_dim, bias_attr=False)
        self.wv = nn.Linear(DIM, N_KV_HEADS * self.head_dim, bias_attr=False)
        self.wo = nn.Linear(N_HEADS * self.head_dim, DIM, bias_attr=False)

    def forward(self, x, freqs_cos, freqs_sin, mask):
        bsz, seqlen, _ = x.shape
        xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)
        xq = xq.reshape([bsz, seqlen, self.n_heads, self.head_dim])
        xk = xk.reshape([bsz, seqlen, self.n_kv_heads, self.head_dim])
        xv = xv.reshape([bsz, seqlen, self.n_kv_heads, self.head_dim])
        xq, xk = apply_rotary_emb(xq, xk, freqs_cos, freqs_sin)
        keys, values = repeat_kv(xk, self.n_rep), repeat_kv(xv, self.n_rep)
        xq, keys, values = xq.transpose([0, 2, 1, 3]), keys.transpose([0, 2, 1, 3]), values.transpose([0, 2, 1, 3])
        scores = paddle.matmul(xq, keys.transpose([0, 1, 3, 2])) / math.sqrt(self.head_dim)
        scores = paddle.where(mask, scores, paddle.full_like(scores, float("-inf")))
        scores = F.softmax(scores.astype("float32"), axis=-1).astype(xq.dtype)
        output = paddle.matmul(scores, values).transpose([0, 2, 1, 3]).reshape([bsz, seqlen, -1])
        return self.wo(output)


class FeedForward(nn.Layer):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(DIM, HIDDEN, bias_attr=False)
        self.w2 = nn.Linear(HIDDEN, DIM, bias_attr=False)
        self.w3 = nn.Linear(DIM, HIDDEN, bias_attr=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Layer):
    def __init__(self, layer_id):
        super().__init__()
        self.layer_id = layer_id
        self.attention = Attention()
        self.feed_forward = FeedForward()
        self.attention_norm = RMSNorm(DIM)
        self.ffn_norm = RMSNorm(DIM)

    def forward(self, x, freqs_cos, freqs_sin, mask):
        h = x + self.attention(self.attention_norm(x), freqs_cos, freqs_sin, mask)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Layer):
    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.LayerList([TransformerBlock(i) for i in range(N_LAYERS)])
        self.norm = RMSNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias_attr=False)
        cos, sin = precompute_freqs(DIM // N_HEADS, MAX_SEQ * 2)
        self.register_buffer("freqs_cos", cos, persistable=False)
        self.register_buffer("freqs_sin", sin, persistable=False)

    def forward(self, tokens):
        _bsz, seqlen = tokens.shape
        h = self.tok_embeddings(tokens)
        freqs_cos, freqs_sin = self.freqs_cos[:seqlen], self.freqs_sin[:seqlen]
        mask = paddle.tril(paddle.ones([seqlen, seqlen], dtype="bool")).reshape([1, 1, seqlen, seqlen])
        for layer in self.layers:
            h = layer(h, freqs_cos, freqs_sin, mask)
        return self.output(self.norm(h)).astype("float32")


def build_model():
    return Transformer()


def input_spec():
    return [paddle.static.InputSpec([2, 8], "int64", "tokens")]


def loss(model, tokens, labels):
    return F.cross_entropy(model(tokens).reshape([-1, VOCAB]), labels.reshape([-1]))
