"""InternLM2 as its authors write it (``modeling_internlm2.py``, the remote code of
internlm/internlm2-7b on the HuggingFace hub), ported to Paddle at a small config.

Attention: one fused ``wqkv`` laid out KV group by KV group, ``[q_1 .. q_g, k, v]`` for each of
the ``num_key_value_heads`` groups of ``num_key_value_groups`` query heads each (grouped-query
attention, 4 heads over 2 KV heads here, so ``num_key_value_groups`` is 2, as many as the KV
heads), cut by ``rearrange`` into ``[b, q, h, gs, d]`` and sliced on ``gs``; rotary embedding from
position ids inside the attention (``InternLM2RotaryEmbedding``, ``rotate_half``); ``repeat_kv``;
eager attention with an additive causal mask; it returns ``(attn_output, attn_weights,
past_key_value)``, both None without ``output_attentions`` and a cache. MLP: ``w2(silu(w1(x)) *
w3(x))``. RMSNorm before each sub-layer, the LM head (``output``) untied.

What differs from the torch code is spelling: ``rearrange`` (einops) written as the ``reshape``
it is, ``reshape`` for ``view``, ``transpose`` with the whole permutation, ``axis`` for ``dim``;
the KV cache, flash attention and the rope scaling variants are left out.

    >>> model = build_model()
    >>> list(model(paddle.randint(0, VOCAB, [2, SEQ])).shape)
    [2, 16, 256]
"""

import math

import paddle
import paddle.nn as nn
import paddle.nn.functional as F

VOCAB, HIDDEN, INTER, LAYERS, HEADS, KV_HEADS, SEQ = 256, 32, 64, 2, 4, 2, 16


class InternLM2Config:
    vocab_size = VOCAB
    hidden_size = HIDDEN
    intermediate_size = INTER
    num_hidden_layers = LAYERS
    num_attention_heads = HEADS
    num_key_value_heads = KV_HEADS
    hidden_act = "silu"
    max_position_embeddings = 64
    rms_norm_eps = 1e-6
    bias = False
    rope_theta = 10000


class InternLM2RMSNorm(nn.Layer):
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


class InternLM2RotaryEmbedding(nn.Layer):
    def __init__(self, dim, max_position_embeddings=2048, base=10000, scaling_factor=1.0):
        super().__init__()
        self.scaling_factor = scaling_factor
        self.dim = dim
        self.max_position_embeddings = max_position_embeddings
        self.base = base
        inv_freq = 1.0 / (self.base ** (paddle.arange(0, self.dim, 2, dtype="int64").astype("float32") / self.dim))
        self.register_buffer("inv_freq", inv_freq, persistable=False)
        self.max_seq_len_cached = max_position_embeddings

    @paddle.no_grad()
    def forward(self, x, position_ids):
        inv_freq_expanded = self.inv_freq[None, :, None].astype("float32").expand([position_ids.shape[0], -1, 1])
        position_ids_expanded = position_ids[:, None, :].astype("float32")
        freqs = (inv_freq_expanded @ position_ids_expanded).transpose([0, 2, 1])
        emb = paddle.concat((freqs, freqs), axis=-1)
        cos = emb.cos()
        sin = emb.sin()
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


class InternLM2MLP(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.hidden_size = config.hidden_size
        self.intermediate_size = config.intermediate_size
        self.w1 = nn.Linear(self.hidden_size, self.intermediate_size, bias_attr=False)
        self.w3 = nn.Linear(self.hidden_size, self.intermediate_size, bias_attr=False)
        self.w2 = nn.Linear(self.intermediate_size, self.hidden_size, bias_attr=False)
        self.act_fn = F.silu

    def forward(self, x):
        down_proj = self.w2(self.act_fn(self.w1(x)) * self.w3(x))
        return down_proj


def repeat_kv(hidden_states, n_rep):
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand([batch, num_key_value_heads, n_rep, slen, head_dim])
    return hidden_states.reshape([batch, num_key_value_heads * n_rep, slen, head_dim])


class InternLM2Attention(nn.Layer):
    """Multi-headed attention from 'Attention Is All You Need' paper"""

    def __init__(self, config, layer_idx=None):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.hidden_size // self.num_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.max_position_embeddings = config.max_position_embeddings
        self.rope_theta = config.rope_theta
        self.is_causal = True

        self.wqkv = nn.Linear(
            self.hidden_size,
            (self.num_heads + 2 * self.num_key_value_heads) * self.head_dim,
            bias_attr=config.bias,
        )
        self.wo = nn.Linear(self.num_heads * self.head_dim, self.hidden_size, bias_attr=config.bias)
        self._init_rope()

    def _init_rope(self):
        self.rotary_emb = InternLM2RotaryEmbedding(
            self.head_dim,
            max_position_embeddings=self.max_position_embeddings,
            base=self.rope_theta,
        )
        return self.rotary_emb

    def forward(
        self,
        hidden_states,
        attention_mask=None,
        position_ids=None,
        past_key_value=None,
        output_attentions=False,
        use_cache=False,
    ):
        bsz, q_len, _ = hidden_states.shape

        qkv_states = self.wqkv(hidden_states)

        # rearrange(qkv_states, "b q (h gs d) -> b q h gs d", gs=2 + self.num_key_value_groups, d=self.head_dim)
        qkv_states = qkv_states.reshape([bsz, q_len, -1, 2 + self.num_key_value_groups, self.head_dim])

        query_states = qkv_states[..., : self.num_key_value_groups, :]
        # rearrange(query_states, "b q h gs d -> b q (h gs) d")
        query_states = query_states.reshape([bsz, q_len, -1, self.head_dim]).transpose([0, 2, 1, 3])
        key_states = qkv_states[..., -2, :].transpose([0, 2, 1, 3])
        value_states = qkv_states[..., -1, :].transpose([0, 2, 1, 3])

        cos, sin = self.rotary_emb(value_states, position_ids)
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)

        key_states = repeat_kv(key_states, self.num_key_value_groups)
        value_states = repeat_kv(value_states, self.num_key_value_groups)

        attn_weights = paddle.matmul(query_states, key_states.transpose([0, 1, 3, 2])) / math.sqrt(self.head_dim)

        if attention_mask is not None:  # no matter the length, we just slice it
            causal_mask = attention_mask[:, :, :, : key_states.shape[-2]]
            attn_weights = attn_weights + causal_mask

        # upcast attention to fp32
        attn_weights = F.softmax(attn_weights, axis=-1, dtype="float32").astype(query_states.dtype)
        attn_output = paddle.matmul(attn_weights, value_states)

        attn_output = attn_output.transpose([0, 2, 1, 3])
        attn_output = attn_output.reshape([bsz, q_len, self.hidden_size])

        attn_output = self.wo(attn_output)

        if not output_attentions:
            attn_weights = None

        return attn_output, attn_weights, past_key_value


class InternLM2DecoderLayer(nn.Layer):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.layer_idx = layer_idx
        self.attention = InternLM2Attention(config=config, layer_idx=layer_idx)
        self.feed_forward = InternLM2MLP(config)
        self.attention_norm = InternLM2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.ffn_norm = InternLM2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_value=None, use_cache=False):
        residual = hidden_states

        hidden_states = self.attention_norm(hidden_states)

        # Self Attention
        hidden_states, self_attn_weights, present_key_value = self.attention(
            hidden_states=hidden_states,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_value=past_key_value,
            output_attentions=False,
            use_cache=use_cache,
        )
        hidden_states = residual + hidden_states

        # Fully Connected
        residual = hidden_states
        hidden_states = self.ffn_norm(hidden_states)
        hidden_states = self.feed_forward(hidden_states)
        hidden_states = residual + hidden_states
        return hidden_states


def causal_mask(inputs_embeds):
    """The ``[batch, 1, q, kv]`` float mask ``_update_causal_mask`` makes for eager attention
    without padding: 0 where a query may attend, the dtype's minimum above the diagonal."""
    batch, seq = inputs_embeds.shape[0], inputs_embeds.shape[1]
    min_dtype = paddle.finfo(inputs_embeds.dtype).min
    mask = paddle.triu(paddle.full([seq, seq], min_dtype, dtype=inputs_embeds.dtype), diagonal=1)
    return mask[None, None].expand([batch, 1, seq, seq])


class InternLM2Model(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.padding_idx = None
        self.vocab_size = config.vocab_size
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.LayerList([InternLM2DecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = InternLM2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, input_ids):
        inputs_embeds = self.tok_embeddings(input_ids)
        position_ids = paddle.arange(0, inputs_embeds.shape[1]).unsqueeze(0)
        mask = causal_mask(inputs_embeds)
        hidden_states = inputs_embeds
        for decoder_layer in self.layers:
            hidden_states = decoder_layer(hidden_states, attention_mask=mask, position_ids=position_ids)
        return self.norm(hidden_states)


class InternLM2ForCausalLM(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.model = InternLM2Model(config)
        self.vocab_size = config.vocab_size
        self.output = nn.Linear(config.hidden_size, config.vocab_size, bias_attr=False)

    def forward(self, input_ids):
        return self.output(self.model(input_ids))


def build_model():
    return InternLM2ForCausalLM(InternLM2Config())


def input_spec():
    return [paddle.static.InputSpec([2, SEQ], "int64", "input_ids")]


def loss(model, tokens, labels):
    return F.cross_entropy(model(tokens).reshape([-1, VOCAB]), labels.reshape([-1]))
