"""DiT (Peebles & Xie) as facebookresearch/DiT's ``models.py`` writes it: a Conv2D patch embedding
with fixed sin-cos positions, a sinusoidal timestep embedder and a class-label table, blocks with
timm's fused ``qkv`` attention and GELU MLP modulated by ``adaLN_modulation``, a modulated final
layer, and ``unpatchify`` back to images by ``einsum("nhwpqc->nchpwq")`` in the model's own
forward. Trained, as DiT is, by the mean squared error to a target image.

    >>> model = build_model()
    >>> out = model(paddle.rand([2, CHANS, IMG, IMG]), paddle.to_tensor([3.0, 7.0]), paddle.to_tensor([1, 4]))
    >>> list(out.shape)
    [2, 3, 8, 8]
"""

import math

import paddle
import paddle.nn as nn
import paddle.nn.functional as F

IMG, PATCH, CHANS, HIDDEN, DEPTH, HEADS, MLP_RATIO, CLASSES, FREQ = 8, 2, 3, 40, 2, 4, 4, 10, 24
VOCAB = 64  # the harness draws token ids below this; loss() turns them into images and timesteps


def modulate(x, shift, scale):
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


def get_2d_sincos_pos_embed(embed_dim, grid_size):
    grid = paddle.arange(grid_size, dtype="float32")
    omega = 1.0 / 10000 ** (paddle.arange(embed_dim // 4, dtype="float32") / (embed_dim / 4.0))
    out = paddle.outer(grid, omega)
    emb_1d = paddle.concat([paddle.sin(out), paddle.cos(out)], axis=1)  # (grid, D/2)
    emb_h = emb_1d.unsqueeze(1).expand([grid_size, grid_size, embed_dim // 2])
    emb_w = emb_1d.unsqueeze(0).expand([grid_size, grid_size, embed_dim // 2])
    return paddle.concat([emb_h, emb_w], axis=-1).reshape([1, grid_size * grid_size, embed_dim])


class PatchEmbed(nn.Layer):
    def __init__(self):
        super().__init__()
        self.proj = nn.Conv2D(CHANS, HIDDEN, kernel_size=PATCH, stride=PATCH)

    def forward(self, x):
        return self.proj(x).flatten(2).transpose([0, 2, 1])


class Attention(nn.Layer):
    def __init__(self, dim, num_heads):
        super().__init__()
        self.num_heads = num_heads
        self.scale = (dim // num_heads) ** -0.5
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape([B, N, 3, self.num_heads, C // self.num_heads]).transpose([2, 0, 3, 1, 4])
        q, k, v = qkv.unbind(0)
        q = q * self.scale
        attn = F.softmax(q @ k.transpose([0, 1, 3, 2]), axis=-1)
        x = paddle.matmul(attn, v).transpose([0, 2, 1, 3]).reshape([B, N, C])
        return self.proj(x)


class Mlp(nn.Layer):
    def __init__(self, in_features, hidden_features):
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden_features)
        self.act = nn.GELU(approximate=True)
        self.fc2 = nn.Linear(hidden_features, in_features)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class TimestepEmbedder(nn.Layer):
    def __init__(self, hidden_size, frequency_embedding_size=256):
        super().__init__()
        self.mlp = nn.Sequential(
            nn.Linear(frequency_embedding_size, hidden_size), nn.Silu(), nn.Linear(hidden_size, hidden_size)
        )
        self.frequency_embedding_size = frequency_embedding_size

    @staticmethod
    def timestep_embedding(t, dim, max_period=10000):
        half = dim // 2
        freqs = paddle.exp(-math.log(max_period) * paddle.arange(0, half, dtype="float32") / half)
        args = t[:, None].astype("float32") * freqs[None]
        return paddle.concat([paddle.cos(args), paddle.sin(args)], axis=-1)

    def forward(self, t):
        return self.mlp(self.timestep_embedding(t, self.frequency_embedding_size))


class LabelEmbedder(nn.Layer):
    def __init__(self, num_classes, hidden_size, dropout_prob):
        super().__init__()
        use_cfg_embedding = dropout_prob > 0
        self.embedding_table = nn.Embedding(num_classes + use_cfg_embedding, hidden_size)
        self.num_classes = num_classes
        self.dropout_prob = dropout_prob

    def forward(self, labels, train, force_drop_ids=None):
        use_dropout = self.dropout_prob > 0
        if (train and use_dropout) or (force_drop_ids is not None):
            drop_ids = paddle.rand([labels.shape[0]]) < self.dropout_prob
            labels = paddle.where(drop_ids, paddle.full_like(labels, self.num_classes), labels)
        return self.embedding_table(labels)


class DiTBlock(nn.Layer):
    def __init__(self, hidden_size, num_heads, mlp_ratio=4.0):
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden_size, weight_attr=False, bias_attr=False, epsilon=1e-6)
        self.attn = Attention(hidden_size, num_heads=num_heads)
        self.norm2 = nn.LayerNorm(hidden_size, weight_attr=False, bias_attr=False, epsilon=1e-6)
        self.mlp = Mlp(hidden_size, int(hidden_size * mlp_ratio))
        self.adaLN_modulation = nn.Sequential(nn.Silu(), nn.Linear(hidden_size, 6 * hidden_size))

    def forward(self, x, c):
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.adaLN_modulation(c).chunk(6, axis=1)
        x = x + gate_msa.unsqueeze(1) * self.attn(modulate(self.norm1(x), shift_msa, scale_msa))
        return x + gate_mlp.unsqueeze(1) * self.mlp(modulate(self.norm2(x), shift_mlp, scale_mlp))


class FinalLayer(nn.Layer):
    def __init__(self, hidden_size, patch_size, out_channels):
        super().__init__()
        self.norm_final = nn.LayerNorm(hidden_size, weight_attr=False, bias_attr=False, epsilon=1e-6)
        self.linear = nn.Linear(hidden_size, patch_size * patch_size * out_channels)
        self.adaLN_modulation = nn.Sequential(nn.Silu(), nn.Linear(hidden_size, 2 * hidden_size))

    def forward(self, x, c):
        shift, scale = self.adaLN_modulation(c).chunk(2, axis=1)
        return self.linear(modulate(self.norm_final(x), shift, scale))


class DiT(nn.Layer):
    def __init__(self, class_dropout_prob=0.0):
        super().__init__()
        self.out_channels = CHANS
        self.patch_size = PATCH
        self.x_embedder = PatchEmbed()
        self.t_embedder = TimestepEmbedder(HIDDEN, FREQ)
        self.y_embedder = LabelEmbedder(CLASSES, HIDDEN, class_dropout_prob)
        self.register_buffer("pos_embed", get_2d_sincos_pos_embed(HIDDEN, IMG // PATCH))
        self.blocks = nn.LayerList([DiTBlock(HIDDEN, HEADS, mlp_ratio=MLP_RATIO) for _ in range(DEPTH)])
        self.final_layer = FinalLayer(HIDDEN, PATCH, self.out_channels)

    def unpatchify(self, x):
        c = self.out_channels
        p = self.patch_size
        h = w = int(x.shape[1] ** 0.5)
        x = x.reshape([x.shape[0], h, w, p, p, c])
        x = paddle.einsum("nhwpqc->nchpwq", x)
        return x.reshape([x.shape[0], c, h * p, h * p])

    def forward(self, x, t, y):
        x = self.x_embedder(x) + self.pos_embed
        t = self.t_embedder(t)
        y = self.y_embedder(y, self.training)
        c = t + y
        for block in self.blocks:
            x = block(x, c)
        x = self.final_layer(x, c)
        return self.unpatchify(x)


def build_model():
    return DiT()


def input_spec():
    return [
        paddle.static.InputSpec([2, CHANS, IMG, IMG], "float32", "x"),
        paddle.static.InputSpec([2], "float32", "t"),
        paddle.static.InputSpec([2], "int64", "y"),
    ]


def loss(model, tokens, labels):
    """Images and timesteps from the harness's token ids, a class and a target image from its labels."""

    def image(ids):
        pixels = (ids.astype("float32") / VOCAB).reshape([ids.shape[0], 1, 1, -1])
        return paddle.tile(pixels, [1, CHANS, IMG, IMG // pixels.shape[-1]])

    out = model(image(tokens), tokens[:, 0].astype("float32"), labels[:, 0] % CLASSES)
    return F.mse_loss(out, image(labels))
