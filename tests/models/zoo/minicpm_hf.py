"""MiniCPM as HuggingFace transformers writes it (src/transformers/models/minicpm/
modeling_minicpm.py), ported to Paddle at a small config.

A Llama with muP scaling: the token embedding is a ``MiniCPMScaledWordEmbedding`` (an
``nn.Embedding`` subclass multiplying its lookup by an ``embed_scale`` buffer, ``scale_emb``),
each residual branch is scaled by ``scale_depth / sqrt(num_hidden_layers)``, and the final
hidden state is divided by ``logits_scaling`` (``hidden_size / dim_model_base``) before the LM
head. Attention: separate ``q_proj``, ``k_proj``, ``v_proj``, grouped-query (2 KV heads of 4),
``.view(hidden_shape).transpose(1, 2)``, rotary embedding from the model's rotary layer passed
in as ``position_embeddings``, the module-level ``eager_attention_forward(self, ...)`` reading
``module.num_key_value_groups`` (``repeat_kv``), an additive causal mask, ``o_proj``. MLP:
SiLU-gated ``gate_proj``/``up_proj``, ``down_proj``. RMSNorm before each sub-layer, computed in
float32. Sizes: batch 3, sequence 7, 4 heads of 10, width 40: no two equal.
"""

import math

import paddle
import paddle.nn as nn
import paddle.nn.functional as F

VOCAB, SEQ = 96, 7


class MiniCPMConfig:
    vocab_size = VOCAB
    hidden_size = 40
    intermediate_size = 72
    num_hidden_layers = 2
    num_attention_heads = 4
    num_key_value_heads = 2
    hidden_act = "silu"
    rms_norm_eps = 1e-6
    rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
    attention_bias = False
    mlp_bias = False
    attention_dropout = 0.0
    pad_token_id = None
    scale_emb = 12.0
    dim_model_base = 16
    scale_depth = 1.4

    @property
    def logits_scaling(self):
        return self.hidden_size / self.dim_model_base


class MiniCPMScaledWordEmbedding(nn.Embedding):
    """This module overrides nn.Embeddings' forward by multiplying with embeddings scale."""

    def __init__(self, num_embeddings, embedding_dim, padding_idx, embed_scale=1.0):
        super().__init__(num_embeddings, embedding_dim, padding_idx)
        self.scalar_embed_scale = embed_scale
        self.register_buffer("embed_scale", paddle.to_tensor(embed_scale), persistable=False)

    def forward(self, input_ids):
        return super().forward(input_ids) * self.embed_scale.astype(self.weight.dtype)


class MiniCPMRMSNorm(nn.Layer):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = self.create_parameter([hidden_size], default_initializer=nn.initializer.Constant(1.0))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.astype("float32")
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * paddle.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.astype(input_dtype)


class MiniCPMRotaryEmbedding(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.config = config
        inv_freq, self.attention_scaling = self.compute_default_rope_parameters(config)
        self.register_buffer("inv_freq", inv_freq, persistable=False)

    @staticmethod
    def compute_default_rope_parameters(config):
        base = config.rope_parameters["rope_theta"]
        dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        attention_factor = 1.0
        inv_freq = 1.0 / (base ** (paddle.arange(0, dim, 2, dtype="float32") / dim))
        return inv_freq, attention_factor

    @paddle.no_grad()
    def forward(self, x, position_ids):
        inv_freq_expanded = self.inv_freq[None, :, None].expand([position_ids.shape[0], -1, 1]).astype("float32")
        position_ids_expanded = position_ids[:, None, :].astype("float32")
        freqs = (inv_freq_expanded @ position_ids_expanded).transpose([0, 2, 1])
        emb = paddle.concat((freqs, freqs), axis=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos, sin


class MiniCPMMLP(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.hidden_size = config.hidden_size
        self.intermediate_size = config.intermediate_size
        self.gate_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias_attr=config.mlp_bias)
        self.up_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias_attr=config.mlp_bias)
        self.down_proj = nn.Linear(self.intermediate_size, self.hidden_size, bias_attr=config.mlp_bias)
        self.act_fn = F.silu

    def forward(self, x):
        down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
        return down_proj


def rotate_half(x):
    """Rotates half the hidden dims of the input."""
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return paddle.concat((-x2, x1), axis=-1)


def repeat_kv(hidden_states, n_rep):
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand([batch, num_key_value_heads, n_rep, slen, head_dim])
    return hidden_states.reshape([batch, num_key_value_heads * n_rep, slen, head_dim])


def eager_attention_forward(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    key_states = repeat_kv(key, module.num_key_value_groups)
    value_states = repeat_kv(value, module.num_key_value_groups)

    attn_weights = paddle.matmul(query, key_states.transpose([0, 1, 3, 2])) * scaling
    if attention_mask is not None:
        attn_weights = attn_weights + attention_mask

    attn_weights = F.softmax(attn_weights, axis=-1, dtype="float32").astype(query.dtype)
    attn_weights = F.dropout(attn_weights, p=dropout, training=module.training)
    attn_output = paddle.matmul(attn_weights, value_states)
    attn_output = attn_output.transpose([0, 2, 1, 3])

    return attn_output, attn_weights


def apply_rotary_pos_emb(query, key, cos, sin, unsqueeze_dim=1):
    """Apply rotary embeddings in float32 and restore the query and key dtypes."""
    query_dtype, key_dtype = query.dtype, key.dtype
    query, key = query.astype("float32"), key.astype("float32")
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    query = (query * cos) + (rotate_half(query) * sin)
    key = (key * cos) + (rotate_half(key) * sin)
    return query.astype(query_dtype), key.astype(key_dtype)


class MiniCPMAttention(nn.Layer):
    """Multi-headed attention from 'Attention Is All You Need' paper"""

    def __init__(self, config, layer_idx):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = getattr(config, "head_dim", config.hidden_size // config.num_attention_heads)
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = True

        self.q_proj = nn.Linear(
            config.hidden_size, config.num_attention_heads * self.head_dim, bias_attr=config.attention_bias
        )
        self.k_proj = nn.Linear(
            config.hidden_size, config.num_key_value_heads * self.head_dim, bias_attr=config.attention_bias
        )
        self.v_proj = nn.Linear(
            config.hidden_size, config.num_key_value_heads * self.head_dim, bias_attr=config.attention_bias
        )
        self.o_proj = nn.Linear(
            config.num_attention_heads * self.head_dim, config.hidden_size, bias_attr=config.attention_bias
        )

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)

        query_states = self.q_proj(hidden_states).reshape(hidden_shape).transpose([0, 2, 1, 3])
        key_states = self.k_proj(hidden_states).reshape(hidden_shape).transpose([0, 2, 1, 3])
        value_states = self.v_proj(hidden_states).reshape(hidden_shape).transpose([0, 2, 1, 3])

        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)

        attn_output, attn_weights = eager_attention_forward(
            self,
            query_states,
            key_states,
            value_states,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
        )

        attn_output = attn_output.reshape([*input_shape, -1])
        attn_output = self.o_proj(attn_output)
        return attn_output, attn_weights


class MiniCPMDecoderLayer(nn.Layer):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.self_attn = MiniCPMAttention(config=config, layer_idx=layer_idx)
        self.mlp = MiniCPMMLP(config)
        self.input_layernorm = MiniCPMRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = MiniCPMRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.residual_scale = config.scale_depth / math.sqrt(config.num_hidden_layers)

    def forward(self, hidden_states, attention_mask=None, position_ids=None, position_embeddings=None, **kwargs):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, _ = self.self_attn(
            hidden_states=hidden_states,
            attention_mask=attention_mask,
            position_embeddings=position_embeddings,
        )
        hidden_states = residual + hidden_states * self.residual_scale

        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        hidden_states = residual + hidden_states * self.residual_scale
        return hidden_states


class MiniCPMModel(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = MiniCPMScaledWordEmbedding(
            config.vocab_size, config.hidden_size, self.padding_idx, embed_scale=config.scale_emb
        )
        self.layers = nn.LayerList(
            [MiniCPMDecoderLayer(config, layer_idx) for layer_idx in range(config.num_hidden_layers)]
        )
        self.norm = MiniCPMRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = MiniCPMRotaryEmbedding(config=config)

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None):
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)

        if position_ids is None:
            position_ids = paddle.arange(inputs_embeds.shape[1]).unsqueeze(0)

        seq_length = inputs_embeds.shape[1]
        min_value = paddle.finfo(inputs_embeds.dtype).min
        causal_mask = paddle.triu(paddle.full([seq_length, seq_length], min_value, inputs_embeds.dtype), diagonal=1)
        causal_mask = causal_mask[None, None, :, :]

        hidden_states = inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids=position_ids)

        for decoder_layer in self.layers[: self.config.num_hidden_layers]:
            hidden_states = decoder_layer(
                hidden_states,
                attention_mask=causal_mask,
                position_embeddings=position_embeddings,
                position_ids=position_ids,
            )

        return self.norm(hidden_states)


class MiniCPMForCausalLM(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = MiniCPMModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias_attr=False)

    def forward(self, input_ids=None, labels=None):
        hidden_states = self.model(input_ids=input_ids)
        hidden_states = hidden_states / self.config.logits_scaling
        logits = self.lm_head(hidden_states).astype("float32")
        if labels is None:
            return logits
        return F.cross_entropy(logits.reshape([-1, self.vocab_size]), labels.reshape([-1]))


def build_model():
    return MiniCPMForCausalLM(MiniCPMConfig())


def input_spec():
    return [paddle.static.InputSpec([3, SEQ], "int64", "input_ids")]


def loss(model, tokens, labels):
    return model(input_ids=tokens, labels=labels)
