"""BLOOM as HF transformers' ``modeling_bloom.py`` (v4.35) writes it: no position embeddings but
ALiBi, a per-head linear bias built from slopes (``build_alibi_tensor``) and added to the
scores by ``baddbmm(alibi, query, key, beta=1, alpha=1/sqrt(head_dim))`` over merged
``[batch * heads, ...]`` tensors (the bias is ``baddbmm``'s *first* operand); one fused
``query_key_value`` laid out per head as ``[heads, 3, head_dim]`` (``_split_heads``); a LayerNorm
right after the word embeddings (``word_embeddings_layernorm``); the causal mask filled with the
dtype's minimum by ``masked_fill``; ``bloom_gelu_forward`` (the tanh approximation written out
by hand); ``dense_h_to_4h``/``dense_4h_to_h``; residual dropout through a ``dropout_add`` helper;
the LM head tied to the word embeddings, read by ``matmul(..., transpose_y=True)`` as PaddleNLP's
port of it does.

Ported to Paddle as a Paddle user would: ``reshape`` for ``view``, ``transpose`` for
``permute``/``transpose``, ``paddle.baddbmm`` as ``torch.baddbmm``.

    >>> model = build_model()
    >>> list(model(paddle.randint(0, VOCAB, [2, 8])).shape)
    [2, 8, 64]
"""

import math

import paddle
import paddle.nn as nn
import paddle.nn.functional as F

VOCAB, HIDDEN, LAYERS, HEADS = 64, 32, 2, 4


def build_alibi_tensor(attention_mask, num_heads, dtype):
    batch_size, seq_length = attention_mask.shape
    closest_power_of_2 = 2 ** math.floor(math.log2(num_heads))
    base = 2 ** (-(2 ** -(math.log2(closest_power_of_2) - 3)))
    powers = paddle.arange(1, 1 + closest_power_of_2, dtype="float32")
    slopes = paddle.pow(paddle.to_tensor(base, dtype="float32"), powers)
    arange_tensor = ((attention_mask.cumsum(axis=-1) - 1) * attention_mask)[:, None, :]
    alibi = slopes[..., None] * arange_tensor.astype("float32")
    return alibi.reshape([batch_size * num_heads, 1, seq_length]).astype(dtype)


def dropout_add(x, residual, prob, training):
    out = F.dropout(x, p=prob, training=training)
    return residual + out


def bloom_gelu_forward(x):
    return x * 0.5 * (1.0 + paddle.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))


class BloomGelu(nn.Layer):
    def forward(self, x):
        return bloom_gelu_forward(x)


class BloomAttention(nn.Layer):
    def __init__(self):
        super().__init__()
        self.hidden_size = HIDDEN
        self.num_heads = HEADS
        self.head_dim = self.hidden_size // self.num_heads
        self.inv_norm_factor = 1.0 / math.sqrt(self.head_dim)
        self.beta = 1.0
        self.query_key_value = nn.Linear(self.hidden_size, 3 * self.hidden_size)
        self.dense = nn.Linear(self.hidden_size, self.hidden_size)
        self.attention_dropout = nn.Dropout(0.0)
        self.hidden_dropout = 0.0

    def _split_heads(self, fused_qkv):
        batch_size, seq_length, three_times_hidden_size = fused_qkv.shape
        fused_qkv = fused_qkv.reshape([batch_size, seq_length, self.num_heads, 3, self.head_dim])
        return fused_qkv[..., 0, :], fused_qkv[..., 1, :], fused_qkv[..., 2, :]

    def _merge_heads(self, x):
        batch_size_and_num_heads, seq_length, _ = x.shape
        batch_size = batch_size_and_num_heads // self.num_heads
        x = x.reshape([batch_size, self.num_heads, seq_length, self.head_dim])
        x = x.transpose([0, 2, 1, 3])
        return x.reshape([batch_size, seq_length, self.num_heads * self.head_dim])

    def forward(self, hidden_states, residual, alibi, attention_mask):
        fused_qkv = self.query_key_value(hidden_states)
        (query_layer, key_layer, value_layer) = self._split_heads(fused_qkv)
        batch_size, q_length, _, _ = query_layer.shape

        query_layer = query_layer.transpose([0, 2, 1, 3]).reshape(
            [batch_size * self.num_heads, q_length, self.head_dim]
        )
        key_layer = key_layer.transpose([0, 2, 3, 1]).reshape([batch_size * self.num_heads, self.head_dim, q_length])
        value_layer = value_layer.transpose([0, 2, 1, 3]).reshape(
            [batch_size * self.num_heads, q_length, self.head_dim]
        )

        matmul_result = paddle.baddbmm(alibi, query_layer, key_layer, beta=self.beta, alpha=self.inv_norm_factor)
        attention_scores = matmul_result.reshape([batch_size, self.num_heads, q_length, q_length])
        attn_weights = paddle.masked_fill(attention_scores, attention_mask, paddle.finfo(attention_scores.dtype).min)
        attention_probs = F.softmax(attn_weights, axis=-1)
        attention_probs = self.attention_dropout(attention_probs)
        attention_probs_reshaped = attention_probs.reshape([batch_size * self.num_heads, q_length, q_length])

        context_layer = paddle.bmm(attention_probs_reshaped, value_layer)
        context_layer = self._merge_heads(context_layer)
        output_tensor = self.dense(context_layer)
        return dropout_add(output_tensor, residual, self.hidden_dropout, self.training)


class BloomMLP(nn.Layer):
    def __init__(self):
        super().__init__()
        self.dense_h_to_4h = nn.Linear(HIDDEN, 4 * HIDDEN)
        self.gelu_impl = BloomGelu()
        self.dense_4h_to_h = nn.Linear(4 * HIDDEN, HIDDEN)
        self.hidden_dropout = 0.0

    def forward(self, hidden_states, residual):
        hidden_states = self.gelu_impl(self.dense_h_to_4h(hidden_states))
        intermediate_output = self.dense_4h_to_h(hidden_states)
        return dropout_add(intermediate_output, residual, self.hidden_dropout, self.training)


class BloomBlock(nn.Layer):
    def __init__(self):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(HIDDEN, epsilon=1e-5)
        self.self_attention = BloomAttention()
        self.post_attention_layernorm = nn.LayerNorm(HIDDEN, epsilon=1e-5)
        self.mlp = BloomMLP()

    def forward(self, hidden_states, alibi, attention_mask):
        layernorm_output = self.input_layernorm(hidden_states)
        residual = hidden_states  # apply_residual_connection_post_layernorm=False
        attention_output = self.self_attention(layernorm_output, residual, alibi, attention_mask)
        layernorm_output = self.post_attention_layernorm(attention_output)
        return self.mlp(layernorm_output, attention_output)


class BloomModel(nn.Layer):
    def __init__(self):
        super().__init__()
        self.word_embeddings = nn.Embedding(VOCAB, HIDDEN)
        self.word_embeddings_layernorm = nn.LayerNorm(HIDDEN, epsilon=1e-5)
        self.h = nn.LayerList([BloomBlock() for _ in range(LAYERS)])
        self.ln_f = nn.LayerNorm(HIDDEN, epsilon=1e-5)

    def forward(self, input_ids):
        batch_size, seq_length = input_ids.shape
        hidden_states = self.word_embeddings_layernorm(self.word_embeddings(input_ids))
        attention_mask = paddle.ones([batch_size, seq_length], dtype="int64")
        alibi = build_alibi_tensor(attention_mask, HEADS, hidden_states.dtype)
        causal_mask = paddle.triu(paddle.ones([seq_length, seq_length], dtype="bool"), diagonal=1)[None, None]
        for block in self.h:
            hidden_states = block(hidden_states, alibi, causal_mask)
        return self.ln_f(hidden_states)


class BloomForCausalLM(nn.Layer):
    def __init__(self):
        super().__init__()
        self.transformer = BloomModel()

    def forward(self, input_ids):
        # the head tied to the word embeddings, as PaddleNLP's Bloom port computes it
        # (parallel_matmul: the table transposed); HF ties an nn.Linear with the same values
        hidden_states = self.transformer(input_ids)
        return paddle.matmul(hidden_states, self.transformer.word_embeddings.weight, transpose_y=True)


def build_model():
    return BloomForCausalLM()


def input_spec():
    return [paddle.static.InputSpec([2, 8], "int64", "input_ids")]


def loss(model, tokens, labels):
    return F.cross_entropy(model(tokens).reshape([-1, VOCAB]), labels.reshape([-1]))
