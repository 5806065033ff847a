"""Phi-1.5 / Phi-2 as HuggingFace transformers writes it (src/transformers/models/phi/
modeling_phi.py, the modular-generated file), ported to Paddle at a small config.

Attention: separate ``q_proj``, ``k_proj``, ``v_proj`` with biases, reshaped with ``-1`` heads
from the input's shape; partial rotary embedding on the first ``int(partial_rotary_factor *
head_dim)`` features of each head (Phi-2's factor 0.4: 8 of 20), the rotated and the passed parts
cut by slicing and concatenated back, cos and sin from the model's rotary layer passed in as
``position_embeddings``; ``eager_attention_forward`` (``repeat_kv`` with as many KV heads as heads)
with an additive causal mask, the output projection named ``dense`` (with a bias). MLP: ``fc1``,
``gelu_new`` (GELU, tanh approximation), ``fc2``, both biased. The decoder layer is a parallel
block: attention and MLP both read one ``input_layernorm``'s output, and their outputs are summed
with the residual (through ``resid_dropout``). A ``final_layernorm``, and an ``lm_head`` with a
bias, untied. ``qk_layernorm`` is off, as in Phi-1.5 and Phi-2.

What differs from the torch code is spelling: ``reshape`` for ``view``, ``transpose`` with the
whole permutation, ``axis`` for ``dim``; the KV cache, SDPA and flash paths and the padding mask
are left out.

    >>> model = build_model()
    >>> list(model(paddle.randint(0, VOCAB, [2, SEQ])).shape)
    [2, 16, 128]
"""

import paddle
import paddle.nn as nn
import paddle.nn.functional as F

# head_dim 20, its rotary part 8: no two sizes of the model (or of the batch) coincide
VOCAB, HIDDEN, INTER, LAYERS, HEADS, SEQ = 128, 80, 320, 2, 4, 16


class PhiConfig:
    vocab_size = VOCAB
    hidden_size = HIDDEN
    intermediate_size = INTER
    num_hidden_layers = LAYERS
    num_attention_heads = HEADS
    num_key_value_heads = HEADS
    resid_pdrop = 0.0
    embd_pdrop = 0.0
    attention_dropout = 0.0
    hidden_act = "gelu_new"
    max_position_embeddings = 64
    layer_norm_eps = 1e-5
    rope_theta = 10000.0
    partial_rotary_factor = 0.4
    qk_layernorm = False


ACT2FN = {"gelu_new": lambda x: F.gelu(x, approximate=True)}


class PhiRotaryEmbedding(nn.Layer):
    def __init__(self, config):
        super().__init__()
        head_dim = config.hidden_size // config.num_attention_heads
        dim = int(head_dim * config.partial_rotary_factor)
        inv_freq = 1.0 / (config.rope_theta ** (paddle.arange(0, dim, 2, dtype="float32") / dim))
        self.register_buffer("inv_freq", inv_freq, persistable=False)
        self.attention_scaling = 1.0

    def forward(self, x, position_ids):
        inv_freq_expanded = self.inv_freq[None, :, None].astype("float32").expand([position_ids.shape[0], -1, 1])
        position_ids_expanded = position_ids[:, None, :].astype("float32")
        freqs = paddle.matmul(inv_freq_expanded, position_ids_expanded).transpose([0, 2, 1])
        emb = paddle.concat((freqs, freqs), axis=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.astype(x.dtype), sin.astype(x.dtype)


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


def repeat_kv(hidden_states, n_rep):
    """(batch, num_key_value_heads, seqlen, head_dim) -> (batch, num_attention_heads, seqlen, head_dim)"""
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand([batch, num_key_value_heads, n_rep, slen, head_dim])
    return hidden_states.reshape([batch, num_key_value_heads * n_rep, slen, head_dim])


def eager_attention_forward(module, query, key, value, attention_mask, scaling, dropout=0.0):
    key_states = repeat_kv(key, module.num_key_value_groups)
    value_states = repeat_kv(value, module.num_key_value_groups)

    attn_weights = paddle.matmul(query, key_states.transpose([0, 1, 3, 2])) * scaling
    if attention_mask is not None:
        causal_mask = attention_mask[:, :, :, : key_states.shape[-2]]
        attn_weights = attn_weights + causal_mask

    attn_weights = F.softmax(attn_weights, axis=-1, dtype="float32").astype(query.dtype)
    attn_weights = F.dropout(attn_weights, p=dropout, training=module.training)
    attn_output = paddle.matmul(attn_weights, value_states)
    attn_output = attn_output.transpose([0, 2, 1, 3])

    return attn_output, attn_weights


class PhiAttention(nn.Layer):
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
        self.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * self.head_dim)
        self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim)
        self.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim)
        self.dense = nn.Linear(config.num_attention_heads * self.head_dim, config.hidden_size)
        self.rotary_ndims = int(self.head_dim * config.partial_rotary_factor)
        self.qk_layernorm = config.qk_layernorm
        if self.qk_layernorm:
            self.q_layernorm = nn.LayerNorm(self.head_dim, epsilon=config.layer_norm_eps)
            self.k_layernorm = nn.LayerNorm(self.head_dim, epsilon=config.layer_norm_eps)

    def forward(self, hidden_states, position_embeddings, attention_mask=None):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)

        query_states = self.q_proj(hidden_states).reshape(hidden_shape).transpose([0, 2, 1, 3])
        key_states = self.k_proj(hidden_states).reshape(hidden_shape).transpose([0, 2, 1, 3])
        value_states = self.v_proj(hidden_states).reshape(hidden_shape).transpose([0, 2, 1, 3])

        if self.qk_layernorm:
            query_states = self.q_layernorm(query_states)
            key_states = self.k_layernorm(key_states)

        cos, sin = position_embeddings
        # Partial rotary embedding
        query_rot, query_pass = (query_states[..., : self.rotary_ndims], query_states[..., self.rotary_ndims :])
        key_rot, key_pass = (key_states[..., : self.rotary_ndims], key_states[..., self.rotary_ndims :])
        # [batch_size, seq_length, num_heads, head_dim // config.partial_rotary_factor]
        query_rot, key_rot = apply_rotary_pos_emb(query_rot, key_rot, cos, sin)

        # [batch_size, seq_length, num_heads, head_dim]
        query_states = paddle.concat((query_rot, query_pass), axis=-1)
        key_states = paddle.concat((key_rot, key_pass), axis=-1)

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
        attn_output = self.dense(attn_output)
        return attn_output, attn_weights


class PhiMLP(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.activation_fn = ACT2FN[config.hidden_act]
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, hidden_states):
        hidden_states = self.fc1(hidden_states)
        hidden_states = self.activation_fn(hidden_states)
        hidden_states = self.fc2(hidden_states)
        return hidden_states


class PhiDecoderLayer(nn.Layer):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = PhiAttention(config, layer_idx=layer_idx)
        self.mlp = PhiMLP(config)
        self.input_layernorm = nn.LayerNorm(config.hidden_size, epsilon=config.layer_norm_eps)
        self.resid_dropout = nn.Dropout(config.resid_pdrop)

    def forward(self, hidden_states, attention_mask=None, position_embeddings=None):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)

        attn_outputs, self_attn_weights = self.self_attn(
            hidden_states=hidden_states,
            attention_mask=attention_mask,
            position_embeddings=position_embeddings,
        )
        attn_outputs = self.resid_dropout(attn_outputs)

        feed_forward_hidden_states = self.resid_dropout(self.mlp(hidden_states))
        hidden_states = attn_outputs + feed_forward_hidden_states + residual
        return hidden_states


def create_causal_mask(input_embeds):
    """What transformers' masking_utils gives eager attention without padding: a
    ``[batch, 1, q, kv]`` float mask, 0 where a query may attend and the dtype's minimum above
    the diagonal."""
    batch, seq = input_embeds.shape[0], input_embeds.shape[1]
    min_value = paddle.finfo(input_embeds.dtype).min
    mask = paddle.triu(paddle.full([seq, seq], min_value, dtype=input_embeds.dtype), diagonal=1)
    return mask[None, None].expand([batch, 1, seq, seq])


class PhiModel(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.LayerList(
            [PhiDecoderLayer(config, layer_idx) for layer_idx in range(config.num_hidden_layers)]
        )
        self.rotary_emb = PhiRotaryEmbedding(config=config)
        self.embed_dropout = nn.Dropout(config.embd_pdrop)
        self.final_layernorm = nn.LayerNorm(config.hidden_size, epsilon=config.layer_norm_eps)

    def forward(self, input_ids):
        inputs_embeds = self.embed_tokens(input_ids)
        cache_position = paddle.arange(0, inputs_embeds.shape[1])
        position_ids = cache_position.unsqueeze(0)
        causal_mask = create_causal_mask(inputs_embeds)

        inputs_embeds = self.embed_dropout(inputs_embeds)
        hidden_states = inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids)

        for decoder_layer in self.layers[: self.config.num_hidden_layers]:
            hidden_states = decoder_layer(
                hidden_states, attention_mask=causal_mask, position_embeddings=position_embeddings
            )
        hidden_states = self.final_layernorm(hidden_states)
        return hidden_states


class PhiForCausalLM(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.model = PhiModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size)

    def forward(self, input_ids):
        hidden_states = self.model(input_ids)
        return self.lm_head(hidden_states)


def build_model():
    return PhiForCausalLM(PhiConfig())


def input_spec():
    return [paddle.static.InputSpec([2, SEQ], "int64", "input_ids")]


def loss(model, tokens, labels):
    return F.cross_entropy(model(tokens).reshape([-1, VOCAB]), labels.reshape([-1]))
