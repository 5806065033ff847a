"""A classifier-free language model built on ``paddle.nn.TransformerEncoder`` as its docs
show it: default post-norm layers (``normalize_before=False``), ReLU, dropout 0.1, a causal
a causal ``src_mask`` of ``-inf`` above the diagonal.

    >>> model = build_model()
    >>> model(paddle.randint(0, VOCAB, [2, 8])).shape
    [2, 8, 64]
"""

import paddle
import paddle.nn as nn
import paddle.nn.functional as F

VOCAB, D_MODEL, NHEAD, LAYERS, FFN = 64, 32, 4, 2, 64


class EncoderLM(nn.Layer):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D_MODEL)
        self.pos = nn.Embedding(32, D_MODEL)
        layer = nn.TransformerEncoderLayer(D_MODEL, NHEAD, FFN, dropout=0.1)
        self.encoder = nn.TransformerEncoder(layer, LAYERS, norm=nn.LayerNorm(D_MODEL))
        self.head = nn.Linear(D_MODEL, VOCAB)

    def forward(self, tokens):
        seq = tokens.shape[1]
        x = self.embed(tokens) + self.pos(paddle.arange(seq).unsqueeze(0))
        mask = paddle.triu(
            paddle.full([seq, seq], float("-inf")), diagonal=1
        )  # what generate_square_subsequent_mask returns
        return self.head(self.encoder(x, src_mask=mask))


def build_model():
    return EncoderLM()


def input_spec():
    return [paddle.static.InputSpec([2, 8], "int64", "tokens")]


def loss(model, tokens, labels):
    return F.cross_entropy(model(tokens).reshape([-1, VOCAB]), labels.reshape([-1]))
