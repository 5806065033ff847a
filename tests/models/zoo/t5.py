"""A T5-style encoder-decoder as HuggingFace's ``modeling_t5`` writes it: a shared embedding,
``T5LayerNorm`` (RMS, no mean), relative position buckets in the first layer's attention only,
self-attention and cross-attention (``EncDecAttention``) with ``q``/``k``/``v``/``o`` and no
scaling, a ReLU ``DenseReluDense`` (``wi``, ``wo``), dropout, and an LM head tied to ``shared``.

    >>> model = build_model()
    >>> model(paddle.randint(0, VOCAB, [2, 8])).shape
    [2, 8, 64]
"""

import math

import paddle
import paddle.nn as nn
import paddle.nn.functional as F

VOCAB, D_MODEL, D_KV, D_FF, HEADS, LAYERS, BUCKETS, MAX_DISTANCE = 64, 32, 8, 64, 4, 2, 8, 16


class T5LayerNorm(nn.Layer):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = self.create_parameter([hidden_size], default_initializer=nn.initializer.Constant(1.0))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.astype("float32").pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * paddle.rsqrt(variance + self.variance_epsilon))


class T5DenseActDense(nn.Layer):
    def __init__(self):
        super().__init__()
        self.wi = nn.Linear(D_MODEL, D_FF, bias_attr=False)
        self.wo = nn.Linear(D_FF, D_MODEL, bias_attr=False)
        self.dropout = nn.Dropout(0.1)

    def forward(self, hidden_states):
        return self.wo(self.dropout(F.relu(self.wi(hidden_states))))


class T5LayerFF(nn.Layer):
    def __init__(self):
        super().__init__()
        self.DenseReluDense = T5DenseActDense()
        self.layer_norm = T5LayerNorm(D_MODEL)
        self.dropout = nn.Dropout(0.1)

    def forward(self, hidden_states):
        return hidden_states + self.dropout(self.DenseReluDense(self.layer_norm(hidden_states)))


class T5Attention(nn.Layer):
    def __init__(self, is_decoder, has_relative_attention_bias):
        super().__init__()
        self.is_decoder = is_decoder
        self.has_relative_attention_bias = has_relative_attention_bias
        self.q = nn.Linear(D_MODEL, HEADS * D_KV, bias_attr=False)
        self.k = nn.Linear(D_MODEL, HEADS * D_KV, bias_attr=False)
        self.v = nn.Linear(D_MODEL, HEADS * D_KV, bias_attr=False)
        self.o = nn.Linear(HEADS * D_KV, D_MODEL, bias_attr=False)
        if has_relative_attention_bias:
            self.relative_attention_bias = nn.Embedding(BUCKETS, HEADS)
        self.dropout = nn.Dropout(0.1)

    @staticmethod
    def _relative_position_bucket(relative_position, bidirectional, num_buckets, max_distance):
        relative_buckets = 0
        if bidirectional:
            num_buckets //= 2
            relative_buckets += (relative_position > 0).astype("int64") * num_buckets
            relative_position = paddle.abs(relative_position)
        else:
            relative_position = -paddle.minimum(relative_position, paddle.zeros_like(relative_position))
        max_exact = num_buckets // 2
        is_small = relative_position < max_exact
        large = max_exact + (
            paddle.log(relative_position.astype("float32") / max_exact)
            / math.log(max_distance / max_exact)
            * (num_buckets - max_exact)
        ).astype("int64")
        large = paddle.minimum(large, paddle.full_like(large, num_buckets - 1))
        return relative_buckets + paddle.where(is_small, relative_position, large)

    def compute_bias(self, query_length, key_length):
        context_position = paddle.arange(query_length, dtype="int64")[:, None]
        memory_position = paddle.arange(key_length, dtype="int64")[None, :]
        buckets = self._relative_position_bucket(
            memory_position - context_position, not self.is_decoder, BUCKETS, MAX_DISTANCE
        )
        return self.relative_attention_bias(buckets).transpose([2, 0, 1]).unsqueeze(0)  # 1, heads, q, k

    def forward(self, hidden_states, key_value_states=None, position_bias=None, mask=None):
        b, q_len = hidden_states.shape[:2]
        kv = hidden_states if key_value_states is None else key_value_states

        def shape(states):
            return states.reshape([b, -1, HEADS, D_KV]).transpose([0, 2, 1, 3])

        q, k, v = shape(self.q(hidden_states)), shape(self.k(kv)), shape(self.v(kv))
        scores = paddle.matmul(q, k, transpose_y=True)
        if position_bias is None:
            if self.has_relative_attention_bias:
                position_bias = self.compute_bias(q_len, k.shape[2])
            else:
                position_bias = paddle.zeros([1, HEADS, q_len, k.shape[2]], dtype=scores.dtype)
            if mask is not None:
                position_bias = position_bias + mask
        attn_weights = self.dropout(F.softmax(scores + position_bias, axis=-1))
        out = paddle.matmul(attn_weights, v).transpose([0, 2, 1, 3]).reshape([b, -1, HEADS * D_KV])
        return self.o(out), position_bias


class T5LayerSelfAttention(nn.Layer):
    def __init__(self, is_decoder, has_relative_attention_bias):
        super().__init__()
        self.SelfAttention = T5Attention(is_decoder, has_relative_attention_bias)
        self.layer_norm = T5LayerNorm(D_MODEL)
        self.dropout = nn.Dropout(0.1)

    def forward(self, hidden_states, position_bias=None, mask=None):
        out, position_bias = self.SelfAttention(self.layer_norm(hidden_states), position_bias=position_bias, mask=mask)
        return hidden_states + self.dropout(out), position_bias


class T5LayerCrossAttention(nn.Layer):
    def __init__(self):
        super().__init__()
        self.EncDecAttention = T5Attention(True, False)
        self.layer_norm = T5LayerNorm(D_MODEL)
        self.dropout = nn.Dropout(0.1)

    def forward(self, hidden_states, key_value_states):
        out, _ = self.EncDecAttention(self.layer_norm(hidden_states), key_value_states=key_value_states)
        return hidden_states + self.dropout(out)


class T5Block(nn.Layer):
    def __init__(self, is_decoder, has_relative_attention_bias):
        super().__init__()
        self.is_decoder = is_decoder
        self.layer = nn.LayerList([T5LayerSelfAttention(is_decoder, has_relative_attention_bias)])
        if is_decoder:
            self.layer.append(T5LayerCrossAttention())
        self.layer.append(T5LayerFF())

    def forward(self, hidden_states, position_bias=None, mask=None, encoder_hidden_states=None):
        hidden_states, position_bias = self.layer[0](hidden_states, position_bias=position_bias, mask=mask)
        if self.is_decoder:
            hidden_states = self.layer[1](hidden_states, encoder_hidden_states)
        return self.layer[-1](hidden_states), position_bias


class T5Stack(nn.Layer):
    def __init__(self, embed_tokens, is_decoder):
        super().__init__()
        self.embed_tokens = embed_tokens
        self.is_decoder = is_decoder
        self.block = nn.LayerList([T5Block(is_decoder, has_relative_attention_bias=(i == 0)) for i in range(LAYERS)])
        self.final_layer_norm = T5LayerNorm(D_MODEL)
        self.dropout = nn.Dropout(0.1)

    def forward(self, input_ids, encoder_hidden_states=None):
        hidden_states = self.dropout(self.embed_tokens(input_ids))
        mask = None
        if self.is_decoder:
            s = input_ids.shape[1]
            mask = paddle.triu(paddle.full([s, s], -1e9), diagonal=1)[None, None]
        position_bias = None
        for layer_module in self.block:
            hidden_states, position_bias = layer_module(hidden_states, position_bias, mask, encoder_hidden_states)
        return self.dropout(self.final_layer_norm(hidden_states))


class T5ForConditionalGeneration(nn.Layer):
    def __init__(self):
        super().__init__()
        self.shared = nn.Embedding(VOCAB, D_MODEL)
        self.encoder = T5Stack(self.shared, is_decoder=False)
        self.decoder = T5Stack(self.shared, is_decoder=True)

    def forward(self, input_ids, decoder_input_ids=None):
        decoder_input_ids = input_ids if decoder_input_ids is None else decoder_input_ids
        encoder_outputs = self.encoder(input_ids)
        sequence_output = self.decoder(decoder_input_ids, encoder_hidden_states=encoder_outputs)
        sequence_output = sequence_output * (D_MODEL**-0.5)
        return paddle.matmul(sequence_output, self.shared.weight, transpose_y=True)


def build_model():
    return T5ForConditionalGeneration()


def input_spec():
    return [paddle.static.InputSpec([2, 8], "int64", "input_ids")]


def loss(model, tokens, labels):
    return F.cross_entropy(model(tokens).reshape([-1, VOCAB]), labels.reshape([-1]))
