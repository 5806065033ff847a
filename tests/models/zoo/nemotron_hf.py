"""Nemotron-4 / Minitron as HF's modeling_nemotron writes it, ported to Paddle at a small config.

``NemotronLayerNorm1P``: a LayerNorm whose weight is applied as ``weight + 1``. Partial rotary:
half of each head's features (``partial_rotary_factor`` 0.5), the rotary width read from the
cos table's last dim, the rest concatenated back. Grouped-query attention with ``head_dim``
from the config; the MLP is ``up_proj`` -> squared ReLU -> ``down_proj`` (no gate). Untied head.

What differs from the torch code is spelling (``reshape`` for ``view``, ``transpose`` with the
whole permutation, ``axis`` for ``dim``); caches, SDPA and flash paths are left out. Planned
blind at mp2 (``--input-spec input_ids:int64:4x16`` and ``6x12``: the same plan).

    >>> model = build_model()
    >>> list(model(paddle.randint(0, VOCAB, [2, SEQ])).shape)
    [2, 16, 256]
"""

import math

import paddle
import paddle.nn as nn
import paddle.nn.functional as F

VOCAB, HIDDEN, INTER, LAYERS, HEADS, KV_HEADS, HEAD_DIM, SEQ = 256, 48, 96, 2, 4, 2, 12, 16


class NemotronConfig:
    vocab_size = VOCAB
    hidden_size = HIDDEN
    intermediate_size = INTER
    num_hidden_layers = LAYERS
    num_attention_heads = HEADS
    head_dim = HEAD_DIM
    num_key_value_heads = KV_HEADS
    hidden_act = "relu2"
    norm_eps = 1e-5
    rope_theta = 10000.0
    partial_rotary_factor = 0.5
    attention_bias = False
    attention_dropout = 0.0
    mlp_bias = False


class NemotronLayerNorm1P(nn.LayerNorm):
    def __init__(self, normalized_shape, eps=1e-5):
        super().__init__(normalized_shape, epsilon=eps)

    def forward(self, input):
        return F.layer_norm(input, self._normalized_shape, self.weight + 1, self.bias, self._epsilon)


class NemotronRotaryEmbedding(nn.Layer):
    def __init__(self, config):
        super().__init__()
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        dim = int(head_dim * config.partial_rotary_factor)
        inv_freq = 1.0 / (config.rope_theta ** (paddle.arange(0, dim, 2, dtype="float32") / dim))
        self.register_buffer("inv_freq", inv_freq, persistable=False)
        self.attention_scaling = 1.0

    def forward(self, x, position_ids):
        inv_freq_expanded = self.inv_freq[None, :, None].expand([position_ids.shape[0], -1, 1])
        position_ids_expanded = position_ids[:, None, :].astype("float32")
        freqs = paddle.matmul(inv_freq_expanded, position_ids_expanded).transpose([0, 2, 1])
        emb = paddle.concat((freqs, freqs), axis=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.astype(x.dtype), sin.astype(x.dtype)


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return paddle.concat((-x2, x1), axis=-1)


def apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)

    rot_dim = cos.shape[-1]
    # If q_pass/k_pass is empty, rotary pos embedding is applied to all tensor q/k
    q, q_pass = q[..., :rot_dim], q[..., rot_dim:]
    k, k_pass = k[..., :rot_dim], k[..., rot_dim:]

    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return paddle.concat((q_embed, q_pass), axis=-1), paddle.concat((k_embed, k_pass), axis=-1)


class NemotronMLP(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.hidden_size = config.hidden_size
        self.intermediate_size = config.intermediate_size
        self.up_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias_attr=config.mlp_bias)
        self.down_proj = nn.Linear(self.intermediate_size, self.hidden_size, bias_attr=config.mlp_bias)
        self.act_fn = lambda x: paddle.square(F.relu(x))  # ACT2FN["relu2"]

    def forward(self, x):
        return self.down_proj(self.act_fn(self.up_proj(x)))


def repeat_kv(hidden_states, n_rep):
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand([batch, num_key_value_heads, n_rep, slen, head_dim])
    return hidden_states.reshape([batch, num_key_value_heads * n_rep, slen, head_dim])


class NemotronAttention(nn.Layer):
    """Multi-headed attention from 'Attention Is All You Need' paper"""

    def __init__(self, config, layer_idx=None):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.attention_dropout = config.attention_dropout
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = config.head_dim
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.partial_rotary_factor = config.partial_rotary_factor
        self.is_causal = True

        self.q_proj = nn.Linear(self.hidden_size, self.num_heads * self.head_dim, bias_attr=config.attention_bias)
        self.k_proj = nn.Linear(
            self.hidden_size, self.num_key_value_heads * self.head_dim, bias_attr=config.attention_bias
        )
        self.v_proj = nn.Linear(
            self.hidden_size, self.num_key_value_heads * self.head_dim, bias_attr=config.attention_bias
        )
        self.o_proj = nn.Linear(self.head_dim * self.num_heads, self.hidden_size, bias_attr=config.attention_bias)

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
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)

        key_states = repeat_kv(key_states, self.num_key_value_groups)
        value_states = repeat_kv(value_states, self.num_key_value_groups)
        attn_weights = paddle.matmul(query_states, key_states.transpose([0, 1, 3, 2])) / math.sqrt(self.head_dim)

        if attention_mask is not None:  # no matter the length, we just slice it
            causal_mask = attention_mask[:, :, :, : key_states.shape[-2]]
            attn_weights = attn_weights + causal_mask

        # upcast attention to fp32
        attn_weights = F.softmax(attn_weights, axis=-1, dtype="float32").astype(query_states.dtype)
        attn_weights = F.dropout(attn_weights, p=self.attention_dropout, training=self.training)
        attn_output = paddle.matmul(attn_weights, value_states)

        attn_output = attn_output.transpose([0, 2, 1, 3])
        attn_output = attn_output.reshape([bsz, q_len, -1])
        attn_output = self.o_proj(attn_output)
        return attn_output, None


class NemotronDecoderLayer(nn.Layer):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.self_attn = NemotronAttention(config=config, layer_idx=layer_idx)
        self.mlp = NemotronMLP(config)
        self.input_layernorm = NemotronLayerNorm1P(config.hidden_size, eps=config.norm_eps)
        self.post_attention_layernorm = NemotronLayerNorm1P(config.hidden_size, eps=config.norm_eps)

    def forward(self, hidden_states, attention_mask=None, position_ids=None, position_embeddings=None):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, _ = self.self_attn(
            hidden_states=hidden_states,
            attention_mask=attention_mask,
            position_ids=position_ids,
            position_embeddings=position_embeddings,
        )
        hidden_states = residual + hidden_states

        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        hidden_states = residual + hidden_states
        return hidden_states


def causal_mask(inputs_embeds):
    seq = inputs_embeds.shape[1]
    full = paddle.full([seq, seq], float("-inf"), dtype=inputs_embeds.dtype)
    return paddle.triu(full, diagonal=1)[None, None, :, :]


class NemotronModel(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.LayerList([NemotronDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = NemotronLayerNorm1P(config.hidden_size, eps=config.norm_eps)
        self.rotary_emb = NemotronRotaryEmbedding(config=config)

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


class NemotronForCausalLM(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.model = NemotronModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias_attr=False)

    def forward(self, input_ids):
        return self.lm_head(self.model(input_ids))


def build_model():
    return NemotronForCausalLM(NemotronConfig())


def input_spec():
    return [paddle.static.InputSpec([2, SEQ], "int64", "input_ids")]


def loss(model, tokens, labels):
    return F.cross_entropy(model(tokens).reshape([-1, VOCAB]), labels.reshape([-1]))
