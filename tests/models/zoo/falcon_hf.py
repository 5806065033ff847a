"""Falcon-7B as HF transformers' ``modeling_falcon.py`` (v4.33) writes it: multi-query attention
(``multi_query=True``: one K/V head) fused in one ``query_key_value`` projection of ``hidden + 2 *
head_dim`` features, cut into heads by ``view`` and indexing (``[..., :-2, :]``, ``[..., [-2], :]``),
the K/V head broadcast over the query heads by ``@``; a rotary table the rotary layer builds in
its first forward with ``torch.einsum("i,j->ij", t, self.inv_freq)`` (``t`` an ``arange``,
``inv_freq`` a buffer) applied on merged ``[batch * heads, seq, head_dim]`` tensors; a parallel
attention + MLP block under one LayerNorm (``parallel_attn``); ``FalconLinear`` (``input @ weight``);
the LM head tied to the word embeddings.

    >>> model = build_model()
    >>> model(paddle.randint(0, VOCAB, [2, 8])).shape
    [2, 8, 64]
"""

import math

import paddle
import paddle.nn as nn
import paddle.nn.functional as F

VOCAB, HIDDEN, LAYERS, HEADS = 64, 32, 2, 4
HEAD_DIM = HIDDEN // HEADS


class FalconLinear(nn.Linear):
    def forward(self, input):
        hidden_states = input @ self.weight
        if self.bias is None:
            return hidden_states
        return hidden_states + self.bias


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return paddle.concat((-x2, x1), axis=x1.ndim - 1)


class FalconRotaryEmbedding(nn.Layer):
    """Implementation of RotaryEmbedding from GPT-NeoX. This implementation is designed to operate
    on queries and keys that are compatible with `[batch_size, n_heads_per_partition, seq_len, head_dim]`
    (e.g. MinGPTAttention format)."""

    def __init__(self, head_dim, base=10000):
        super().__init__()
        inv_freq = 1.0 / (base ** (paddle.arange(0, head_dim, 2).astype("float32") / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistable=False)
        self.head_dim = head_dim
        self.seq_len_cached = -1
        self.cos_cached = None
        self.sin_cached = None

    def cos_sin(self, seq_len, past_key_values_length, dtype):
        total_length = seq_len + past_key_values_length
        if total_length > self.seq_len_cached:
            self.seq_len_cached = total_length
            t = paddle.arange(total_length, dtype=self.inv_freq.dtype)
            freqs = paddle.einsum("i,j->ij", t, self.inv_freq)
            emb = paddle.concat((freqs, freqs), axis=-1)
            self.cos_cached = emb.cos()[None, :, :].astype(dtype)
            self.sin_cached = emb.sin()[None, :, :].astype(dtype)
        return (
            self.cos_cached[:, past_key_values_length : seq_len + past_key_values_length],
            self.sin_cached[:, past_key_values_length : seq_len + past_key_values_length],
        )

    def forward(self, query, key, past_key_values_length=0):
        batch, seq_len, head_dim = query.shape
        cos, sin = self.cos_sin(seq_len, past_key_values_length, query.dtype)
        return (query * cos) + (rotate_half(query) * sin), (key * cos) + (rotate_half(key) * sin)


class FalconAttention(nn.Layer):
    def __init__(self):
        super().__init__()
        self.hidden_size, self.num_heads = HIDDEN, HEADS
        self.head_dim = self.hidden_size // self.num_heads
        self.split_size = self.hidden_size
        self.maybe_rotary = FalconRotaryEmbedding(self.head_dim)
        self.inv_norm_factor = 1.0 / math.sqrt(self.head_dim)
        self.multi_query = True
        qkv_out_dim = self.hidden_size + 2 * self.head_dim
        self.query_key_value = FalconLinear(self.hidden_size, qkv_out_dim, bias_attr=False)
        self.dense = FalconLinear(self.hidden_size, self.hidden_size, bias_attr=False)
        self.num_kv_heads = 1

    def _split_heads(self, fused_qkv):
        """Split the last dimension into (num_heads, head_dim), results share same memory storage
        as `fused_qkv`."""
        batch_size, seq_length, three_times_hidden_size = fused_qkv.shape
        fused_qkv = fused_qkv.reshape([batch_size, seq_length, self.num_heads + 2, self.head_dim])
        return fused_qkv[..., :-2, :], fused_qkv[..., [-2], :], fused_qkv[..., [-1], :]

    def _merge_heads(self, x):
        # [batch_size * num_heads, seq_length, head_dim] -> [batch_size, seq_length, num_heads * head_dim]
        batch_size_and_num_heads, seq_length, _ = x.shape
        batch_size = batch_size_and_num_heads // self.num_heads
        x = x.reshape([batch_size, self.num_heads, seq_length, self.head_dim])
        x = x.transpose([0, 2, 1, 3])
        return x.reshape([batch_size, seq_length, self.num_heads * self.head_dim])

    def forward(self, hidden_states, attention_mask):
        fused_qkv = self.query_key_value(hidden_states)  # [batch_size, seq_length, 3 x hidden_size]
        num_kv_heads = self.num_kv_heads
        # 3 x [batch_size, seq_length, num_heads, head_dim]
        (query_layer, key_layer, value_layer) = self._split_heads(fused_qkv)

        batch_size, query_length, _, _ = query_layer.shape

        query_layer = query_layer.transpose([0, 2, 1, 3]).reshape(
            [batch_size * self.num_heads, query_length, self.head_dim]
        )
        key_layer = key_layer.transpose([0, 2, 1, 3]).reshape([batch_size * num_kv_heads, query_length, self.head_dim])
        value_layer = value_layer.transpose([0, 2, 1, 3]).reshape(
            [batch_size * num_kv_heads, query_length, self.head_dim]
        )

        query_layer, key_layer = self.maybe_rotary(query_layer, key_layer)

        _, kv_length, _ = key_layer.shape
        attention_mask_float = (
            (attention_mask * 1.0).masked_fill(attention_mask, float("-1e9")).astype(query_layer.dtype)
        )

        query_layer_ = query_layer.reshape([batch_size, self.num_heads, -1, self.head_dim])
        key_layer_ = key_layer.reshape([batch_size, num_kv_heads, -1, self.head_dim])
        value_layer_ = value_layer.reshape([batch_size, num_kv_heads, -1, self.head_dim])

        attention_scores = query_layer_ @ key_layer_.transpose([0, 1, 3, 2])
        attention_scores /= math.sqrt(self.head_dim)
        attention_scores = F.softmax(attention_scores + attention_mask_float, axis=-1, dtype=hidden_states.dtype)
        attn_output = attention_scores @ value_layer_

        attn_output = attn_output.reshape([batch_size, self.num_heads, query_length, self.head_dim])
        attn_output = attn_output.transpose([0, 2, 1, 3])
        attn_output = attn_output.reshape([batch_size, query_length, self.num_heads * self.head_dim])
        return self.dense(attn_output)


class FalconMLP(nn.Layer):
    def __init__(self):
        super().__init__()
        self.dense_h_to_4h = FalconLinear(HIDDEN, 4 * HIDDEN, bias_attr=False)
        self.act = nn.GELU()
        self.dense_4h_to_h = FalconLinear(4 * HIDDEN, HIDDEN, bias_attr=False)

    def forward(self, x):
        x = self.act(self.dense_h_to_4h(x))
        return self.dense_4h_to_h(x)


def dropout_add(x, residual, prob, training):
    out = F.dropout(x, p=prob, training=training)
    return residual + out


class FalconDecoderLayer(nn.Layer):
    def __init__(self):
        super().__init__()
        self.num_heads = HEADS
        self.self_attention = FalconAttention()
        self.mlp = FalconMLP()
        self.hidden_dropout = 0.0
        self.input_layernorm = nn.LayerNorm(HIDDEN, epsilon=1e-5)

    def forward(self, hidden_states, attention_mask):
        residual = hidden_states
        attention_layernorm_out = self.input_layernorm(hidden_states)
        attention_output = self.self_attention(attention_layernorm_out, attention_mask)
        # parallel_attn: the MLP reads the same normalised input
        mlp_output = self.mlp(attention_layernorm_out)
        mlp_output += attention_output
        return dropout_add(mlp_output, residual, self.hidden_dropout, training=self.training)


def _make_causal_mask(input_ids_shape, past_key_values_length):
    """Make causal mask used for self-attention. This mask does not take the existing attention
    mask into account - it just blocks tokens from attending forwards in the sequence. The output
    shape will be `[batch_size, 1, target_length, target_length+past_key_values_length]`."""
    batch_size, target_length = input_ids_shape
    mask = paddle.triu(paddle.ones([target_length, target_length + past_key_values_length]), diagonal=1).astype("bool")
    expanded_mask = mask[None, None, :, :]
    return expanded_mask.expand([batch_size, 1, target_length, target_length + past_key_values_length])


class FalconModel(nn.Layer):
    def __init__(self):
        super().__init__()
        self.word_embeddings = nn.Embedding(VOCAB, HIDDEN)
        self.h = nn.LayerList([FalconDecoderLayer() for _ in range(LAYERS)])
        self.ln_f = nn.LayerNorm(HIDDEN, epsilon=1e-5)

    def forward(self, input_ids):
        batch_size, seq_length = input_ids.shape
        inputs_embeds = self.word_embeddings(input_ids)
        causal_mask = _make_causal_mask([batch_size, seq_length], 0)
        hidden_states = inputs_embeds
        for block in self.h:
            hidden_states = block(hidden_states, causal_mask)
        return self.ln_f(hidden_states)


class FalconForCausalLM(nn.Layer):
    def __init__(self):
        super().__init__()
        self.transformer = FalconModel()

    def forward(self, input_ids):
        hidden_states = self.transformer(input_ids)
        # tie_word_embeddings: lm_head reads the word embeddings' [vocab, hidden] table
        return paddle.matmul(hidden_states, self.transformer.word_embeddings.weight, transpose_y=True)


def build_model():
    return FalconForCausalLM()


def input_spec():
    return [paddle.static.InputSpec([2, 8], "int64", "input_ids")]


def logits_loss(logits, labels):
    """Falcon's loss from the logits (a pipeline's ``loss_fn``)."""
    return F.cross_entropy(logits.reshape([-1, VOCAB]), labels.reshape([-1]))


def loss(model, tokens, labels):
    return logits_loss(model(tokens), labels)
