"""Segment Anything's image encoder (``ImageEncoderViT``) the way a Paddle port writes it: a Conv2D
patch embedding kept channels-last, an absolute position embedding added to the ``[B, H, W, C]``
grid, ``Block``s of LayerNorm, ``Attention`` with one fused ``qkv`` Linear and an ``MLPBlock``
(``lin1``, GELU, ``lin2``), and the neck of two convolutions with ``LayerNorm2d``. The attention
reads its sizes from ``paddle.shape(x)``, so the trace knows them only at run time (-1), and
folds the heads back with ``flatten``. A classification head on the pooled neck stands in for
the mask decoder. Sizes are tiny; no two coincide.

    >>> model = build_model()
    >>> model(paddle.rand([2, CHANS, IMG_H, IMG_W])).shape
    [2, 7]
"""

import paddle
import paddle.nn as nn
import paddle.nn.functional as F

IMG_H, IMG_W, CHANS, PATCH, EMBED, HEADS, DEPTH, OUT_CHANS, CLASSES = 12, 16, 3, 2, 40, 4, 2, 20, 7
VOCAB = 64  # the harness draws token ids below this; loss() turns them into pixels


class MLPBlock(nn.Layer):
    def __init__(self, embedding_dim, mlp_dim, act=nn.GELU):
        super().__init__()
        self.lin1 = nn.Linear(embedding_dim, mlp_dim)
        self.lin2 = nn.Linear(mlp_dim, embedding_dim)
        self.act = act()

    def forward(self, x):
        return self.lin2(self.act(self.lin1(x)))


class LayerNorm2d(nn.Layer):
    def __init__(self, num_channels, eps=1e-6):
        super().__init__()
        self.weight = self.create_parameter([num_channels], default_initializer=nn.initializer.Constant(1.0))
        self.bias = self.create_parameter([num_channels], default_initializer=nn.initializer.Constant(0.0))
        self.eps = eps

    def forward(self, x):
        u = x.mean(1, keepdim=True)
        s = (x - u).pow(2).mean(1, keepdim=True)
        x = (x - u) / paddle.sqrt(s + self.eps)
        return self.weight[:, None, None] * x + self.bias[:, None, None]


class Attention(nn.Layer):
    """Multi-head attention with one fused qkv projection."""

    def __init__(self, dim, num_heads=8, qkv_bias=True):
        super().__init__()
        self.num_heads = num_heads
        head_dim = dim // num_heads
        self.scale = head_dim**-0.5
        self.qkv = nn.Linear(dim, dim * 3, bias_attr=qkv_bias)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        B, H, W, _ = paddle.shape(x)
        # qkv with shape (3, B, nHead, H * W, C)
        qkv = self.qkv(x).reshape([B, H * W, 3, self.num_heads, -1]).transpose([2, 0, 3, 1, 4])
        q, k, v = qkv.unbind(0)
        attn = F.softmax((q * self.scale) @ k.transpose([0, 1, 3, 2]), axis=-1)
        x = (attn @ v).transpose([0, 2, 1, 3]).flatten(2).reshape([B, H, W, -1])
        return self.proj(x)


class Block(nn.Layer):
    def __init__(self, dim, num_heads, mlp_ratio=4.0, norm_layer=nn.LayerNorm, act_layer=nn.GELU):
        super().__init__()
        self.norm1 = norm_layer(dim)
        self.attn = Attention(dim, num_heads=num_heads)
        self.norm2 = norm_layer(dim)
        self.mlp = MLPBlock(embedding_dim=dim, mlp_dim=int(dim * mlp_ratio), act=act_layer)

    def forward(self, x):
        shortcut = x
        x = self.attn(self.norm1(x))
        x = shortcut + x
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Layer):
    def __init__(self, kernel_size=(PATCH, PATCH), stride=(PATCH, PATCH), in_chans=CHANS, embed_dim=EMBED):
        super().__init__()
        self.proj = nn.Conv2D(in_chans, embed_dim, kernel_size=kernel_size, stride=stride)

    def forward(self, x):
        return self.proj(x).transpose([0, 2, 3, 1])  # B C H W -> B H W C


class ImageEncoderViT(nn.Layer):
    def __init__(self):
        super().__init__()
        self.patch_embed = PatchEmbed()
        self.pos_embed = self.create_parameter(
            [1, IMG_H // PATCH, IMG_W // PATCH, EMBED], default_initializer=nn.initializer.TruncatedNormal(std=0.02)
        )
        self.blocks = nn.LayerList([Block(EMBED, HEADS) for _ in range(DEPTH)])
        self.neck = nn.Sequential(
            nn.Conv2D(EMBED, OUT_CHANS, kernel_size=1, bias_attr=False),
            LayerNorm2d(OUT_CHANS),
            nn.Conv2D(OUT_CHANS, OUT_CHANS, kernel_size=3, padding=1, bias_attr=False),
            LayerNorm2d(OUT_CHANS),
        )
        self.head = nn.Linear(OUT_CHANS, CLASSES)

    def forward(self, x):
        x = self.patch_embed(x)
        x = x + self.pos_embed
        for blk in self.blocks:
            x = blk(x)
        x = self.neck(x.transpose([0, 3, 1, 2]))
        return self.head(x.mean(axis=[2, 3]))


def build_model():
    return ImageEncoderViT()


def input_spec():
    return [paddle.static.InputSpec([2, CHANS, IMG_H, IMG_W], "float32", "pixels")]


def loss(model, tokens, labels):
    """Pixels from the harness's token ids (a fixed function of them), a class per sample."""
    pixels = (tokens.astype("float32") / VOCAB).reshape([tokens.shape[0], 1, 1, -1])
    pixels = paddle.tile(pixels, [1, CHANS, IMG_H, IMG_W // pixels.shape[-1]])
    return F.cross_entropy(model(pixels), labels[:, 0] % CLASSES)
