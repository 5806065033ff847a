"""Llama as HuggingFace wrote it before transformers 4.38: each attention owns a
``LlamaRotaryEmbedding`` whose cos/sin cache is built by ``_set_cos_sin_cache``, which registers
the buffers again from ``forward`` whenever a longer sequence comes (the cache grows on demand).
Here the configured ``max_position_embeddings`` is shorter than the sequences, so every forward
re-registers them. ``rotate_half`` and ``apply_rotary_pos_emb`` are module functions.

    >>> model = build_model()
    >>> list(model(paddle.randint(0, VOCAB, [2, 9])).shape)
    [2, 9, 96]
"""

import math

import paddle
import paddle.nn as nn
import paddle.nn.functional as F

VOCAB, HIDDEN, LAYERS, HEADS, KV_HEADS, INTERMEDIATE, MAX_POSITIONS = 96, 48, 2, 4, 2, 80, 4


class LlamaRMSNorm(nn.Layer):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = self.create_parameter([hidden_size], default_initializer=nn.initializer.Constant(1.0))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.astype("float32").pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * paddle.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states


class LlamaRotaryEmbedding(nn.Layer):
    def __init__(self, dim, max_position_embeddings=2048, base=10000):
        super().__init__()
        self.dim = dim
        self.max_position_embeddings = max_position_embeddings
        self.base = base
        inv_freq = 1.0 / (self.base ** (paddle.arange(0, self.dim, 2).astype("float32") / self.dim))
        self.register_buffer("inv_freq", inv_freq, persistable=False)
        self._set_cos_sin_cache(seq_len=max_position_embeddings)

    def _set_cos_sin_cache(self, seq_len):
        self.max_seq_len_cached = seq_len
        t = paddle.arange(self.max_seq_len_cached, dtype="float32")
        freqs = paddle.outer(t, self.inv_freq)
        emb = paddle.concat((freqs, freqs), axis=-1)
        self.register_buffer("cos_cached", emb.cos(), persistable=False)
        self.register_buffer("sin_cached", emb.sin(), persistable=False)

    def forward(self, x, seq_len=None):
        if seq_len > self.max_seq_len_cached:
            self._set_cos_sin_cache(seq_len=seq_len)
        return self.cos_cached[:seq_len].astype(x.dtype), self.sin_cached[:seq_len].astype(x.dtype)


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return paddle.concat((-x2, x1), axis=-1)


def apply_rotary_pos_emb(q, k, cos, sin, position_ids):
    cos = cos[position_ids].unsqueeze(1)
    sin = sin[position_ids].unsqueeze(1)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


def repeat_kv(hidden_states, n_rep):
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand([batch, num_key_value_heads, n_rep, slen, head_dim])
    return hidden_states.reshape([batch, num_key_value_heads * n_rep, slen, head_dim])


class LlamaAttention(nn.Layer):
    def __init__(self):
        super().__init__()
        self.num_heads, self.num_key_value_heads = HEADS, KV_HEADS
        self.head_dim = HIDDEN // HEADS
        self.num_key_value_groups = HEADS // KV_HEADS
        self.q_proj = nn.Linear(HIDDEN, HEADS * self.head_dim, bias_attr=False)
        self.k_proj = nn.Linear(HIDDEN, KV_HEADS * self.head_dim, bias_attr=False)
        self.v_proj = nn.Linear(HIDDEN, KV_HEADS * self.head_dim, bias_attr=False)
        self.o_proj = nn.Linear(HEADS * self.head_dim, HIDDEN, bias_attr=False)
        self.rotary_emb = LlamaRotaryEmbedding(self.head_dim, max_position_embeddings=MAX_POSITIONS)

    def forward(self, hidden_states, attention_mask, position_ids):
        bsz, q_len, _ = hidden_states.shape
        query_states = self.q_proj(hidden_states).reshape([bsz, q_len, self.num_heads, self.head_dim])
        key_states = self.k_proj(hidden_states).reshape([bsz, q_len, self.num_key_value_heads, self.head_dim])
        value_states = self.v_proj(hidden_states).reshape([bsz, q_len, self.num_key_value_heads, self.head_dim])
        query_states = query_states.transpose([0, 2, 1, 3])
        key_states = key_states.transpose([0, 2, 1, 3])
        value_states = value_states.transpose([0, 2, 1, 3])
        cos, sin = self.rotary_emb(value_states, seq_len=q_len)
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin, position_ids)
        key_states = repeat_kv(key_states, self.num_key_value_groups)
        value_states = repeat_kv(value_states, self.num_key_value_groups)
        attn_weights = paddle.matmul(query_states, key_states.transpose([0, 1, 3, 2])) / math.sqrt(self.head_dim)
        attn_weights = attn_weights + attention_mask
        attn_weights = F.softmax(attn_weights.astype("float32"), axis=-1).astype(query_states.dtype)
        attn_output = paddle.matmul(attn_weights, value_states)
        attn_output = attn_output.transpose([0, 2, 1, 3]).reshape([bsz, q_len, HIDDEN])
        return self.o_proj(attn_output)


class LlamaMLP(nn.Layer):
    def __init__(self):
        super().__init__()
        self.gate_proj = nn.Linear(HIDDEN, INTERMEDIATE, bias_attr=False)
        self.up_proj = nn.Linear(HIDDEN, INTERMEDIATE, bias_attr=False)
        self.down_proj = nn.Linear(INTERMEDIATE, HIDDEN, bias_attr=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Layer):
    def __init__(self):
        super().__init__()
        self.self_attn = LlamaAttention()
        self.mlp = LlamaMLP()
        self.input_layernorm = LlamaRMSNorm(HIDDEN)
        self.post_attention_layernorm = LlamaRMSNorm(HIDDEN)

    def forward(self, hidden_states, attention_mask, position_ids):
        residual = hidden_states
        hidden_states = self.self_attn(self.input_layernorm(hidden_states), attention_mask, position_ids)
        hidden_states = residual + hidden_states
        residual = hidden_states
        return residual + self.mlp(self.post_attention_layernorm(hidden_states))


class LlamaModel(nn.Layer):
    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.LayerList([LlamaDecoderLayer() for _ in range(LAYERS)])
        self.norm = LlamaRMSNorm(HIDDEN)

    def forward(self, input_ids):
        batch_size, seq_length = input_ids.shape
        position_ids = paddle.arange(seq_length, dtype="int64").unsqueeze(0).expand([batch_size, seq_length])
        causal = paddle.triu(paddle.full([seq_length, seq_length], float("-inf")), diagonal=1)
        attention_mask = causal[None, None, :, :].expand([batch_size, 1, seq_length, seq_length])
        hidden_states = self.embed_tokens(input_ids)
        for decoder_layer in self.layers:
            hidden_states = decoder_layer(hidden_states, attention_mask, position_ids)
        return self.norm(hidden_states)


class LlamaForCausalLM(nn.Layer):
    def __init__(self):
        super().__init__()
        self.model = LlamaModel()
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias_attr=False)

    def forward(self, input_ids):
        return self.lm_head(self.model(input_ids)).astype("float32")


def build_model():
    return LlamaForCausalLM()


def input_spec():
    return [paddle.static.InputSpec([2, 10], "int64", "input_ids")]


def loss(model, tokens, labels):
    return F.cross_entropy(model(tokens).reshape([-1, VOCAB]), labels.reshape([-1]))
