"""StarCoder2 as HuggingFace transformers 4.40 writes it (src/transformers/models/starcoder2/
modeling_starcoder2.py, its SDPA attention, the default), ported to Paddle at a small config.

Its top-level glue does not trace whole: ``Starcoder2Model.forward`` builds the attention mask
with ``_prepare_4d_causal_attention_mask_for_sdpa``, which drops a mask of all ones
(``AttentionMaskConverter._ignore_causal_mask_sdpa``: ``torch.all(attention_mask == 1)`` in a
Python ``if``), so each layer gets ``None`` and SDPA masks causally itself (``is_causal``), or
gets a 4-D additive mask when there is padding. One branch gives None, the other a tensor: a
condition on a tensor's value that ``paddle.jit.to_static(full_graph=True)`` cannot turn into
one program. The planner traces it block by block instead (the embedding, each decoder layer,
the final norm and the head, each alone) and the glue runs as written.

Attention: ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj`` with biases (``use_bias``), grouped
query (2 KV heads of 6, ``repeat_kv``), rotary from a cos/sin cache indexed by ``position_ids``,
residual dropout on its output. MLP: ``c_fc`` -> GELU (tanh) -> ``c_proj`` with biases. LayerNorm
with bias before each, the LM head untied. What differs from the torch code is spelling
(``reshape`` for ``view``, ``axis`` for ``dim``); the KV cache and flash paths are left out.
``rotate_half``, ``apply_rotary_pos_emb``, ``repeat_kv`` and the rotary cache are HF's
``# Copied from transformers.models.llama`` code, as the other HF ports here have them: the file
stands alone, as the model's own file does.

    >>> model = build_model()
    >>> ids = paddle.randint(0, VOCAB, [2, SEQ])
    >>> list(model(ids, attention_mask=paddle.ones_like(ids)).shape)
    [2, 12, 96]
"""

import paddle
import paddle.nn as nn
import paddle.nn.functional as F

VOCAB, HIDDEN, INTER, LAYERS, HEADS, KV_HEADS, SEQ = 96, 48, 80, 2, 6, 2, 12


class Starcoder2Config:
    vocab_size = VOCAB
    hidden_size = HIDDEN
    intermediate_size = INTER
    num_hidden_layers = LAYERS
    num_attention_heads = HEADS
    num_key_value_heads = KV_HEADS
    max_position_embeddings = 64
    norm_epsilon = 1e-5
    rope_theta = 10000.0
    sliding_window = 32
    use_bias = True
    residual_dropout = 0.0
    embedding_dropout = 0.0
    attention_dropout = 0.0


def _ignore_causal_mask_sdpa(attention_mask, inputs_embeds, past_key_values_length, sliding_window=None):
    """``AttentionMaskConverter._ignore_causal_mask_sdpa``: a mask of all ones is dropped, SDPA's
    ``is_causal`` masks instead."""
    query_length = inputs_embeds.shape[1]
    key_value_length = query_length + past_key_values_length
    ignore_causal_mask = False
    if attention_mask is None:
        if query_length == 1 or key_value_length == query_length:
            ignore_causal_mask = True
    elif sliding_window is None or key_value_length < sliding_window:
        if len(attention_mask.shape) == 4:
            return False
        elif paddle.all(attention_mask == 1):
            if query_length == 1 or key_value_length == query_length:
                ignore_causal_mask = True
    return ignore_causal_mask


def _prepare_4d_causal_attention_mask_for_sdpa(
    attention_mask, input_shape, inputs_embeds, past_key_values_length, sliding_window=None
):
    """A ``[bsz, 1, tgt, src]`` additive mask (causal, sliding window, padding), or None."""
    key_value_length = input_shape[-1] + past_key_values_length
    if _ignore_causal_mask_sdpa(attention_mask, inputs_embeds, past_key_values_length, sliding_window):
        return None
    batch_size, query_length = input_shape
    min_value = paddle.finfo(inputs_embeds.dtype).min
    rows = paddle.arange(query_length)[:, None] + past_key_values_length
    cols = paddle.arange(key_value_length)[None, :]
    allowed = cols <= rows
    if sliding_window is not None:
        allowed = paddle.logical_and(allowed, cols > rows - sliding_window)
    allowed = allowed[None, None].expand([batch_size, 1, query_length, key_value_length])
    if attention_mask is not None:
        padding = attention_mask[:, None, None, :].astype("bool")
        allowed = paddle.logical_and(allowed, padding)
    zeros = paddle.zeros(allowed.shape, dtype=inputs_embeds.dtype)
    return paddle.where(allowed, zeros, paddle.full_like(zeros, min_value))


class Starcoder2RotaryEmbedding(nn.Layer):
    def __init__(self, dim, max_position_embeddings=2048, base=10000):
        super().__init__()
        self.dim = dim
        self.max_position_embeddings = max_position_embeddings
        self.base = base
        inv_freq = 1.0 / (self.base ** (paddle.arange(0, self.dim, 2, dtype="int64").astype("float32") / self.dim))
        self.register_buffer("inv_freq", inv_freq, persistable=False)
        self._set_cos_sin_cache(seq_len=max_position_embeddings, dtype=paddle.get_default_dtype())

    def _set_cos_sin_cache(self, seq_len, dtype):
        self.max_seq_len_cached = seq_len
        t = paddle.arange(self.max_seq_len_cached, dtype="int64").astype(self.inv_freq.dtype)
        freqs = paddle.outer(t, self.inv_freq)
        emb = paddle.concat((freqs, freqs), axis=-1)
        self.register_buffer("cos_cached", emb.cos().astype(dtype), persistable=False)
        self.register_buffer("sin_cached", emb.sin().astype(dtype), persistable=False)

    def forward(self, x, seq_len=None):
        if seq_len > self.max_seq_len_cached:
            self._set_cos_sin_cache(seq_len=seq_len, dtype=x.dtype)
        return self.cos_cached[:seq_len].astype(x.dtype), self.sin_cached[:seq_len].astype(x.dtype)


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return paddle.concat((-x2, x1), axis=-1)


def apply_rotary_pos_emb(q, k, cos, sin, position_ids, unsqueeze_dim=1):
    cos = cos[position_ids].unsqueeze(unsqueeze_dim)
    sin = sin[position_ids].unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed


class Starcoder2MLP(nn.Layer):
    def __init__(self, config):
        super().__init__()
        embed_dim = config.hidden_size
        self.c_fc = nn.Linear(embed_dim, config.intermediate_size, bias_attr=None if config.use_bias else False)
        self.c_proj = nn.Linear(config.intermediate_size, embed_dim, bias_attr=None if config.use_bias else False)
        self.residual_dropout = config.residual_dropout

    def forward(self, hidden_states):
        hidden_states = self.c_fc(hidden_states)
        hidden_states = F.gelu(hidden_states, approximate=True)
        hidden_states = self.c_proj(hidden_states)
        return F.dropout(hidden_states, p=self.residual_dropout, training=self.training)


def repeat_kv(hidden_states, n_rep):
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand([batch, num_key_value_heads, n_rep, slen, head_dim])
    return hidden_states.reshape([batch, num_key_value_heads * n_rep, slen, head_dim])


class Starcoder2SdpaAttention(nn.Layer):
    def __init__(self, config, layer_idx=None):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.hidden_size // self.num_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.is_causal = True
        self.attention_dropout = config.attention_dropout
        self.residual_dropout = config.residual_dropout
        bias = None if config.use_bias else False
        self.q_proj = nn.Linear(self.hidden_size, self.num_heads * self.head_dim, bias_attr=bias)
        self.k_proj = nn.Linear(self.hidden_size, self.num_key_value_heads * self.head_dim, bias_attr=bias)
        self.v_proj = nn.Linear(self.hidden_size, self.num_key_value_heads * self.head_dim, bias_attr=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, self.hidden_size, bias_attr=bias)
        self.rotary_emb = Starcoder2RotaryEmbedding(
            self.head_dim, max_position_embeddings=config.max_position_embeddings, base=config.rope_theta
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

        kv_seq_len = key_states.shape[-2]
        cos, sin = self.rotary_emb(value_states, seq_len=kv_seq_len)
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin, position_ids)

        key_states = repeat_kv(key_states, self.num_key_value_groups)
        value_states = repeat_kv(value_states, self.num_key_value_groups)

        # Paddle's SDPA takes [batch, seq, heads, head_dim]
        attn_output = F.scaled_dot_product_attention(
            query_states.transpose([0, 2, 1, 3]),
            key_states.transpose([0, 2, 1, 3]),
            value_states.transpose([0, 2, 1, 3]),
            attn_mask=attention_mask,
            dropout_p=self.attention_dropout if self.training else 0.0,
            # q_len > 1 matches AttentionMaskConverter.to_causal_4d, which makes no mask for one token
            is_causal=self.is_causal and attention_mask is None and q_len > 1,
        )
        attn_output = attn_output.reshape([bsz, q_len, self.hidden_size])
        attn_output = self.o_proj(attn_output)
        attn_output = F.dropout(attn_output, p=self.residual_dropout, training=self.training)
        return attn_output, None, None


class Starcoder2DecoderLayer(nn.Layer):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.self_attn = Starcoder2SdpaAttention(config, layer_idx)
        self.mlp = Starcoder2MLP(config)
        self.input_layernorm = nn.LayerNorm(config.hidden_size, epsilon=config.norm_epsilon)
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size, epsilon=config.norm_epsilon)

    def forward(self, hidden_states, attention_mask=None, position_ids=None):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, self_attn_weights, present_key_value = self.self_attn(
            hidden_states=hidden_states, attention_mask=attention_mask, position_ids=position_ids
        )
        hidden_states = residual + hidden_states

        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        hidden_states = residual + hidden_states
        return (hidden_states,)


class Starcoder2Model(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.LayerList([Starcoder2DecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = nn.LayerNorm(config.hidden_size, epsilon=config.norm_epsilon)
        self.embedding_dropout = config.embedding_dropout

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        batch_size, seq_length = input_ids.shape
        past_key_values_length = 0
        if position_ids is None:
            position_ids = paddle.arange(past_key_values_length, seq_length + past_key_values_length, dtype="int64")
            position_ids = position_ids.unsqueeze(0).reshape([-1, seq_length])

        inputs_embeds = self.embed_tokens(input_ids)
        attention_mask = _prepare_4d_causal_attention_mask_for_sdpa(
            attention_mask,
            (batch_size, seq_length),
            inputs_embeds,
            past_key_values_length,
            sliding_window=self.config.sliding_window,
        )

        hidden_states = inputs_embeds
        hidden_states = F.dropout(hidden_states, p=self.embedding_dropout, training=self.training)
        for decoder_layer in self.layers:
            layer_outputs = decoder_layer(hidden_states, attention_mask=attention_mask, position_ids=position_ids)
            hidden_states = layer_outputs[0]
        return self.norm(hidden_states)


class Starcoder2ForCausalLM(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.model = Starcoder2Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias_attr=False)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        hidden_states = self.model(input_ids, attention_mask=attention_mask, position_ids=position_ids)
        return self.lm_head(hidden_states).astype("float32")


def build_model():
    return Starcoder2ForCausalLM(Starcoder2Config())


def input_spec():
    return [
        paddle.static.InputSpec([2, SEQ], "int64", "input_ids"),
        paddle.static.InputSpec([2, SEQ], "int64", "attention_mask"),
    ]


def loss(model, tokens, labels):
    """A batch without padding, its mask all ones, as a tokenizer gives it."""
    logits = model(tokens, attention_mask=paddle.ones_like(tokens))
    return F.cross_entropy(logits.reshape([-1, VOCAB]), labels.reshape([-1]))
