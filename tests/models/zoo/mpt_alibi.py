"""MPT as MosaicML's ``modeling_mpt.py`` writes it: a fused ``Wqkv`` split by ``chunk``, ``out_proj``,
a GELU MLP (``up_proj``/``down_proj``), bias-free LayerNorms, no position embedding but an ALiBi
bias built once by the model and added to every block's scores. The model's method
``build_alibi_bias`` calls the module function of the same name, as code grown by wrapping a
helper does (dy2static's converted method would call itself there).

    >>> model = build_model()
    >>> list(model(paddle.randint(0, VOCAB, [2, 9])).shape)
    [2, 9, 88]
"""

import math

import paddle
import paddle.nn as nn
import paddle.nn.functional as F

VOCAB, D_MODEL, N_HEADS, N_LAYERS, EXPANSION, ALIBI_BIAS_MAX = 88, 40, 4, 2, 3, 8


def gen_slopes(n_heads, alibi_bias_max=8):
    _n_heads = 2 ** math.ceil(math.log2(n_heads))
    m = paddle.arange(1, _n_heads + 1, dtype="float32") * (alibi_bias_max / _n_heads)
    slopes = 1.0 / paddle.pow(paddle.full([], 2.0), m)
    if _n_heads != n_heads:
        slopes = paddle.concat([slopes[1::2], slopes[::2]])[:n_heads]
    return slopes.reshape([1, n_heads, 1, 1])


def build_alibi_bias(n_heads, seq_len, alibi_bias_max=8):
    alibi_bias = paddle.arange(1 - seq_len, 1, dtype="float32").reshape([1, 1, 1, seq_len])
    return alibi_bias * gen_slopes(n_heads, alibi_bias_max)


class LPLayerNorm(nn.LayerNorm):
    def __init__(self, normalized_shape):
        super().__init__(normalized_shape, bias_attr=False)


class MultiheadAttention(nn.Layer):
    def __init__(self):
        super().__init__()
        self.d_model, self.n_heads = D_MODEL, N_HEADS
        self.softmax_scale = 1 / math.sqrt(self.d_model / self.n_heads)
        self.Wqkv = nn.Linear(self.d_model, 3 * self.d_model, bias_attr=False)
        self.out_proj = nn.Linear(self.d_model, self.d_model, bias_attr=False)

    def forward(self, x, attn_bias):
        b, s, _ = x.shape
        query, key, value = self.Wqkv(x).chunk(3, axis=2)
        q = query.reshape([b, s, self.n_heads, -1]).transpose([0, 2, 1, 3])
        k = key.reshape([b, s, self.n_heads, -1]).transpose([0, 2, 3, 1])
        v = value.reshape([b, s, self.n_heads, -1]).transpose([0, 2, 1, 3])
        attn_weight = paddle.matmul(q, k) * self.softmax_scale
        attn_weight = attn_weight + attn_bias
        causal_mask = paddle.tril(paddle.ones([s, s], dtype="bool"))
        attn_weight = paddle.where(causal_mask, attn_weight, paddle.full_like(attn_weight, -1e4))
        attn_weight = F.softmax(attn_weight, axis=-1)
        out = paddle.matmul(attn_weight, v).transpose([0, 2, 1, 3]).reshape([b, s, self.d_model])
        return self.out_proj(out)


class MPTMLP(nn.Layer):
    def __init__(self):
        super().__init__()
        self.up_proj = nn.Linear(D_MODEL, EXPANSION * D_MODEL, bias_attr=False)
        self.down_proj = nn.Linear(EXPANSION * D_MODEL, D_MODEL, bias_attr=False)

    def forward(self, x):
        return self.down_proj(F.gelu(self.up_proj(x), approximate=True))


class MPTBlock(nn.Layer):
    def __init__(self):
        super().__init__()
        self.norm_1 = LPLayerNorm(D_MODEL)
        self.attn = MultiheadAttention()
        self.norm_2 = LPLayerNorm(D_MODEL)
        self.ffn = MPTMLP()

    def forward(self, x, attn_bias):
        x = x + self.attn(self.norm_1(x), attn_bias)
        return x + self.ffn(self.norm_2(x))


class MPTModel(nn.Layer):
    def __init__(self):
        super().__init__()
        self.n_heads = N_HEADS
        self.wte = nn.Embedding(VOCAB, D_MODEL)
        self.blocks = nn.LayerList([MPTBlock() for _ in range(N_LAYERS)])
        self.norm_f = LPLayerNorm(D_MODEL)

    def build_alibi_bias(self, seq_len):
        return build_alibi_bias(self.n_heads, seq_len, alibi_bias_max=ALIBI_BIAS_MAX)

    def forward(self, input_ids):
        x = self.wte(input_ids)
        attn_bias = self.build_alibi_bias(input_ids.shape[1])
        for block in self.blocks:
            x = block(x, attn_bias)
        return self.norm_f(x)


class MPTForCausalLM(nn.Layer):
    def __init__(self):
        super().__init__()
        self.transformer = MPTModel()
        self.lm_head = nn.Linear(D_MODEL, VOCAB, bias_attr=False)

    def forward(self, input_ids):
        return self.lm_head(self.transformer(input_ids))


def build_model():
    return MPTForCausalLM()


def input_spec():
    return [paddle.static.InputSpec([2, 11], "int64", "input_ids")]


def loss(model, tokens, labels):
    return F.cross_entropy(model(tokens).reshape([-1, VOCAB]), labels.reshape([-1]))
