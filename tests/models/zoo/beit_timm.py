"""BEiT as timm writes it (timm/models/beit.py), ported to Paddle at a small config.

A ViT whose attention has no k bias: ``q_bias`` and ``v_bias`` are parameters of the attention,
concatenated with a zero ``k_bias`` buffer into the bias of ``F.linear(x, weight=self.qkv.weight,
bias=qkv_bias)`` (the ``qkv`` Linear's own forward never runs), reshaped to ``[B, N, 3, heads,
head_dim]``, permuted and unbound; each block's attention adds a relative-position bias read from
its own table ``[(2W-1)^2 + 3, heads]`` (three extra entries for the class token's rows and
columns) at a buffer of indices (``gen_relative_position_index``). Layer scale: each residual
branch multiplied by ``gamma_1``/``gamma_2``. No absolute position embedding; mean pooling of the
patch tokens, ``fc_norm`` and a classification head. ``build_without_qkv_bias`` is timm's
``qkv_bias=False``: no biases to concatenate.

What differs from the torch code is spelling (``reshape`` for ``view``, ``transpose`` with the
whole permutation, ``axis`` for ``dim``); drop-path, the shared relative bias and the fused
attention path are left out.

    >>> model = build_model()
    >>> list(model(paddle.rand([2, 3, 16, 16])).shape)
    [2, 10]
"""

import paddle
import paddle.nn as nn
import paddle.nn.functional as F

IMG, PATCH, CHANS, EMBED, DEPTH, HEADS, CLASSES = 16, 2, 3, 40, 2, 4, 10
VOCAB = 64  # the harness draws token ids below this; loss() turns them into pixels


def gen_relative_position_index(window_size):
    num_relative_distance = (2 * window_size[0] - 1) * (2 * window_size[1] - 1) + 3
    # cls to token & token 2 cls & cls to cls
    # get pair-wise relative position index for each token inside the window
    window_area = window_size[0] * window_size[1]
    coords = paddle.stack(paddle.meshgrid(paddle.arange(window_size[0]), paddle.arange(window_size[1])))  # 2, Wh, Ww
    coords_flatten = paddle.flatten(coords, 1)  # 2, Wh*Ww
    relative_coords = coords_flatten[:, :, None] - coords_flatten[:, None, :]  # 2, Wh*Ww, Wh*Ww
    relative_coords = relative_coords.transpose([1, 2, 0])  # Wh*Ww, Wh*Ww, 2
    relative_coords[:, :, 0] += window_size[0] - 1  # shift to start from 0
    relative_coords[:, :, 1] += window_size[1] - 1
    relative_coords[:, :, 0] *= 2 * window_size[1] - 1
    relative_position_index = paddle.zeros([window_area + 1, window_area + 1], dtype=relative_coords.dtype)
    relative_position_index[1:, 1:] = relative_coords.sum(-1)  # Wh*Ww, Wh*Ww
    relative_position_index[0, 0:] = num_relative_distance - 3
    relative_position_index[0:, 0] = num_relative_distance - 2
    relative_position_index[0, 0] = num_relative_distance - 1
    return relative_position_index


class Attention(nn.Layer):
    def __init__(self, dim, num_heads=8, qkv_bias=False, window_size=None):
        super().__init__()
        self.num_heads = num_heads
        head_dim = dim // num_heads
        all_head_dim = head_dim * self.num_heads
        self.scale = head_dim**-0.5
        self.qkv = nn.Linear(dim, all_head_dim * 3, bias_attr=False)
        if qkv_bias:
            self.q_bias = self.create_parameter([all_head_dim], is_bias=True)
            self.register_buffer("k_bias", paddle.zeros([all_head_dim]), persistable=False)
            self.v_bias = self.create_parameter([all_head_dim], is_bias=True)
        else:
            self.q_bias = None
            self.k_bias = None
            self.v_bias = None
        if window_size:
            self.window_size = window_size
            self.num_relative_distance = (2 * window_size[0] - 1) * (2 * window_size[1] - 1) + 3
            self.relative_position_bias_table = self.create_parameter(
                [self.num_relative_distance, num_heads], default_initializer=nn.initializer.TruncatedNormal(std=0.02)
            )  # 2*Wh-1 * 2*Ww-1, nH
            self.register_buffer("relative_position_index", gen_relative_position_index(window_size), persistable=False)
        else:
            self.window_size = None
            self.relative_position_bias_table = None
            self.relative_position_index = None
        self.attn_drop = nn.Dropout(0.0)
        self.proj = nn.Linear(all_head_dim, dim)
        self.proj_drop = nn.Dropout(0.0)

    def _get_rel_pos_bias(self):
        relative_position_bias = self.relative_position_bias_table[self.relative_position_index.reshape([-1])]
        relative_position_bias = relative_position_bias.reshape(
            [self.window_size[0] * self.window_size[1] + 1, self.window_size[0] * self.window_size[1] + 1, -1]
        )  # Wh*Ww,Wh*Ww,nH
        relative_position_bias = relative_position_bias.transpose([2, 0, 1])  # nH, Wh*Ww, Wh*Ww
        return relative_position_bias.unsqueeze(0)

    def forward(self, x):
        B, N, C = x.shape
        qkv_bias = paddle.concat((self.q_bias, self.k_bias, self.v_bias)) if self.q_bias is not None else None
        qkv = F.linear(x, weight=self.qkv.weight, bias=qkv_bias)
        qkv = qkv.reshape([B, N, 3, self.num_heads, -1]).transpose([2, 0, 3, 1, 4])
        q, k, v = qkv.unbind(0)  # B, num_heads, N, head_dim
        q = q * self.scale
        attn = q @ k.transpose([0, 1, 3, 2])
        if self.relative_position_bias_table is not None:
            attn = attn + self._get_rel_pos_bias()
        attn = F.softmax(attn, axis=-1)
        attn = self.attn_drop(attn)
        x = attn @ v
        x = x.transpose([0, 2, 1, 3]).reshape([B, N, C])
        x = self.proj(x)
        return self.proj_drop(x)


class Mlp(nn.Layer):
    def __init__(self, in_features, hidden_features):
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden_features)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden_features, in_features)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Layer):
    def __init__(self, dim, num_heads, mlp_ratio=4.0, qkv_bias=False, window_size=None, init_values=None):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, epsilon=1e-6)
        self.attn = Attention(dim, num_heads=num_heads, qkv_bias=qkv_bias, window_size=window_size)
        self.norm2 = nn.LayerNorm(dim, epsilon=1e-6)
        self.mlp = Mlp(in_features=dim, hidden_features=int(dim * mlp_ratio))
        if init_values:
            self.gamma_1 = self.create_parameter([dim], default_initializer=nn.initializer.Constant(init_values))
            self.gamma_2 = self.create_parameter([dim], default_initializer=nn.initializer.Constant(init_values))
        else:
            self.gamma_1, self.gamma_2 = None, None

    def forward(self, x):
        if self.gamma_1 is None:
            x = x + self.attn(self.norm1(x))
            x = x + self.mlp(self.norm2(x))
        else:
            x = x + self.gamma_1 * self.attn(self.norm1(x))
            x = x + self.gamma_2 * self.mlp(self.norm2(x))
        return x


class PatchEmbed(nn.Layer):
    def __init__(self, img_size, patch_size):
        super().__init__()
        self.grid_size = (img_size // patch_size, img_size // patch_size)
        self.num_patches = self.grid_size[0] * self.grid_size[1]
        self.proj = nn.Conv2D(CHANS, EMBED, patch_size, stride=patch_size)

    def forward(self, x):
        return self.proj(x).flatten(2).transpose([0, 2, 1])


class Beit(nn.Layer):
    def __init__(self, img_size=IMG, patch_size=PATCH, qkv_bias=True, init_values=0.1):
        super().__init__()
        self.patch_embed = PatchEmbed(img_size, patch_size)
        self.cls_token = self.create_parameter(
            [1, 1, EMBED], default_initializer=nn.initializer.TruncatedNormal(std=0.02)
        )
        self.pos_drop = nn.Dropout(0.0)
        self.blocks = nn.LayerList(
            [
                Block(EMBED, HEADS, qkv_bias=qkv_bias, window_size=self.patch_embed.grid_size, init_values=init_values)
                for _ in range(DEPTH)
            ]
        )
        self.norm = nn.Identity()  # use_fc_norm: the mean-pooled tokens are normed instead
        self.fc_norm = nn.LayerNorm(EMBED, epsilon=1e-6)
        self.head = nn.Linear(EMBED, CLASSES)

    def forward_features(self, x):
        x = self.patch_embed(x)
        x = paddle.concat((self.cls_token.expand([x.shape[0], -1, -1]), x), axis=1)
        x = self.pos_drop(x)
        for blk in self.blocks:
            x = blk(x)
        return self.norm(x)

    def forward_head(self, x):
        x = x[:, 1:].mean(axis=1)
        x = self.fc_norm(x)
        return self.head(x)

    def forward(self, x):
        return self.forward_head(self.forward_features(x))


def build_model():
    return Beit()


def build_224():
    """timm's own image and patch sizes (224 px, 16 px patches): 197 tokens, as BEiT-B runs."""
    return Beit(img_size=224, patch_size=16)


def build_without_qkv_bias():
    """timm's ``qkv_bias=False``: ``F.linear(x, weight=self.qkv.weight, bias=None)``, no concatenation."""
    return Beit(qkv_bias=False)


def input_spec():
    return [paddle.static.InputSpec([2, CHANS, IMG, IMG], "float32", "pixels")]


def loss(model, tokens, labels):
    """Pixels from the harness's token ids (a fixed function of them), a class per sample."""
    pixels = (tokens.astype("float32") / VOCAB).reshape([tokens.shape[0], 1, 1, -1])
    pixels = paddle.tile(pixels, [1, CHANS, IMG, IMG // pixels.shape[-1]])
    return F.cross_entropy(model(pixels), labels[:, 0] % CLASSES)
