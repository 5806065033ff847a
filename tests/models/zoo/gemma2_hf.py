"""HF Gemma2 (google/gemma-2), ported to Paddle as its modeling_gemma2.py writes it: a config object,
``Gemma2RMSNorm`` scaling by ``1 + weight`` in float32, rotary embeddings from an ``inv_freq`` buffer,
grouped-query attention through ``eager_attention_forward(self, ...)`` (``repeat_kv``, scores scaled
by ``query_pre_attn_scalar ** -0.5``, soft-capped by ``tanh(x / cap) * cap``, the mask sliced to the
keys and added), layers alternating sliding-window (even ``layer_idx``: the causal mask turned into
a band by ``tril(ones_like(mask), diagonal=-sliding_window)`` and ``where``) and global attention,
sandwich norms around attention and the GeGLU MLP, the embeddings scaled by ``sqrt(hidden_size)``,
the 4-D causal mask of ``_prepare_4d_causal_attention_mask_with_cache_position`` and an LM head tied
to the embeddings with final logit soft-capping; ``labels`` give HF's shifted causal-LM loss.
Sizes: no two of batch 3, sequence 10, heads 4, head dim 12, hidden 40 coincide (2 key/value heads,
intermediate 72, vocabulary 96, sliding window 4).

    >>> model = build_model()
    >>> loss, logits = model(input_ids=paddle.randint(0, VOCAB, [3, 10]), labels=paddle.randint(0, VOCAB, [3, 10]))
    >>> list(logits.shape), list(loss.shape)
    ([3, 10, 96], [])
"""

from __future__ import annotations

import paddle
import paddle.nn as nn
import paddle.nn.functional as F

VOCAB, SEQ = 96, 10


class Gemma2Config:
    vocab_size = VOCAB
    hidden_size = 40
    intermediate_size = 72
    num_hidden_layers = 2
    num_attention_heads = 4
    num_key_value_heads = 2
    head_dim = 12
    hidden_activation = "gelu_pytorch_tanh"
    max_position_embeddings = 64
    rms_norm_eps = 1e-6
    pad_token_id = 0
    rope_theta = 10000.0
    attention_bias = False
    attention_dropout = 0.0
    query_pre_attn_scalar = 16
    sliding_window = 4
    final_logit_softcapping = 30.0
    attn_logit_softcapping = 50.0
    tie_word_embeddings = True
    _attn_implementation = "eager"


class Gemma2RMSNorm(nn.Layer):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = self.create_parameter([dim], default_initializer=nn.initializer.Constant(0.0))

    def _norm(self, x):
        return x * paddle.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        output = self._norm(x.astype("float32"))
        # Llama does x.to(float16) * w whilst Gemma2 is (x * w).to(float16)
        output = output * (1.0 + self.weight.astype("float32"))
        return output.astype(x.dtype)


class Gemma2MLP(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.hidden_size = config.hidden_size
        self.intermediate_size = config.intermediate_size
        self.gate_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias_attr=False)
        self.up_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias_attr=False)
        self.down_proj = nn.Linear(self.intermediate_size, self.hidden_size, bias_attr=False)

    def act_fn(self, x):  # ACT2FN["gelu_pytorch_tanh"]
        return F.gelu(x, approximate=True)

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class Gemma2RotaryEmbedding(nn.Layer):
    def __init__(self, dim, max_position_embeddings=2048, base=10000):
        super().__init__()
        self.dim = dim
        self.max_position_embeddings = max_position_embeddings
        self.base = base
        inv_freq = 1.0 / (self.base ** (paddle.arange(0, self.dim, 2, dtype="int64").astype("float32") / self.dim))
        self.register_buffer("inv_freq", inv_freq, persistable=False)

    @paddle.no_grad()
    def forward(self, x, position_ids):
        # x: [bs, num_attention_heads, seq_len, head_size]
        inv_freq_expanded = self.inv_freq[None, :, None].astype("float32").expand([position_ids.shape[0], -1, 1])
        position_ids_expanded = position_ids[:, None, :].astype("float32")
        freqs = (inv_freq_expanded @ position_ids_expanded).transpose([0, 2, 1])
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


def repeat_kv(hidden_states, n_rep):
    """(batch, num_key_value_heads, seqlen, head_dim) -> (batch, num_attention_heads, seqlen, head_dim)"""
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand([batch, num_key_value_heads, n_rep, slen, head_dim])
    return hidden_states.reshape([batch, num_key_value_heads * n_rep, slen, head_dim])


def eager_attention_forward(config, query, key, value, mask, **_kwargs):
    key_states = repeat_kv(key, config.num_key_value_groups)
    value_states = repeat_kv(value, config.num_key_value_groups)

    attn_weights = paddle.matmul(query, key_states.transpose([0, 1, 3, 2])) * config.scaling

    if config.attn_logit_softcapping is not None:
        attn_weights = attn_weights / config.attn_logit_softcapping
        attn_weights = paddle.tanh(attn_weights)
        attn_weights = attn_weights * config.attn_logit_softcapping
    if mask is not None:  # no matter the length, we just slice it
        causal_mask = mask[:, :, :, : key_states.shape[-2]]
        attn_weights = attn_weights + causal_mask

    # upcast attention to fp32
    attn_weights = F.softmax(attn_weights, axis=-1, dtype="float32").astype(query.dtype)
    attn_weights = F.dropout(attn_weights, p=config.attention_dropout, training=config.training)
    attn_output = paddle.matmul(attn_weights, value_states)
    return attn_output, attn_weights


GEMMA2_ATTENTION_FUNCTION = {"eager": eager_attention_forward}


class Gemma2Attention(nn.Layer):
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
        self.max_position_embeddings = config.max_position_embeddings
        self.rope_theta = config.rope_theta
        self.is_causal = True
        self.scaling = config.query_pre_attn_scalar**-0.5
        self.sliding_window = config.sliding_window if not bool(layer_idx % 2) else None
        self.attn_logit_softcapping = config.attn_logit_softcapping

        bias = None if config.attention_bias else False
        self.q_proj = nn.Linear(self.hidden_size, self.num_heads * self.head_dim, bias_attr=bias)
        self.k_proj = nn.Linear(self.hidden_size, self.num_key_value_heads * self.head_dim, bias_attr=bias)
        self.v_proj = nn.Linear(self.hidden_size, self.num_key_value_heads * self.head_dim, bias_attr=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, self.hidden_size, bias_attr=bias)
        self.rotary_emb = Gemma2RotaryEmbedding(
            self.head_dim, max_position_embeddings=self.max_position_embeddings, base=self.rope_theta
        )

    def forward(self, hidden_states, attention_mask=None, position_ids=None):
        bsz, q_len, _ = hidden_states.shape

        query_states = self.q_proj(hidden_states)
        key_states = self.k_proj(hidden_states)
        value_states = self.v_proj(hidden_states)

        query_states = query_states.reshape([bsz, q_len, self.num_heads, self.head_dim]).transpose([0, 2, 1, 3])
        key_states = key_states.reshape([bsz, q_len, self.num_key_value_heads, self.head_dim]).transpose([0, 2, 1, 3])
        value_states = value_states.reshape([bsz, q_len, self.num_key_value_heads, self.head_dim]).transpose(
            [0, 2, 1, 3]
        )

        cos, sin = self.rotary_emb(value_states, position_ids)
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)

        attn_output, attn_weights = GEMMA2_ATTENTION_FUNCTION[self.config._attn_implementation](
            self, query_states, key_states, value_states, attention_mask
        )

        attn_output = attn_output.transpose([0, 2, 1, 3]).reshape([bsz, q_len, -1])
        attn_output = self.o_proj(attn_output)
        return attn_output, attn_weights


class Gemma2DecoderLayer(nn.Layer):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.config = config
        self.is_sliding = not bool(layer_idx % 2)
        self.self_attn = Gemma2Attention(config=config, layer_idx=layer_idx)
        self.mlp = Gemma2MLP(config)
        self.input_layernorm = Gemma2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Gemma2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.pre_feedforward_layernorm = Gemma2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_feedforward_layernorm = Gemma2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.sliding_window = config.sliding_window

    def forward(self, hidden_states, attention_mask=None, position_ids=None):
        if self.is_sliding and attention_mask is not None:  # efficient SDPA and no padding
            min_dtype = paddle.finfo(hidden_states.dtype).min
            sliding_window_mask = paddle.tril(
                paddle.ones_like(attention_mask, dtype="bool"), diagonal=-self.sliding_window
            )
            attention_mask = paddle.where(
                sliding_window_mask, paddle.full_like(attention_mask, min_dtype), attention_mask
            )

        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)

        # Self Attention
        hidden_states, self_attn_weights = self.self_attn(
            hidden_states=hidden_states, attention_mask=attention_mask, position_ids=position_ids
        )
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = residual + hidden_states

        residual = hidden_states
        hidden_states = self.pre_feedforward_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        hidden_states = self.post_feedforward_layernorm(hidden_states)
        hidden_states = residual + hidden_states
        return (hidden_states,)


class Gemma2Model(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.LayerList(
            [Gemma2DecoderLayer(config, layer_idx) for layer_idx in range(config.num_hidden_layers)]
        )
        self.norm = Gemma2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None):
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)

        cache_position = paddle.arange(0, inputs_embeds.shape[1])
        if position_ids is None:
            position_ids = cache_position.unsqueeze(0)

        causal_mask = self._update_causal_mask(attention_mask, inputs_embeds, cache_position)

        hidden_states = inputs_embeds
        # normalized: Gemma2 downcasts the below to the hidden states' dtype
        normalizer = paddle.to_tensor(self.config.hidden_size**0.5, dtype=hidden_states.dtype)
        hidden_states = hidden_states * normalizer

        for decoder_layer in self.layers:
            layer_outputs = decoder_layer(hidden_states, attention_mask=causal_mask, position_ids=position_ids)
            hidden_states = layer_outputs[0]

        return self.norm(hidden_states)

    def _update_causal_mask(self, attention_mask, input_tensor, cache_position):
        sequence_length = input_tensor.shape[1]
        target_length = attention_mask.shape[-1] if attention_mask is not None else input_tensor.shape[1]
        return self._prepare_4d_causal_attention_mask_with_cache_position(
            attention_mask,
            sequence_length=sequence_length,
            target_length=target_length,
            dtype=input_tensor.dtype,
            cache_position=cache_position,
            batch_size=input_tensor.shape[0],
        )

    @staticmethod
    def _prepare_4d_causal_attention_mask_with_cache_position(
        attention_mask, sequence_length, target_length, dtype, cache_position, batch_size
    ):
        if attention_mask is not None and attention_mask.dim() == 4:
            return attention_mask
        min_dtype = paddle.finfo(dtype).min
        causal_mask = paddle.full((sequence_length, target_length), fill_value=min_dtype, dtype=dtype)
        if sequence_length != 1:
            causal_mask = paddle.triu(causal_mask, diagonal=1)
        causal_mask *= (paddle.arange(target_length) > cache_position.reshape([-1, 1])).astype(dtype)
        causal_mask = causal_mask[None, None, :, :].expand([batch_size, 1, -1, -1])
        if attention_mask is not None:
            causal_mask = causal_mask.clone()
            mask_length = attention_mask.shape[-1]
            padding_mask = causal_mask[:, :, :, :mask_length] + attention_mask[:, None, None, :].astype(dtype)
            padding_mask = padding_mask == 0
            causal_mask[:, :, :, :mask_length] = causal_mask[:, :, :, :mask_length].masked_fill(padding_mask, min_dtype)
        return causal_mask


class Gemma2ForCausalLM(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = Gemma2Model(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias_attr=False)
        if config.tie_word_embeddings:  # Paddle's Embedding holds [vocab, hidden]: the head reads it transposed
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, labels=None):
        hidden_states = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
        logits = paddle.matmul(hidden_states, self.lm_head.weight, transpose_y=self.config.tie_word_embeddings)
        if self.config.final_logit_softcapping is not None:
            logits = logits / self.config.final_logit_softcapping
            logits = paddle.tanh(logits)
            logits = logits * self.config.final_logit_softcapping

        loss = None
        if labels is not None:  # ForCausalLMLoss: shift so that tokens < n predict n
            shift_logits = logits[..., :-1, :].astype("float32")
            shift_labels = labels[..., 1:]
            loss = F.cross_entropy(shift_logits.reshape([-1, self.vocab_size]), shift_labels.reshape([-1]))
        return (loss, logits) if loss is not None else logits


def build_model():
    return Gemma2ForCausalLM(Gemma2Config())


def input_spec():
    return [paddle.static.InputSpec([3, SEQ], "int64", "input_ids")]


def loss(model, tokens, labels):
    """HF's habit: the labels are the input ids, shifted inside the model."""
    return model(input_ids=tokens, labels=tokens)[0]
