"""Swin Transformer as timm writes it (timm/models/swin_transformer.py), ported to Paddle at a
small config.

Windowed attention: the feature map is cut into ``window_size`` x ``window_size`` windows
(``window_partition``: reshape, permute, reshape), every other block shifts it by half a window
first (``paddle.roll``) and masks the scores between pieces the shift brought together (a mask
built once in ``__init__`` and kept as a buffer, added as ``attn.reshape([-1, num_win, heads, N,
N]) + mask``). Each window's attention: one fused ``qkv`` Linear reshaped to ``[B_, N, 3, heads,
head_dim]`` and permuted, ``unbind``, ``q * scale``, ``q @ k^T``, plus a relative-position bias
read from a learned table ``[(2W-1)^2, heads]`` at a buffer of indices
(``relative_position_index``) and permuted to ``[heads, N, N]``; ``proj`` back. A
``PatchMerging`` between the two stages (2x2 neighbours concatenated, LayerNorm, a bias-free
``reduction`` Linear), GELU MLPs, mean pooling and a classification head.

What differs from the torch code is spelling (``reshape`` for ``view``, ``transpose`` with the
whole permutation, ``axis`` for ``dim``); drop-path and the fused-attention path are left out.

    >>> model = build_model()
    >>> list(model(paddle.rand([2, 3, 16, 16])).shape)
    [2, 10]
"""

import paddle
import paddle.nn as nn
import paddle.nn.functional as F

IMG, PATCH, CHANS, EMBED, WINDOW, CLASSES = 16, 2, 3, 24, 4, 10
DEPTHS, HEADS = (2, 2), (2, 4)
VOCAB = 64  # the harness draws token ids below this; loss() turns them into pixels


def window_partition(x, window_size):
    B, H, W, C = x.shape
    x = x.reshape([B, H // window_size, window_size, W // window_size, window_size, C])
    return x.transpose([0, 1, 3, 2, 4, 5]).reshape([-1, window_size, window_size, C])


def window_reverse(windows, window_size, H, W):
    C = windows.shape[-1]
    x = windows.reshape([-1, H // window_size, W // window_size, window_size, window_size, C])
    return x.transpose([0, 1, 3, 2, 4, 5]).reshape([-1, H, W, C])


def get_relative_position_index(win_h, win_w):
    coords = paddle.stack(paddle.meshgrid(paddle.arange(win_h), paddle.arange(win_w)))  # 2, Wh, Ww
    coords_flatten = paddle.flatten(coords, 1)  # 2, Wh*Ww
    relative_coords = coords_flatten[:, :, None] - coords_flatten[:, None, :]
    relative_coords = relative_coords.transpose([1, 2, 0])
    relative_coords[:, :, 0] += win_h - 1
    relative_coords[:, :, 1] += win_w - 1
    relative_coords[:, :, 0] *= 2 * win_w - 1
    return relative_coords.sum(-1)  # Wh*Ww, Wh*Ww


class WindowAttention(nn.Layer):
    def __init__(self, dim, num_heads, window_size, qkv_bias=True):
        super().__init__()
        self.dim = dim
        self.window_size = window_size
        self.window_area = window_size * window_size
        self.num_heads = num_heads
        head_dim = dim // num_heads
        self.scale = head_dim**-0.5
        self.relative_position_bias_table = self.create_parameter(
            [(2 * window_size - 1) * (2 * window_size - 1), num_heads],
            default_initializer=nn.initializer.TruncatedNormal(std=0.02),
        )
        self.register_buffer(
            "relative_position_index", get_relative_position_index(window_size, window_size), persistable=False
        )
        self.qkv = nn.Linear(dim, dim * 3, bias_attr=qkv_bias)
        self.attn_drop = nn.Dropout(0.0)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(0.0)
        self.softmax = nn.Softmax(axis=-1)

    def _get_rel_pos_bias(self):
        relative_position_bias = self.relative_position_bias_table[self.relative_position_index.reshape([-1])]
        relative_position_bias = relative_position_bias.reshape([self.window_area, self.window_area, -1])
        relative_position_bias = relative_position_bias.transpose([2, 0, 1])
        return relative_position_bias.unsqueeze(0)

    def forward(self, x, mask=None):
        B_, N, C = x.shape
        qkv = self.qkv(x).reshape([B_, N, 3, self.num_heads, -1]).transpose([2, 0, 3, 1, 4])
        q, k, v = qkv.unbind(0)
        q = q * self.scale
        attn = q @ k.transpose([0, 1, 3, 2])
        attn = attn + self._get_rel_pos_bias()
        if mask is not None:
            num_win = mask.shape[0]
            attn = attn.reshape([-1, num_win, self.num_heads, N, N]) + mask.unsqueeze(1).unsqueeze(0)
            attn = attn.reshape([-1, self.num_heads, N, N])
        attn = self.softmax(attn)
        attn = self.attn_drop(attn)
        x = attn @ v
        x = x.transpose([0, 2, 1, 3]).reshape([B_, N, -1])
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


class SwinTransformerBlock(nn.Layer):
    def __init__(self, dim, input_resolution, num_heads, window_size, shift_size=0, mlp_ratio=4.0):
        super().__init__()
        self.input_resolution = input_resolution
        self.window_size = window_size
        self.shift_size = shift_size
        self.norm1 = nn.LayerNorm(dim)
        self.attn = WindowAttention(dim, num_heads, window_size)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = Mlp(dim, int(dim * mlp_ratio))
        self.register_buffer("attn_mask", self.get_attn_mask(), persistable=False)

    def get_attn_mask(self):
        if not self.shift_size:
            return None
        H, W = self.input_resolution
        img_mask = paddle.zeros([1, H, W, 1])
        cnt = 0
        for h in (
            slice(0, -self.window_size),
            slice(-self.window_size, -self.shift_size),
            slice(-self.shift_size, None),
        ):
            for w in (
                slice(0, -self.window_size),
                slice(-self.window_size, -self.shift_size),
                slice(-self.shift_size, None),
            ):
                img_mask[:, h, w, :] = cnt
                cnt += 1
        mask_windows = window_partition(img_mask, self.window_size)  # nW, window_size, window_size, 1
        mask_windows = mask_windows.reshape([-1, self.window_size * self.window_size])
        attn_mask = mask_windows.unsqueeze(1) - mask_windows.unsqueeze(2)
        return paddle.where(attn_mask != 0, paddle.full_like(attn_mask, -100.0), paddle.zeros_like(attn_mask))

    def _attn(self, x):
        B, H, W, C = x.shape
        if self.shift_size > 0:
            shifted_x = paddle.roll(x, shifts=(-self.shift_size, -self.shift_size), axis=(1, 2))
        else:
            shifted_x = x
        x_windows = window_partition(shifted_x, self.window_size)
        x_windows = x_windows.reshape([-1, self.window_size * self.window_size, C])
        attn_windows = self.attn(x_windows, mask=self.attn_mask)
        attn_windows = attn_windows.reshape([-1, self.window_size, self.window_size, C])
        shifted_x = window_reverse(attn_windows, self.window_size, H, W)
        if self.shift_size > 0:
            x = paddle.roll(shifted_x, shifts=(self.shift_size, self.shift_size), axis=(1, 2))
        else:
            x = shifted_x
        return x

    def forward(self, x):
        B, H, W, C = x.shape
        x = x + self._attn(self.norm1(x))
        x = x.reshape([B, -1, C])
        x = x + self.mlp(self.norm2(x))
        return x.reshape([B, H, W, C])


class PatchMerging(nn.Layer):
    def __init__(self, dim, out_dim):
        super().__init__()
        self.norm = nn.LayerNorm(4 * dim)
        self.reduction = nn.Linear(4 * dim, out_dim, bias_attr=False)

    def forward(self, x):
        B, H, W, C = x.shape
        x = x.reshape([B, H // 2, 2, W // 2, 2, C]).transpose([0, 1, 3, 4, 2, 5]).flatten(3)
        return self.reduction(self.norm(x))


class SwinTransformerStage(nn.Layer):
    def __init__(self, dim, out_dim, input_resolution, depth, downsample, num_heads, window_size):
        super().__init__()
        self.output_resolution = tuple(i // 2 for i in input_resolution) if downsample else input_resolution
        self.downsample = PatchMerging(dim, out_dim) if downsample else nn.Identity()
        shift_size = window_size // 2
        self.blocks = nn.Sequential(
            *[
                SwinTransformerBlock(
                    out_dim, self.output_resolution, num_heads, window_size, 0 if i % 2 == 0 else shift_size
                )
                for i in range(depth)
            ]
        )

    def forward(self, x):
        return self.blocks(self.downsample(x))


class PatchEmbed(nn.Layer):
    def __init__(self, patch_size):
        super().__init__()
        self.proj = nn.Conv2D(CHANS, EMBED, patch_size, stride=patch_size)
        self.norm = nn.LayerNorm(EMBED)

    def forward(self, x):
        return self.norm(self.proj(x).transpose([0, 2, 3, 1]))  # NHWC, as timm's output_fmt="NHWC"


class SwinTransformer(nn.Layer):
    def __init__(self, img_size=IMG, patch_size=PATCH, window_size=WINDOW):
        super().__init__()
        self.patch_embed = PatchEmbed(patch_size)
        resolution = (img_size // patch_size, img_size // patch_size)
        dims = [EMBED * 2**i for i in range(len(DEPTHS))]
        stages, in_dim = [], dims[0]
        for i, (depth, heads) in enumerate(zip(DEPTHS, HEADS)):
            stages.append(SwinTransformerStage(in_dim, dims[i], resolution, depth, i > 0, heads, window_size))
            resolution, in_dim = stages[-1].output_resolution, dims[i]
        self.layers = nn.Sequential(*stages)
        self.norm = nn.LayerNorm(dims[-1])
        self.head = nn.Linear(dims[-1], CLASSES)

    def forward(self, x):
        x = self.norm(self.layers(self.patch_embed(x)))
        return self.head(x.mean(axis=(1, 2)))


def build_model():
    return SwinTransformer()


def build_224():
    """timm's own image, patch and window sizes (224 px, 4 px patches, windows of 7 x 7): 49
    tokens a window, 64 windows a sample in the first stage, as Swin-T runs."""
    return SwinTransformer(img_size=224, patch_size=4, window_size=7)


def input_spec():
    return [paddle.static.InputSpec([2, CHANS, IMG, IMG], "float32", "pixels")]


def loss(model, tokens, labels):
    """Pixels from the harness's token ids (a fixed function of them), a class per sample."""
    pixels = (tokens.astype("float32") / VOCAB).reshape([tokens.shape[0], 1, 1, -1])
    pixels = paddle.tile(pixels, [1, CHANS, IMG, IMG // pixels.shape[-1]])
    return F.cross_entropy(model(pixels), labels[:, 0] % CLASSES)
