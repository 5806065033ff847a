"""Granite as HuggingFace transformers writes it (src/transformers/models/granite/
modeling_granite.py), ported to Paddle at a small config.

A Llama with IBM's four multipliers: the embeddings scaled by ``embedding_multiplier``, the
attention scores by ``attention_multiplier`` (in place of ``1/sqrt(head_dim)``), each residual
branch by ``residual_multiplier``, and the logits divided by ``logits_scaling``. Attention:
separate ``q_proj``, ``k_proj``, ``v_proj``, grouped-query (``num_key_value_heads`` 2 of 4,
``repeat_kv``), rotary embedding from the model's rotary layer passed in as
``position_embeddings``, eager attention with an additive causal mask, ``o_proj``. MLP:
SiLU-gated ``gate_proj``/``up_proj``, ``down_proj``. RMSNorm before each sub-layer, the LM head
untied.
"""

import paddle
import paddle.nn as nn
import paddle.nn.functional as F

VOCAB, SEQ = 96, 12


class GraniteConfig:
    vocab_size = VOCAB
    hidden_size = 40
    intermediate_size = 72
    num_hidden_layers = 2
    num_attention_heads = 4
    num_key_value_heads = 2
    rms_norm_eps = 1e-6
    rope_theta = 10000.0
    embedding_multiplier = 12.0
    attention_multiplier = 0.0625
    residual_multiplier = 0.22
    logits_scaling = 8.0


class GraniteRMSNorm(nn.Layer):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = self.create_parameter([hidden_size], default_initializer=nn.initializer.Constant(1.0))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * paddle.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states


class GraniteRotaryEmbedding(nn.Layer):
    def __init__(self, config):
        super().__init__()
        dim = config.hidden_size // config.num_attention_heads
        inv_freq = 1.0 / (config.rope_theta ** (paddle.arange(0, dim, 2, dtype="float32") / dim))
        self.register_buffer("inv_freq", inv_freq, persistable=False)

    def forward(self, x, position_ids):
        freqs = position_ids.astype("float32").unsqueeze(-1) * self.inv_freq
        emb = paddle.concat([freqs, freqs], axis=-1)
        return emb.cos().astype(x.dtype), emb.sin().astype(x.dtype)


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return paddle.concat([-x2, x1], axis=-1)


def apply_rotary_pos_emb(q, k, cos, sin):
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


def repeat_kv(hidden_states, n_rep):
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand([batch, num_key_value_heads, n_rep, slen, head_dim])
    return hidden_states.reshape([batch, num_key_value_heads * n_rep, slen, head_dim])


class GraniteAttention(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = config.attention_multiplier
        self.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * self.head_dim, bias_attr=False)
        self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias_attr=False)
        self.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias_attr=False)
        self.o_proj = nn.Linear(config.num_attention_heads * self.head_dim, config.hidden_size, bias_attr=False)

    def forward(self, hidden_states, position_embeddings, attention_mask):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query_states = self.q_proj(hidden_states).reshape(hidden_shape).transpose([0, 2, 1, 3])
        key_states = self.k_proj(hidden_states).reshape(hidden_shape).transpose([0, 2, 1, 3])
        value_states = self.v_proj(hidden_states).reshape(hidden_shape).transpose([0, 2, 1, 3])
        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
        key_states = repeat_kv(key_states, self.num_key_value_groups)
        value_states = repeat_kv(value_states, self.num_key_value_groups)
        attn_weights = paddle.matmul(query_states, key_states.transpose([0, 1, 3, 2])) * self.scaling
        attn_weights = attn_weights + attention_mask
        attn_weights = F.softmax(attn_weights, axis=-1)
        attn_output = paddle.matmul(attn_weights, value_states).transpose([0, 2, 1, 3])
        attn_output = attn_output.reshape([*input_shape, -1])
        return self.o_proj(attn_output)


class GraniteMLP(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias_attr=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias_attr=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias_attr=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class GraniteDecoderLayer(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.self_attn = GraniteAttention(config)
        self.mlp = GraniteMLP(config)
        self.input_layernorm = GraniteRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = GraniteRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.residual_multiplier = config.residual_multiplier

    def forward(self, hidden_states, attention_mask, position_embeddings):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states = self.self_attn(hidden_states, position_embeddings, attention_mask)
        hidden_states = residual + hidden_states * self.residual_multiplier
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        return residual + hidden_states * self.residual_multiplier


class GraniteModel(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.LayerList([GraniteDecoderLayer(config) for _ in range(config.num_hidden_layers)])
        self.norm = GraniteRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = GraniteRotaryEmbedding(config)
        self.embedding_multiplier = config.embedding_multiplier

    def forward(self, input_ids):
        inputs_embeds = self.embed_tokens(input_ids) * self.embedding_multiplier
        seq_length = input_ids.shape[1]
        position_ids = paddle.arange(seq_length, dtype="int64").unsqueeze(0)
        causal_mask = paddle.triu(paddle.full([seq_length, seq_length], float("-inf")), diagonal=1)
        causal_mask = causal_mask[None, None, :, :]
        position_embeddings = self.rotary_emb(inputs_embeds, position_ids)
        hidden_states = inputs_embeds
        for decoder_layer in self.layers:
            hidden_states = decoder_layer(hidden_states, causal_mask, position_embeddings)
        return self.norm(hidden_states)


class GraniteForCausalLM(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.model = GraniteModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias_attr=False)
        self.logits_scaling = config.logits_scaling

    def forward(self, input_ids):
        logits = self.lm_head(self.model(input_ids))
        return logits / self.logits_scaling


def build_model():
    return GraniteForCausalLM(GraniteConfig())


def input_spec():
    return [paddle.static.InputSpec([2, SEQ], "int64", "input_ids")]


def loss(model, tokens, labels):
    return F.cross_entropy(model(tokens).reshape([-1, VOCAB]), labels.reshape([-1]))
