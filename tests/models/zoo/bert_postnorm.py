"""BERT as HuggingFace writes it (post-norm, dropout everywhere, additive extended attention
mask, GELU intermediate, MLM head with a transform and a decoder tied to the word embeddings).

    >>> model = build_model()
    >>> model(paddle.randint(0, VOCAB, [2, 8])).shape
    [2, 8, 64]
"""

import math

import paddle
import paddle.nn as nn
import paddle.nn.functional as F

VOCAB, HIDDEN, HEADS, LAYERS, INTER, MAXPOS = 64, 32, 4, 2, 64, 32


class BertEmbeddings(nn.Layer):
    def __init__(self):
        super().__init__()
        self.word_embeddings = nn.Embedding(VOCAB, HIDDEN)
        self.position_embeddings = nn.Embedding(MAXPOS, HIDDEN)
        self.token_type_embeddings = nn.Embedding(2, HIDDEN)
        self.LayerNorm = nn.LayerNorm(HIDDEN, epsilon=1e-12)
        self.dropout = nn.Dropout(0.1)
        self.register_buffer("position_ids", paddle.arange(MAXPOS).unsqueeze(0), persistable=False)

    def forward(self, input_ids):
        seq_length = input_ids.shape[1]
        position_ids = self.position_ids[:, :seq_length]
        token_type_ids = paddle.zeros_like(input_ids)
        embeddings = self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids)
        embeddings = embeddings + self.position_embeddings(position_ids)
        return self.dropout(self.LayerNorm(embeddings))


class BertSelfAttention(nn.Layer):
    def __init__(self):
        super().__init__()
        self.num_attention_heads = HEADS
        self.attention_head_size = HIDDEN // HEADS
        self.all_head_size = HIDDEN
        self.query = nn.Linear(HIDDEN, HIDDEN)
        self.key = nn.Linear(HIDDEN, HIDDEN)
        self.value = nn.Linear(HIDDEN, HIDDEN)
        self.dropout = nn.Dropout(0.1)

    def transpose_for_scores(self, x):
        new_x_shape = x.shape[:-1] + [self.num_attention_heads, self.attention_head_size]
        return x.reshape(new_x_shape).transpose([0, 2, 1, 3])

    def forward(self, hidden_states, attention_mask):
        query_layer = self.transpose_for_scores(self.query(hidden_states))
        key_layer = self.transpose_for_scores(self.key(hidden_states))
        value_layer = self.transpose_for_scores(self.value(hidden_states))
        attention_scores = paddle.matmul(query_layer, key_layer.transpose([0, 1, 3, 2]))
        attention_scores = attention_scores / math.sqrt(self.attention_head_size)
        attention_scores = attention_scores + attention_mask
        attention_probs = self.dropout(F.softmax(attention_scores, axis=-1))
        context_layer = paddle.matmul(attention_probs, value_layer).transpose([0, 2, 1, 3])
        return context_layer.reshape(context_layer.shape[:-2] + [self.all_head_size])


class BertSelfOutput(nn.Layer):
    def __init__(self):
        super().__init__()
        self.dense = nn.Linear(HIDDEN, HIDDEN)
        self.LayerNorm = nn.LayerNorm(HIDDEN, epsilon=1e-12)
        self.dropout = nn.Dropout(0.1)

    def forward(self, hidden_states, input_tensor):
        return self.LayerNorm(self.dropout(self.dense(hidden_states)) + input_tensor)


class BertAttention(nn.Layer):
    def __init__(self):
        super().__init__()
        self.self = BertSelfAttention()
        self.output = BertSelfOutput()

    def forward(self, hidden_states, attention_mask):
        return self.output(self.self(hidden_states, attention_mask), hidden_states)


class BertIntermediate(nn.Layer):
    def __init__(self):
        super().__init__()
        self.dense = nn.Linear(HIDDEN, INTER)

    def forward(self, hidden_states):
        return F.gelu(self.dense(hidden_states))


class BertOutput(nn.Layer):
    def __init__(self):
        super().__init__()
        self.dense = nn.Linear(INTER, HIDDEN)
        self.LayerNorm = nn.LayerNorm(HIDDEN, epsilon=1e-12)
        self.dropout = nn.Dropout(0.1)

    def forward(self, hidden_states, input_tensor):
        return self.LayerNorm(self.dropout(self.dense(hidden_states)) + input_tensor)


class BertLayer(nn.Layer):
    def __init__(self):
        super().__init__()
        self.attention = BertAttention()
        self.intermediate = BertIntermediate()
        self.output = BertOutput()

    def forward(self, hidden_states, attention_mask):
        attention_output = self.attention(hidden_states, attention_mask)
        return self.output(self.intermediate(attention_output), attention_output)


class BertEncoder(nn.Layer):
    def __init__(self):
        super().__init__()
        self.layer = nn.LayerList([BertLayer() for _ in range(LAYERS)])

    def forward(self, hidden_states, attention_mask):
        for layer_module in self.layer:
            hidden_states = layer_module(hidden_states, attention_mask)
        return hidden_states


class BertLMPredictionHead(nn.Layer):
    def __init__(self, word_embeddings):
        super().__init__()
        self.transform = nn.Linear(HIDDEN, HIDDEN)
        self.LayerNorm = nn.LayerNorm(HIDDEN, epsilon=1e-12)
        self.decoder_weight = word_embeddings.weight  # tied, as HF ties decoder.weight
        self.bias = self.create_parameter([VOCAB], is_bias=True)

    def forward(self, hidden_states):
        hidden_states = self.LayerNorm(F.gelu(self.transform(hidden_states)))
        return paddle.matmul(hidden_states, self.decoder_weight, transpose_y=True) + self.bias


class BertForMaskedLM(nn.Layer):
    def __init__(self):
        super().__init__()
        self.embeddings = BertEmbeddings()
        self.encoder = BertEncoder()
        self.cls = BertLMPredictionHead(self.embeddings.word_embeddings)

    def forward(self, input_ids):
        attention_mask = paddle.ones_like(input_ids)
        extended_attention_mask = (1.0 - attention_mask[:, None, None, :].astype("float32")) * -10000.0
        hidden = self.encoder(self.embeddings(input_ids), extended_attention_mask)
        return self.cls(hidden)


def build_model():
    return BertForMaskedLM()


def input_spec():
    return [paddle.static.InputSpec([2, 8], "int64", "input_ids")]


def loss(model, tokens, labels):
    return F.cross_entropy(model(tokens).reshape([-1, VOCAB]), labels.reshape([-1]))
