"""A Qwen2-style decoder as HuggingFace writes it with the SDPA attention class: q/k/v
projections with bias, o_proj without, grouped-query attention with ``repeat_interleave``,
rotary embedding from a ``Qwen2RotaryEmbedding`` (``rotate_half``), and
``F.scaled_dot_product_attention(..., is_causal=True)``; SwiGLU MLP; untied LM head.

    >>> model = build_model()
    >>> model(paddle.randint(0, VOCAB, [2, 8])).shape
    [2, 8, 64]
"""

import paddle
import paddle.nn as nn
import paddle.nn.functional as F

VOCAB, HIDDEN, INTER, LAYERS, HEADS, KV_HEADS, MAX_POS = 64, 32, 64, 2, 4, 2, 64


class Qwen2RMSNorm(nn.Layer):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = self.create_parameter([hidden_size], default_initializer=nn.initializer.Constant(1.0))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.astype("float32").pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * paddle.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states


class Qwen2RotaryEmbedding(nn.Layer):
    def __init__(self, dim, base=10000.0):
        super().__init__()
        inv_freq = 1.0 / (base ** (paddle.arange(0, dim, 2, dtype="float32") / dim))
        self.register_buffer("inv_freq", inv_freq, persistable=False)

    def forward(self, x, position_ids):
        freqs = position_ids.astype("float32").unsqueeze(-1) * self.inv_freq.unsqueeze(0).unsqueeze(0)
        emb = paddle.concat([freqs, freqs], axis=-1)
        return emb.cos().astype(x.dtype), emb.sin().astype(x.dtype)


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return paddle.concat([-x2, x1], axis=-1)


def apply_rotary_pos_emb(q, k, cos, sin):
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)  # [b, s, 1, d]: heads on axis 2 for SDPA
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


class Qwen2Attention(nn.Layer):
    def __init__(self):
        super().__init__()
        self.head_dim = HIDDEN // HEADS
        self.num_key_value_groups = HEADS // KV_HEADS
        self.q_proj = nn.Linear(HIDDEN, HEADS * self.head_dim)
        self.k_proj = nn.Linear(HIDDEN, KV_HEADS * self.head_dim)
        self.v_proj = nn.Linear(HIDDEN, KV_HEADS * self.head_dim)
        self.o_proj = nn.Linear(HEADS * self.head_dim, HIDDEN, bias_attr=False)

    def forward(self, hidden_states, position_embeddings):
        bsz, q_len, _ = hidden_states.shape
        q = self.q_proj(hidden_states).reshape([bsz, q_len, -1, self.head_dim])
        k = self.k_proj(hidden_states).reshape([bsz, q_len, -1, self.head_dim])
        v = self.v_proj(hidden_states).reshape([bsz, q_len, -1, self.head_dim])
        cos, sin = position_embeddings
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        k = paddle.repeat_interleave(k, self.num_key_value_groups, axis=2)
        v = paddle.repeat_interleave(v, self.num_key_value_groups, axis=2)
        attn_output = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(attn_output.reshape([bsz, q_len, -1]))


class Qwen2MLP(nn.Layer):
    def __init__(self):
        super().__init__()
        self.gate_proj = nn.Linear(HIDDEN, INTER, bias_attr=False)
        self.up_proj = nn.Linear(HIDDEN, INTER, bias_attr=False)
        self.down_proj = nn.Linear(INTER, HIDDEN, bias_attr=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Qwen2DecoderLayer(nn.Layer):
    def __init__(self):
        super().__init__()
        self.self_attn = Qwen2Attention()
        self.mlp = Qwen2MLP()
        self.input_layernorm = Qwen2RMSNorm(HIDDEN)
        self.post_attention_layernorm = Qwen2RMSNorm(HIDDEN)

    def forward(self, hidden_states, position_embeddings):
        residual = hidden_states
        hidden_states = residual + self.self_attn(self.input_layernorm(hidden_states), position_embeddings)
        residual = hidden_states
        return residual + self.mlp(self.post_attention_layernorm(hidden_states))


class Qwen2Model(nn.Layer):
    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.LayerList([Qwen2DecoderLayer() for _ in range(LAYERS)])
        self.norm = Qwen2RMSNorm(HIDDEN)
        self.rotary_emb = Qwen2RotaryEmbedding(HIDDEN // HEADS)

    def forward(self, input_ids):
        hidden_states = self.embed_tokens(input_ids)
        position_ids = paddle.arange(input_ids.shape[1]).unsqueeze(0)
        position_embeddings = self.rotary_emb(hidden_states, position_ids)
        for decoder_layer in self.layers:
            hidden_states = decoder_layer(hidden_states, position_embeddings)
        return self.norm(hidden_states)


class Qwen2ForCausalLM(nn.Layer):
    def __init__(self):
        super().__init__()
        self.model = Qwen2Model()
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias_attr=False)

    def forward(self, input_ids):
        return self.lm_head(self.model(input_ids))


def build_model():
    return Qwen2ForCausalLM()


def input_spec():
    return [paddle.static.InputSpec([2, 8], "int64", "input_ids")]


def loss(model, tokens, labels):
    return F.cross_entropy(model(tokens).reshape([-1, VOCAB]), labels.reshape([-1]))
