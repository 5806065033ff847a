"""DistilBERT as the HuggingFace port writes it (``modeling_distilbert.py``): ``q_lin``/``k_lin``/
``v_lin``/``out_lin`` in ``MultiHeadSelfAttention``, an attention mask applied to the scores with
``paddle.where`` and a ``full_like`` fill (where HF writes ``masked_fill``), ``FFN`` with
``lin1``/``lin2`` and GELU, post-norm ``sa_layer_norm`` and ``output_layer_norm``, sinusoid-free
learned positions, blocks in ``transformer.layer``.

Written last in the round, in a style the zoo lacked (separate ``Transformer`` container,
the mask filled with ``finfo.min``, head split by ``view``/``transpose`` helpers)."""

import paddle
import paddle.nn as nn
import paddle.nn.functional as F

VOCAB, DIM, HEADS, HIDDEN, LAYERS, MAX_POS = 128, 64, 4, 256, 2, 32


class MultiHeadSelfAttention(nn.Layer):
    def __init__(self):
        super().__init__()
        self.n_heads, self.dim = HEADS, DIM
        self.dropout = nn.Dropout(0.1)
        self.q_lin = nn.Linear(DIM, DIM)
        self.k_lin = nn.Linear(DIM, DIM)
        self.v_lin = nn.Linear(DIM, DIM)
        self.out_lin = nn.Linear(DIM, DIM)

    def forward(self, query, key, value, mask):
        bs, q_length, dim = query.shape
        dim_per_head = self.dim // self.n_heads

        def shape(x):
            return x.reshape([bs, -1, self.n_heads, dim_per_head]).transpose([0, 2, 1, 3])

        def unshape(x):
            return x.transpose([0, 2, 1, 3]).reshape([bs, -1, self.n_heads * dim_per_head])

        q = shape(self.q_lin(query)) / dim_per_head**0.5
        k = shape(self.k_lin(key))
        v = shape(self.v_lin(value))
        scores = paddle.matmul(q, k, transpose_y=True)
        mask = (mask == 0).reshape([bs, 1, 1, -1]).expand_as(scores)
        scores = paddle.where(mask, paddle.full_like(scores, float(paddle.finfo(scores.dtype).min)), scores)
        weights = self.dropout(F.softmax(scores, axis=-1))
        return self.out_lin(unshape(paddle.matmul(weights, v)))


class FFN(nn.Layer):
    def __init__(self):
        super().__init__()
        self.dropout = nn.Dropout(0.1)
        self.lin1 = nn.Linear(DIM, HIDDEN)
        self.lin2 = nn.Linear(HIDDEN, DIM)

    def forward(self, x):
        return self.dropout(self.lin2(F.gelu(self.lin1(x))))


class TransformerBlock(nn.Layer):
    def __init__(self):
        super().__init__()
        self.attention = MultiHeadSelfAttention()
        self.sa_layer_norm = nn.LayerNorm(DIM, epsilon=1e-12)
        self.ffn = FFN()
        self.output_layer_norm = nn.LayerNorm(DIM, epsilon=1e-12)

    def forward(self, x, attn_mask):
        sa_output = self.sa_layer_norm(self.attention(x, x, x, attn_mask) + x)
        return self.output_layer_norm(self.ffn(sa_output) + sa_output)


class Transformer(nn.Layer):
    def __init__(self):
        super().__init__()
        self.layer = nn.LayerList([TransformerBlock() for _ in range(LAYERS)])

    def forward(self, x, attn_mask):
        for layer_module in self.layer:
            x = layer_module(x, attn_mask)
        return x


class Embeddings(nn.Layer):
    def __init__(self):
        super().__init__()
        self.word_embeddings = nn.Embedding(VOCAB, DIM)
        self.position_embeddings = nn.Embedding(MAX_POS, DIM)
        self.LayerNorm = nn.LayerNorm(DIM, epsilon=1e-12)
        self.dropout = nn.Dropout(0.1)

    def forward(self, input_ids):
        positions = paddle.arange(input_ids.shape[1], dtype="int64").unsqueeze(0)
        return self.dropout(self.LayerNorm(self.word_embeddings(input_ids) + self.position_embeddings(positions)))


class DistilBertForMaskedLM(nn.Layer):
    def __init__(self):
        super().__init__()
        self.embeddings = Embeddings()
        self.transformer = Transformer()
        self.vocab_transform = nn.Linear(DIM, DIM)
        self.vocab_layer_norm = nn.LayerNorm(DIM, epsilon=1e-12)
        self.vocab_projector = nn.Linear(DIM, VOCAB)

    def forward(self, input_ids):
        attention_mask = paddle.ones_like(input_ids)
        hidden = self.transformer(self.embeddings(input_ids), attention_mask)
        logits = self.vocab_layer_norm(F.gelu(self.vocab_transform(hidden)))
        return self.vocab_projector(logits)


def build_model():
    return DistilBertForMaskedLM()


def input_spec():
    return [paddle.static.InputSpec([2, 16], "int64", "input_ids")]


def loss(model, tokens, labels):
    return F.cross_entropy(model(tokens).reshape([-1, VOCAB]), labels.reshape([-1]))
