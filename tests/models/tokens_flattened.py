"""Blocks whose MLP runs on the flattened tokens, as token-routing code writes it
(``x.flatten(0, 1)``: every token of every sequence one row), at any sequence length."""

import paddle
import paddle.nn as nn
import paddle.nn.functional as F

HIDDEN, FFN, LAYERS, BATCH = 48, 80, 2, 2


class Block(nn.Layer):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.fc1 = nn.Linear(HIDDEN, FFN)
        self.fc2 = nn.Linear(FFN, HIDDEN)

    def forward(self, x):
        tokens = self.norm(x).flatten(0, 1)
        return x + self.fc2(F.gelu(self.fc1(tokens))).reshape(x.shape)


class Model(nn.Layer):
    def __init__(self):
        super().__init__()
        self.blocks = nn.LayerList([Block() for _ in range(LAYERS)])
        self.head = nn.Linear(HIDDEN, 7)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(1))


def build_model():
    return Model()


def input_spec():
    return [paddle.static.InputSpec([BATCH, None, HIDDEN], "float32", "embeddings")]
