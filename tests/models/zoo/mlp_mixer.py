"""MLP-Mixer as timm writes it (``MixerBlock``): no attention at all; a token-mixing MLP applied
across patches (``x.transpose(1, 2)``) and a channel-mixing MLP, each with LayerNorm in front
and a residual around it; a Conv2D stem and mean pooling before the classifier head.

    >>> model = build_model()
    >>> model(paddle.rand([2, 3, 8, 8])).shape
    [2, 10]
"""

import paddle
import paddle.nn as nn
import paddle.nn.functional as F

IMG, PATCH, CHANS, DIM, DEPTH, CLASSES = 8, 2, 3, 32, 2, 10
TOKENS = (IMG // PATCH) ** 2
VOCAB = 64  # the harness draws token ids below this; loss() turns them into pixels


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


class MixerBlock(nn.Layer):
    def __init__(self, dim, seq_len, mlp_ratio=(0.5, 4.0)):
        super().__init__()
        tokens_dim, channels_dim = int(mlp_ratio[0] * dim), int(mlp_ratio[1] * dim)
        self.norm1 = nn.LayerNorm(dim, epsilon=1e-6)
        self.mlp_tokens = Mlp(seq_len, tokens_dim)
        self.norm2 = nn.LayerNorm(dim, epsilon=1e-6)
        self.mlp_channels = Mlp(dim, channels_dim)

    def forward(self, x):
        x = x + self.mlp_tokens(self.norm1(x).transpose([0, 2, 1])).transpose([0, 2, 1])
        return x + self.mlp_channels(self.norm2(x))


class MlpMixer(nn.Layer):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2D(CHANS, DIM, kernel_size=PATCH, stride=PATCH)
        self.blocks = nn.Sequential(*[MixerBlock(DIM, TOKENS) for _ in range(DEPTH)])
        self.norm = nn.LayerNorm(DIM, epsilon=1e-6)
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, x):
        x = self.stem(x).flatten(2).transpose([0, 2, 1])
        x = self.norm(self.blocks(x))
        return self.head(x.mean(axis=1))


def build_model():
    return MlpMixer()


def input_spec():
    return [paddle.static.InputSpec([2, CHANS, IMG, IMG], "float32", "pixels")]


def loss(model, tokens, labels):
    """Pixels from the harness's token ids (a fixed function of them), a class per sample."""
    pixels = (tokens.astype("float32") / VOCAB).reshape([tokens.shape[0], 1, 1, -1])
    pixels = paddle.tile(pixels, [1, CHANS, IMG, IMG // pixels.shape[-1]])
    return F.cross_entropy(model(pixels), labels[:, 0] % CLASSES)
