"""A Vision Transformer the way timm writes it: a Conv2D patch embedding, a class token and a
learned position embedding, blocks with one fused ``qkv`` Linear unbound into q, k, v, GELU MLP,
a LayerNorm and a classification head on the class token. ``build_with_transpose_y`` scores with
Paddle's own spelling of ``q @ k^T``, ``paddle.matmul(q, k, transpose_y=True)`` (as
``paddle.nn.MultiHeadAttention`` and PaddleNLP write it), through timm's ``attn_layer`` knob: one
``matmul`` then reads two results of one ``unbind`` (the planner's graph keeps one edge per
operand; with one per producer pair it lost ``k`` and Paddle's ``matmul`` SPMD rule segfaulted).

    >>> model = build_model()
    >>> model(paddle.rand([2, 3, 8, 8])).shape
    [2, 10]
"""

import paddle
import paddle.nn as nn
import paddle.nn.functional as F

IMG, PATCH, CHANS, EMBED, DEPTH, HEADS, CLASSES = 8, 2, 3, 32, 2, 4, 10
VOCAB = 64  # the harness draws token ids below this; loss() turns them into pixels


class PatchEmbed(nn.Layer):
    def __init__(self):
        super().__init__()
        self.num_patches = (IMG // PATCH) ** 2
        self.proj = nn.Conv2D(CHANS, EMBED, kernel_size=PATCH, stride=PATCH)

    def forward(self, x):
        return self.proj(x).flatten(2).transpose([0, 2, 1])  # B, N, C


class Attention(nn.Layer):
    def __init__(self, dim, num_heads, qkv_bias=True, attn_drop=0.0, proj_drop=0.0):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim**-0.5
        self.qkv = nn.Linear(dim, dim * 3, bias_attr=None if qkv_bias else False)
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, x):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape([B, N, 3, self.num_heads, self.head_dim]).transpose([2, 0, 3, 1, 4])
        q, k, v = qkv.unbind(0)
        attn = (q @ k.transpose([0, 1, 3, 2])) * self.scale
        attn = self.attn_drop(F.softmax(attn, axis=-1))
        x = (attn @ v).transpose([0, 2, 1, 3]).reshape([B, N, C])
        return self.proj_drop(self.proj(x))


class AttentionTransposeY(Attention):
    def forward(self, x):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape([B, N, 3, self.num_heads, self.head_dim]).transpose([2, 0, 3, 1, 4])
        q, k, v = qkv.unbind(0)
        attn = paddle.matmul(q, k, transpose_y=True) * self.scale
        attn = self.attn_drop(F.softmax(attn, axis=-1))
        x = paddle.matmul(attn, v).transpose([0, 2, 1, 3]).reshape([B, N, C])
        return self.proj_drop(self.proj(x))


class Mlp(nn.Layer):
    def __init__(self, in_features, hidden_features, drop=0.0):
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden_features)
        self.act = nn.GELU()
        self.drop1 = nn.Dropout(drop)
        self.fc2 = nn.Linear(hidden_features, in_features)
        self.drop2 = nn.Dropout(drop)

    def forward(self, x):
        return self.drop2(self.fc2(self.drop1(self.act(self.fc1(x)))))


class Block(nn.Layer):
    def __init__(self, dim, num_heads, mlp_ratio=4.0, attn_layer=Attention):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, epsilon=1e-6)
        self.attn = attn_layer(dim, num_heads)
        self.norm2 = nn.LayerNorm(dim, epsilon=1e-6)
        self.mlp = Mlp(dim, int(dim * mlp_ratio))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class VisionTransformer(nn.Layer):
    def __init__(self, attn_layer=Attention):
        super().__init__()
        self.patch_embed = PatchEmbed()
        self.cls_token = self.create_parameter(
            [1, 1, EMBED], default_initializer=nn.initializer.TruncatedNormal(std=0.02)
        )
        self.pos_embed = self.create_parameter(
            [1, self.patch_embed.num_patches + 1, EMBED], default_initializer=nn.initializer.TruncatedNormal(std=0.02)
        )
        self.pos_drop = nn.Dropout(0.1)
        self.blocks = nn.Sequential(*[Block(EMBED, HEADS, attn_layer=attn_layer) for _ in range(DEPTH)])
        self.norm = nn.LayerNorm(EMBED, epsilon=1e-6)
        self.head = nn.Linear(EMBED, CLASSES)

    def forward(self, x):
        x = self.patch_embed(x)
        cls = self.cls_token.expand([x.shape[0], -1, -1])
        x = self.pos_drop(paddle.concat([cls, x], axis=1) + self.pos_embed)
        x = self.norm(self.blocks(x))
        return self.head(x[:, 0])


def build_model():
    return VisionTransformer()


def build_with_transpose_y():
    return VisionTransformer(attn_layer=AttentionTransposeY)


def input_spec():
    return [paddle.static.InputSpec([2, CHANS, IMG, IMG], "float32", "pixels")]


def loss(model, tokens, labels):
    """Pixels from the harness's token ids (a fixed function of them), a class per sample."""
    pixels = (tokens.astype("float32") / VOCAB).reshape([tokens.shape[0], 1, 1, -1])
    pixels = paddle.tile(pixels, [1, CHANS, IMG, IMG // pixels.shape[-1]])
    return F.cross_entropy(model(pixels), labels[:, 0] % CLASSES)
