"""Attentions holding tensors that look per head and are not, in a small pre-norm encoder; the
local-view proof must tell (tests/test_local_view_parameters.py).

- ``build_model``: CaiT's talking-heads attention as timm writes it (timm/models/cait.py
  ``TalkingHeadAttn``): a fused ``qkv``, and two ``Linear(num_heads, num_heads)`` that mix the
  heads' scores before (``proj_l``) and after (``proj_w``) the softmax, over a permuted
  ``[B, N, N, heads]``. Those weights have a dim of ``heads`` entries, like a per-head table, but
  every head's scores read every other's: no rank's heads can run alone.
- ``build_centred``: an attention that centres its input by a mean it keeps as a buffer
  (``[dim]``, as a model keeps a normalising statistic of its inputs) before its fused ``qkv``:
  the buffer has a dim of the heads' width, like BEiT's ``k_bias``, but each rank takes the input
  whole, so each must read it whole.

    >>> model = build_model()
    >>> list(model(paddle.rand([2, 6, 24])).shape), list(build_centred()(paddle.rand([2, 6, 24])).shape)
    ([2, 6, 24], [2, 6, 24])
"""

import paddle
import paddle.nn as nn

DIM, HEADS, DEPTH, TOKENS = 24, 4, 2, 6


class TalkingHeadAttn(nn.Layer):
    def __init__(self, dim, num_heads=8, qkv_bias=False):
        super().__init__()
        self.num_heads = num_heads
        head_dim = dim // num_heads
        self.scale = head_dim**-0.5
        self.qkv = nn.Linear(dim, dim * 3, bias_attr=qkv_bias)
        self.proj = nn.Linear(dim, dim)
        self.proj_l = nn.Linear(num_heads, num_heads)
        self.proj_w = nn.Linear(num_heads, num_heads)

    def forward(self, x):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape([B, N, 3, self.num_heads, C // self.num_heads]).transpose([2, 0, 3, 1, 4])
        q, k, v = qkv[0] * self.scale, qkv[1], qkv[2]
        attn = q @ k.transpose([0, 1, 3, 2])
        attn = self.proj_l(attn.transpose([0, 2, 3, 1])).transpose([0, 3, 1, 2])
        attn = nn.functional.softmax(attn, axis=-1)
        attn = self.proj_w(attn.transpose([0, 2, 3, 1])).transpose([0, 3, 1, 2])
        x = (attn @ v).transpose([0, 2, 1, 3]).reshape([B, N, C])
        return self.proj(x)


class CentredAttention(nn.Layer):
    def __init__(self, dim, num_heads=8):
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)
        self.register_buffer("mean", paddle.zeros([dim]))

    def forward(self, x):
        B, N, _ = x.shape
        qkv = self.qkv(x - self.mean).reshape([B, N, 3, self.num_heads, -1]).transpose([2, 0, 3, 1, 4])
        q, k, v = qkv.unbind(0)
        attn = nn.functional.softmax(q @ k.transpose([0, 1, 3, 2]), axis=-1)
        return self.proj((attn @ v).transpose([0, 2, 1, 3]).reshape([B, N, -1]))


class Block(nn.Layer):
    def __init__(self, attention):
        super().__init__()
        self.norm1 = nn.LayerNorm(DIM)
        self.attn = attention(DIM, HEADS)
        self.norm2 = nn.LayerNorm(DIM)
        self.fc1 = nn.Linear(DIM, 4 * DIM)
        self.fc2 = nn.Linear(4 * DIM, DIM)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.fc2(nn.functional.gelu(self.fc1(self.norm2(x))))


class Encoder(nn.Layer):
    def __init__(self, attention=TalkingHeadAttn):
        super().__init__()
        self.blocks = nn.LayerList([Block(attention) for _ in range(DEPTH)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def build_model():
    return Encoder()


def build_centred():
    return Encoder(CentredAttention)


def input_spec():
    return [paddle.static.InputSpec([2, TOKENS, DIM], "float32", "x")]
