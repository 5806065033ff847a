"""Token embeddings as their communities write them, each the lookup of a tiny pre-norm LM:

- ``build_subclass``: HF's scaled word embedding (MiniCPM, Gemma 3, BART's
  ``BartScaledWordEmbedding``): an ``nn.Embedding`` subclass returning
  ``super().forward(input_ids) * self.embed_scale`` (a buffer);
- ``build_caller_scaled``: the caller scales, ``self.embed_tokens(input_ids) * self.config.scale_emb``
  (openbmb's MiniCPM modeling code);
- ``build_own_table``: a layer of its own holding the table as a parameter and calling
  ``F.embedding(input_ids, self.weight) * math.sqrt(d_model)`` (fairseq's and T5X's habit);
- ``build_shared_modes``: HF's ``TFSharedEmbeddings``, one layer that looks up in ``"embedding"``
  mode and is the tied LM head in ``"linear"`` mode (``x @ self.weight.T``);
- ``build_sparse``: ``nn.Embedding(sparse=True)``.

Sizes: batch 3, sequence 7, vocabulary 50, width 12, MLP 20: no two equal.

    >>> [list(build()(paddle.randint(0, VOCAB, [3, 7])).shape) for build in BUILDS]
    [[3, 7, 50], [3, 7, 50], [3, 7, 50], [3, 7, 50], [3, 7, 50]]
"""

import math

import paddle
import paddle.nn as nn
import paddle.nn.functional as F

VOCAB, WIDTH, FFN, LAYERS = 50, 12, 20, 2


class Config:
    scale_emb = 12.0


class ScaledWordEmbedding(nn.Embedding):
    def __init__(self, num_embeddings, embedding_dim, embed_scale=1.0):
        super().__init__(num_embeddings, embedding_dim)
        self.register_buffer("embed_scale", paddle.to_tensor(embed_scale), persistable=False)

    def forward(self, input_ids):
        return super().forward(input_ids) * self.embed_scale.astype(self.weight.dtype)


class TokenEmbedding(nn.Layer):
    def __init__(self, vocab_size, d_model):
        super().__init__()
        self.d_model = d_model
        self.weight = self.create_parameter([vocab_size, d_model], default_initializer=nn.initializer.Normal(std=0.02))

    def forward(self, input_ids):
        return F.embedding(input_ids, self.weight) * math.sqrt(self.d_model)


class SharedEmbeddings(nn.Layer):
    def __init__(self, vocab_size, hidden_size):
        super().__init__()
        self.weight = self.create_parameter([vocab_size, hidden_size], default_initializer=nn.initializer.Normal())

    def forward(self, inputs, mode="embedding"):
        if mode == "embedding":
            return F.embedding(inputs, self.weight)
        if mode == "linear":
            return paddle.matmul(inputs, self.weight, transpose_y=True)
        raise ValueError(f"mode {mode} is not valid.")


class Block(nn.Layer):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up, self.down = nn.Linear(WIDTH, FFN), nn.Linear(FFN, WIDTH)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class LM(nn.Layer):
    def __init__(self, habit):
        super().__init__()
        self.habit, self.config = habit, Config()
        if habit == "subclass":
            self.embed_tokens = ScaledWordEmbedding(VOCAB, WIDTH, embed_scale=self.config.scale_emb)
        elif habit == "own_table":
            self.embed_tokens = TokenEmbedding(VOCAB, WIDTH)
        elif habit == "shared_modes":
            self.embed_tokens = SharedEmbeddings(VOCAB, WIDTH)
        elif habit == "sparse":
            self.embed_tokens = nn.Embedding(VOCAB, WIDTH, sparse=True)
        else:
            self.embed_tokens = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.LayerList([Block() for _ in range(LAYERS)])
        self.norm = nn.LayerNorm(WIDTH)
        if habit != "shared_modes":
            self.lm_head = nn.Linear(WIDTH, VOCAB, bias_attr=False)

    def forward(self, input_ids):
        hidden = self.embed_tokens(input_ids)
        if self.habit == "caller_scaled":
            hidden = hidden * self.config.scale_emb
        for layer in self.layers:
            hidden = layer(hidden)
        hidden = self.norm(hidden)
        if self.habit == "shared_modes":
            return self.embed_tokens(hidden, mode="linear")
        return self.lm_head(hidden)


def build_subclass():
    return LM("subclass")


def build_caller_scaled():
    return LM("caller_scaled")


def build_own_table():
    return LM("own_table")


def build_shared_modes():
    return LM("shared_modes")


def build_sparse():
    return LM("sparse")


BUILDS = (build_subclass, build_caller_scaled, build_own_table, build_shared_modes, build_sparse)


def input_spec():
    return [paddle.static.InputSpec([3, 7], "int64", "input_ids")]
