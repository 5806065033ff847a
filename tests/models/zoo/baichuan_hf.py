"""Baichuan 7B as baichuan-inc writes it (``modeling_baichuan.py``, the remote code of
baichuan-inc/Baichuan-7B on the HuggingFace hub), ported to Paddle at a small config.

Attention: q, k and v packed in one ``W_pack`` (``3 * hidden_size`` outputs, no bias) and cut by
``unflatten(-1, (3, self.hidden_size))`` then indexing ``proj[0]``, ``proj[1]``, ``proj[2]``;
rotary embedding from cos/sin tables cached in the attention's own ``rotary_emb`` and indexed by
the position ids; eager attention with an additive causal mask, clamped at the dtype's minimum;
the output reshaped to ``self.hidden_size``; it returns ``(attn_output, attn_weights,
past_key_value)``, the decoder layer reads the first. MLP: ``down_proj(silu(gate_proj(x)) *
up_proj(x))``. RMSNorm before each sub-layer, the LM head untied.

What differs from the torch code is spelling: ``reshape`` for ``view``, ``transpose`` with the
whole permutation (``transpose(0, -2)`` as the permutation it is), ``axis`` for ``dim``; the KV
cache and the masks' padding are left out.

    >>> model = build_model()
    >>> list(model(paddle.randint(0, VOCAB, [2, SEQ])).shape)
    [2, 16, 256]
"""

import math

import paddle
import paddle.nn as nn
import paddle.nn.functional as F

VOCAB, HIDDEN, INTER, LAYERS, HEADS, SEQ = 256, 32, 64, 2, 4, 16


class BaiChuanConfig:
    vocab_size = VOCAB
    hidden_size = HIDDEN
    intermediate_size = INTER
    num_hidden_layers = LAYERS
    num_attention_heads = HEADS
    hidden_act = "silu"
    max_position_embeddings = 64
    rms_norm_eps = 1e-6


class RMSNorm(nn.Layer):
    def __init__(self, hidden_size, eps=1e-6):
        """
        RMSNorm is equivalent to T5LayerNorm
        """
        super().__init__()
        self.weight = self.create_parameter([hidden_size], default_initializer=nn.initializer.Constant(1.0))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.astype("float32").pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * paddle.rsqrt(variance + self.variance_epsilon)

        # convert into half-precision if necessary
        if self.weight.dtype in [paddle.float16, paddle.bfloat16]:
            hidden_states = hidden_states.astype(self.weight.dtype)

        return self.weight * hidden_states


class RotaryEmbedding(nn.Layer):
    def __init__(self, dim, max_position_embeddings=2048, base=10000):
        super().__init__()
        inv_freq = 1.0 / (base ** (paddle.arange(0, dim, 2).astype("float32") / dim))
        self.register_buffer("inv_freq", inv_freq)

        # Build here to make `torch.jit.trace` work.
        self.max_seq_len_cached = max_position_embeddings
        t = paddle.arange(self.max_seq_len_cached, dtype=self.inv_freq.dtype)
        freqs = paddle.einsum("i,j->ij", t, self.inv_freq)
        # Different from paper, but it uses a different permutation in order to obtain the same calculation
        emb = paddle.concat((freqs, freqs), axis=-1)
        self.register_buffer("cos_cached", emb.cos()[None, None, :, :], persistable=False)
        self.register_buffer("sin_cached", emb.sin()[None, None, :, :], persistable=False)

    def forward(self, x, seq_len=None):
        # x: [bs, num_attention_heads, seq_len, head_size]
        # This `if` block is unlikely to be run after we build sin/cos in `__init__`. Keep the logic here just in case.
        if seq_len > self.max_seq_len_cached:
            self.max_seq_len_cached = seq_len
            t = paddle.arange(self.max_seq_len_cached, dtype=self.inv_freq.dtype)
            freqs = paddle.einsum("i,j->ij", t, self.inv_freq)
            emb = paddle.concat((freqs, freqs), axis=-1)
            self.register_buffer("cos_cached", emb.cos()[None, None, :, :], persistable=False)
            self.register_buffer("sin_cached", emb.sin()[None, None, :, :], persistable=False)
        return (
            self.cos_cached[:, :, :seq_len, ...].astype(x.dtype),
            self.sin_cached[:, :, :seq_len, ...].astype(x.dtype),
        )


def rotate_half(x):
    """Rotates half the hidden dims of the input."""
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return paddle.concat((-x2, x1), axis=-1)


def apply_rotary_pos_emb(q, k, cos, sin, position_ids):
    # The first two dimensions of cos and sin are always 1, so we can `squeeze` them.
    cos = cos.squeeze(1).squeeze(0)  # [seq_len, dim]
    sin = sin.squeeze(1).squeeze(0)  # [seq_len, dim]
    cos = cos[position_ids].unsqueeze(1)  # [bs, 1, seq_len, dim]
    sin = sin[position_ids].unsqueeze(1)  # [bs, 1, seq_len, dim]
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed


class MLP(nn.Layer):
    def __init__(self, hidden_size, intermediate_size, hidden_act):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias_attr=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias_attr=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias_attr=False)
        self.act_fn = F.silu

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class Attention(nn.Layer):
    """Multi-headed attention from 'Attention Is All You Need' paper"""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.hidden_size // self.num_heads
        self.max_position_embeddings = config.max_position_embeddings

        if (self.head_dim * self.num_heads) != self.hidden_size:
            raise ValueError(
                f"hidden_size must be divisible by num_heads (got `hidden_size`: {self.hidden_size}"
                f" and `num_heads`: {self.num_heads})."
            )
        self.W_pack = nn.Linear(self.hidden_size, 3 * self.hidden_size, bias_attr=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, self.hidden_size, bias_attr=False)
        self.rotary_emb = RotaryEmbedding(self.head_dim, max_position_embeddings=self.max_position_embeddings)

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

        proj = self.W_pack(hidden_states)
        # unflatten(-1, (3, hidden_size)).unsqueeze(0).transpose(0, -2).squeeze(-2)
        proj = paddle.unflatten(proj, -1, (3, self.hidden_size)).unsqueeze(0).transpose([3, 1, 2, 0, 4]).squeeze(-2)
        query_states = proj[0].reshape([bsz, q_len, self.num_heads, self.head_dim]).transpose([0, 2, 1, 3])
        key_states = proj[1].reshape([bsz, q_len, self.num_heads, self.head_dim]).transpose([0, 2, 1, 3])
        value_states = proj[2].reshape([bsz, q_len, self.num_heads, self.head_dim]).transpose([0, 2, 1, 3])

        kv_seq_len = key_states.shape[-2]
        cos, sin = self.rotary_emb(value_states, seq_len=kv_seq_len)
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin, position_ids)

        attn_weights = paddle.matmul(query_states, key_states.transpose([0, 1, 3, 2])) / math.sqrt(self.head_dim)

        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask
            attn_weights = paddle.maximum(
                attn_weights, paddle.to_tensor(paddle.finfo(attn_weights.dtype).min, dtype=attn_weights.dtype)
            )

        # upcast attention to fp32
        attn_weights = F.softmax(attn_weights, axis=-1, dtype="float32").astype(query_states.dtype)
        attn_output = paddle.matmul(attn_weights, value_states)

        attn_output = attn_output.transpose([0, 2, 1, 3])
        attn_output = attn_output.reshape([bsz, q_len, self.hidden_size])
        attn_output = self.o_proj(attn_output)

        if not output_attentions:
            attn_weights = None

        return attn_output, attn_weights, past_key_value


class DecoderLayer(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.self_attn = Attention(config=config)
        self.mlp = MLP(
            hidden_size=self.hidden_size,
            intermediate_size=config.intermediate_size,
            hidden_act=config.hidden_act,
        )
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, attention_mask=None, position_ids=None):
        residual = hidden_states

        hidden_states = self.input_layernorm(hidden_states)

        # Self Attention
        hidden_states, self_attn_weights, present_key_value = self.self_attn(
            hidden_states=hidden_states,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_value=None,
            output_attentions=False,
            use_cache=False,
        )
        hidden_states = residual + hidden_states

        # Fully Connected
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        hidden_states = residual + hidden_states
        return hidden_states


def _make_causal_mask(input_ids_shape, dtype):
    """The ``[bsz, 1, tgt_len, tgt_len]`` causal mask: 0 on and below the diagonal, the dtype's
    minimum above it."""
    bsz, tgt_len = input_ids_shape
    mask = paddle.full([tgt_len, tgt_len], paddle.finfo(dtype).min, dtype=dtype)
    mask = paddle.triu(mask, diagonal=1)
    return mask[None, None, :, :].expand([bsz, 1, tgt_len, tgt_len])


class Model(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.padding_idx = None
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.LayerList([DecoderLayer(config) for _ in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, input_ids):
        batch_size, seq_length = input_ids.shape
        position_ids = paddle.arange(0, seq_length, dtype="int64").unsqueeze(0).reshape([-1, seq_length])
        inputs_embeds = self.embed_tokens(input_ids)
        attention_mask = _make_causal_mask([batch_size, seq_length], inputs_embeds.dtype)
        hidden_states = inputs_embeds
        for decoder_layer in self.layers:
            hidden_states = decoder_layer(hidden_states, attention_mask=attention_mask, position_ids=position_ids)
        return self.norm(hidden_states)


class BaiChuanForCausalLM(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.model = Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias_attr=False)

    def forward(self, input_ids):
        return self.lm_head(self.model(input_ids))


def build_model():
    return BaiChuanForCausalLM(BaiChuanConfig())


def input_spec():
    return [paddle.static.InputSpec([2, SEQ], "int64", "input_ids")]


def loss(model, tokens, labels):
    return F.cross_entropy(model(tokens).reshape([-1, VOCAB]), labels.reshape([-1]))
