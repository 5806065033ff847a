"""StableLM 2 as HuggingFace transformers writes it (src/transformers/models/stablelm/
modeling_stablelm.py), ported to Paddle at a small config.

Attention: separate ``q_proj``, ``k_proj``, ``v_proj`` with biases (``use_qkv_bias``, as
StableLM-2-1.6B), grouped-query (``num_key_value_heads`` 2 of 4 heads, ``repeat_kv``), partial
rotary embedding on the first ``int(partial_rotary_factor * head_dim)`` features of each head (a
quarter: 2 of 8), the rotated and the passed parts cut by slicing and concatenated back, cos and
sin from the model's rotary layer passed in as ``position_embeddings``; eager attention with an
additive causal mask, the output reshaped with ``self.hidden_size``. MLP: SiLU-gated
``gate_proj``/``up_proj``, ``down_proj``. LayerNorm (with bias) before each sub-layer, sequential
residuals (``use_parallel_residual`` off), the LM head untied. The per-head q/k LayerNorm of the
12B config (``qk_layernorm``) is off here, as in the 1.6B and 3B configs.

What differs from the torch code is spelling: ``reshape`` for ``view``, ``transpose`` with the
whole permutation, ``axis`` for ``dim``; the KV cache, SDPA and flash paths are left out.

    >>> model = build_model()
    >>> list(model(paddle.randint(0, VOCAB, [2, SEQ])).shape)
    [2, 16, 256]
"""

import math

import paddle
import paddle.nn as nn
import paddle.nn.functional as F

VOCAB, HIDDEN, INTER, LAYERS, HEADS, KV_HEADS, SEQ = 256, 32, 96, 2, 4, 2, 16


class StableLmConfig:
    vocab_size = VOCAB
    hidden_size = HIDDEN
    intermediate_size = INTER
    num_hidden_layers = LAYERS
    num_attention_heads = HEADS
    num_key_value_heads = KV_HEADS
    hidden_act = "silu"
    max_position_embeddings = 64
    layer_norm_eps = 1e-5
    rope_theta = 10000.0
    partial_rotary_factor = 0.25
    use_qkv_bias = True
    qk_layernorm = False
    use_parallel_residual = False
    hidden_dropout = 0.0
    attention_dropout = 0.0


class StableLmRotaryEmbedding(nn.Layer):
    def __init__(self, config):
        super().__init__()
        head_dim = config.hidden_size // config.num_attention_heads
        dim = int(config.partial_rotary_factor * head_dim)
        inv_freq = 1.0 / (config.rope_theta ** (paddle.arange(0, dim, 2, dtype="float32") / dim))
        self.register_buffer("inv_freq", inv_freq, persistable=False)

    def forward(self, x, position_ids):
        inv_freq_expanded = self.inv_freq[None, :, None].expand([position_ids.shape[0], -1, 1])
        position_ids_expanded = position_ids[:, None, :].astype("float32")
        freqs = paddle.matmul(inv_freq_expanded, position_ids_expanded).transpose([0, 2, 1])
        emb = paddle.concat((freqs, freqs), axis=-1)
        return emb.cos().astype(x.dtype), emb.sin().astype(x.dtype)


def rotate_half(x):
    """Rotates half the hidden dims of the input."""
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return paddle.concat((-x2, x1), axis=-1)


def apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed


class StableLmMLP(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.hidden_size = config.hidden_size
        self.intermediate_size = config.intermediate_size
        self.gate_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias_attr=False)
        self.up_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias_attr=False)
        self.down_proj = nn.Linear(self.intermediate_size, self.hidden_size, bias_attr=False)
        self.act_fn = F.silu

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def repeat_kv(hidden_states, n_rep):
    """(batch, num_key_value_heads, seqlen, head_dim) -> (batch, num_attention_heads, seqlen, head_dim)"""
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand([batch, num_key_value_heads, n_rep, slen, head_dim])
    return hidden_states.reshape([batch, num_key_value_heads * n_rep, slen, head_dim])


class StableLmAttention(nn.Layer):
    def __init__(self, config, layer_idx=None):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.hidden_size // self.num_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.rope_theta = config.rope_theta
        self.rotary_ndims = int(self.head_dim * config.partial_rotary_factor)
        self.is_causal = True
        self.q_proj = nn.Linear(self.hidden_size, self.num_heads * self.head_dim, bias_attr=config.use_qkv_bias)
        self.k_proj = nn.Linear(
            self.hidden_size, self.num_key_value_heads * self.head_dim, bias_attr=config.use_qkv_bias
        )
        self.v_proj = nn.Linear(
            self.hidden_size, self.num_key_value_heads * self.head_dim, bias_attr=config.use_qkv_bias
        )
        self.o_proj = nn.Linear(self.hidden_size, self.hidden_size, bias_attr=False)
        self.attention_dropout = nn.Dropout(config.attention_dropout)

    def forward(self, hidden_states, attention_mask=None, position_ids=None, position_embeddings=None):
        bsz, q_len, _ = hidden_states.shape

        query_states = self.q_proj(hidden_states)
        key_states = self.k_proj(hidden_states)
        value_states = self.v_proj(hidden_states)

        query_states = query_states.reshape([bsz, q_len, self.num_heads, self.head_dim]).transpose([0, 2, 1, 3])
        key_states = key_states.reshape([bsz, q_len, self.num_key_value_heads, self.head_dim]).transpose([0, 2, 1, 3])
        value_states = value_states.reshape([bsz, q_len, self.num_key_value_heads, self.head_dim]).transpose(
            [0, 2, 1, 3]
        )

        cos, sin = position_embeddings

        # Partial rotary embedding
        query_rot, query_pass = (query_states[..., : self.rotary_ndims], query_states[..., self.rotary_ndims :])
        key_rot, key_pass = (key_states[..., : self.rotary_ndims], key_states[..., self.rotary_ndims :])
        # [batch_size, seq_length, num_heads, head_dim // config.partial_rotary_factor]
        query_rot, key_rot = apply_rotary_pos_emb(query_rot, key_rot, cos, sin)

        # [batch_size, seq_length, num_heads, head_dim]
        query_states = paddle.concat((query_rot, query_pass), axis=-1)
        key_states = paddle.concat((key_rot, key_pass), axis=-1)

        # Repeat k/v heads if n_kv_heads < n_heads
        key_states = repeat_kv(key_states, self.num_key_value_groups)
        value_states = repeat_kv(value_states, self.num_key_value_groups)

        attn_weights = paddle.matmul(query_states, key_states.transpose([0, 1, 3, 2])) / math.sqrt(self.head_dim)
        if attention_mask is not None:  # no matter the length, we just slice it
            attn_weights = attn_weights + attention_mask

        # upcast attention to fp32
        attn_weights = F.softmax(attn_weights, axis=-1, dtype="float32").astype(query_states.dtype)
        attn_weights = self.attention_dropout(attn_weights)

        attn_output = paddle.matmul(attn_weights, value_states)
        attn_output = attn_output.transpose([0, 2, 1, 3])
        attn_output = attn_output.reshape([bsz, q_len, self.hidden_size])
        return self.o_proj(attn_output), None


class StableLmDecoderLayer(nn.Layer):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.use_parallel_residual = config.use_parallel_residual
        self.hidden_size = config.hidden_size
        self.self_attn = StableLmAttention(config, layer_idx=layer_idx)
        self.mlp = StableLmMLP(config)
        self.input_layernorm = nn.LayerNorm(config.hidden_size, epsilon=config.layer_norm_eps)
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size, epsilon=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout)

    def forward(self, hidden_states, attention_mask=None, position_ids=None, position_embeddings=None):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        self_attn_output, self_attn_weights = self.self_attn(
            hidden_states=hidden_states,
            attention_mask=attention_mask,
            position_ids=position_ids,
            position_embeddings=position_embeddings,
        )
        hidden_states = residual + self_attn_output
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        hidden_states = self.dropout(hidden_states)
        return hidden_states + residual


def causal_mask(inputs_embeds):
    seq = inputs_embeds.shape[1]
    full = paddle.full([seq, seq], float("-inf"), dtype=inputs_embeds.dtype)
    return paddle.triu(full, diagonal=1)[None, None, :, :]


class StableLmModel(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.LayerList([StableLmDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = nn.LayerNorm(config.hidden_size, epsilon=config.layer_norm_eps)
        self.rotary_emb = StableLmRotaryEmbedding(config=config)

    def forward(self, input_ids):
        inputs_embeds = self.embed_tokens(input_ids)
        position_ids = paddle.arange(0, inputs_embeds.shape[1]).unsqueeze(0)
        mask = causal_mask(inputs_embeds)
        hidden_states = inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids)
        for decoder_layer in self.layers:
            hidden_states = decoder_layer(
                hidden_states,
                attention_mask=mask,
                position_ids=position_ids,
                position_embeddings=position_embeddings,
            )
        return self.norm(hidden_states)


class StableLmForCausalLM(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.model = StableLmModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias_attr=False)

    def forward(self, input_ids):
        return self.lm_head(self.model(input_ids))


def build_model():
    return StableLmForCausalLM(StableLmConfig())


def input_spec():
    return [paddle.static.InputSpec([2, SEQ], "int64", "input_ids")]


def loss(model, tokens, labels):
    return F.cross_entropy(model(tokens).reshape([-1, VOCAB]), labels.reshape([-1]))
