"""nanoGPT (Karpathy's ``model.py``) in Paddle: fused ``c_attn`` split with ``.split``, heads by
``view``/``transpose``, the slow attention path with ``masked_fill`` from a ``tril`` buffer,
``bias=False`` LayerNorms, GELU MLP, weight tying between ``wte`` and ``lm_head``.

    >>> model = build_model()
    >>> model(paddle.randint(0, VOCAB, [2, 8])).shape
    [2, 8, 64]
"""

import math

import paddle
import paddle.nn as nn
import paddle.nn.functional as F

VOCAB, BLOCK_SIZE, N_LAYER, N_HEAD, N_EMBD, DROPOUT = 64, 16, 2, 4, 32, 0.1


class LayerNorm(nn.Layer):
    """LayerNorm but with an optional bias (nanoGPT's own)."""

    def __init__(self, ndim, bias):
        super().__init__()
        self.weight = self.create_parameter([ndim], default_initializer=nn.initializer.Constant(1.0))
        self.bias = self.create_parameter([ndim], is_bias=True) if bias else None

    def forward(self, input):
        return F.layer_norm(input, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Layer):
    def __init__(self):
        super().__init__()
        self.c_attn = nn.Linear(N_EMBD, 3 * N_EMBD, bias_attr=False)
        self.c_proj = nn.Linear(N_EMBD, N_EMBD, bias_attr=False)
        self.attn_dropout = nn.Dropout(DROPOUT)
        self.resid_dropout = nn.Dropout(DROPOUT)
        self.n_head, self.n_embd = N_HEAD, N_EMBD
        self.register_buffer(
            "bias", paddle.tril(paddle.ones([BLOCK_SIZE, BLOCK_SIZE])).reshape([1, 1, BLOCK_SIZE, BLOCK_SIZE])
        )

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(3, axis=2)
        k = k.reshape([B, T, self.n_head, C // self.n_head]).transpose([0, 2, 1, 3])
        q = q.reshape([B, T, self.n_head, C // self.n_head]).transpose([0, 2, 1, 3])
        v = v.reshape([B, T, self.n_head, C // self.n_head]).transpose([0, 2, 1, 3])
        att = (q @ k.transpose([0, 1, 3, 2])) * (1.0 / math.sqrt(k.shape[-1]))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        att = self.attn_dropout(F.softmax(att, axis=-1))
        y = (att @ v).transpose([0, 2, 1, 3]).reshape([B, T, C])
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Layer):
    def __init__(self):
        super().__init__()
        self.c_fc = nn.Linear(N_EMBD, 4 * N_EMBD, bias_attr=False)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * N_EMBD, N_EMBD, bias_attr=False)
        self.dropout = nn.Dropout(DROPOUT)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Layer):
    def __init__(self):
        super().__init__()
        self.ln_1 = LayerNorm(N_EMBD, bias=False)
        self.attn = CausalSelfAttention()
        self.ln_2 = LayerNorm(N_EMBD, bias=False)
        self.mlp = MLP()

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Layer):
    def __init__(self):
        super().__init__()
        self.transformer = nn.LayerDict(
            dict(
                wte=nn.Embedding(VOCAB, N_EMBD),
                wpe=nn.Embedding(BLOCK_SIZE, N_EMBD),
                drop=nn.Dropout(DROPOUT),
                h=nn.LayerList([Block() for _ in range(N_LAYER)]),
                ln_f=LayerNorm(N_EMBD, bias=False),
            )
        )

    def forward(self, idx):
        b, t = idx.shape
        pos = paddle.arange(0, t, dtype="int64")
        x = self.transformer["drop"](self.transformer["wte"](idx) + self.transformer["wpe"](pos))
        for block in self.transformer["h"]:
            x = block(x)
        x = self.transformer["ln_f"](x)
        return paddle.matmul(x, self.transformer["wte"].weight, transpose_y=True)  # lm_head, tied


def build_model():
    return GPT()


def input_spec():
    return [paddle.static.InputSpec([2, 8], "int64", "idx")]


def logits_loss(logits, labels):
    """nanoGPT's loss from the logits (a pipeline's ``loss_fn``)."""
    return F.cross_entropy(logits.reshape([-1, VOCAB]), labels.reshape([-1]))


def loss(model, tokens, labels):
    return logits_loss(model(tokens), labels)
