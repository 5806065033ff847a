"""The Llama-style model of ``paddle.distributed.to_distributed``'s docstring.

Copied faithfully from the example in
``paddle/distributed/auto_parallel/high_level_api.py`` (Paddle 3.3.1): unfused
q/k/v projections, rotary position embedding, explicit softmax attention, a
SwiGLU MLP, RMSNorm, a ``[hidden, vocab]`` LM head parameter named ``weight``
and the masked cross-entropy loss. The one change: the docstring reads its sizes
from module globals; here they live in :class:`LlamaConfig`, passed down to
every layer, so tests can build tiny versions and benchmarks huge ones.

Planner use::

    autodist-plan plans/llama_docstring/model.py --devices 4 -o plan.json

Sizes can be overridden without editing this file, through keyword arguments
(``build_model(num_layers=2)``) or environment variables named
``LLAMA_DOCSTRING_<FIELD>`` (``LLAMA_DOCSTRING_NUM_LAYERS=80``), which is how
the command line and ``bench/plan_time.py`` pick other sizes.
"""

from __future__ import annotations

import dataclasses
import math
import os

import paddle
import paddle.nn.functional as F
from paddle import nn

BATCH_SIZE = 4  # to_distributed's default input spec is [4, SEQ_LENGTH]
ENV_PREFIX = "LLAMA_DOCSTRING_"


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Model sizes; the defaults are the docstring's constants."""

    vocab_size: int = 8000
    hidden_size: int = 2048
    intermediate_size: int = 4096
    num_heads: int = 32
    num_layers: int = 4
    seq_length: int = 1024

    @classmethod
    def from_env(cls, **overrides: int) -> LlamaConfig:
        """Defaults, then ``LLAMA_DOCSTRING_<FIELD>`` variables, then ``overrides``.

        >>> LlamaConfig.from_env(num_layers=2).num_layers
        2
        """
        values = {}
        for field in dataclasses.fields(cls):
            raw = os.environ.get(ENV_PREFIX + field.name.upper())
            if raw is not None:
                values[field.name] = int(raw)
        values.update(overrides)
        return cls(**values)


class RotaryEmbedding(nn.Layer):
    def __init__(self, dim, max_position_embeddings=2048, base=10000):
        super().__init__()
        self.dim = dim
        self.max_position_embeddings = max_position_embeddings
        self.base = base
        self.inv_freq = 1.0 / (self.base ** (paddle.cast(paddle.arange(0, self.dim, 2), dtype="float32") / self.dim))
        self._set_cos_sin_cache(seq_len=max_position_embeddings)

    def _set_cos_sin_cache(self, seq_len):
        self.max_seq_len_cached = seq_len
        t = paddle.arange(seq_len, dtype="float32")
        freqs = paddle.einsum("i,j->ij", t, self.inv_freq)
        emb = paddle.concat([freqs, freqs], axis=-1)
        self.cos_cached = emb.cos()[None, :, None, :]
        self.sin_cached = emb.sin()[None, :, None, :]

    def forward(self, x, seq_len=None):
        cos = self.cos_cached[:, :seq_len, :, :]
        sin = self.sin_cached[:, :seq_len, :, :]
        return (
            cos.cast(x.dtype) if cos.dtype != x.dtype else cos,
            sin.cast(x.dtype) if sin.dtype != x.dtype else sin,
        )


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return paddle.concat([-x2, x1], axis=-1)


def apply_rotary_pos_emb(q, k, cos, sin, position_ids):
    if position_ids is None:
        cos = cos[:, : q.shape[1], :, :]
        sin = sin[:, : q.shape[1], :, :]
    else:
        cos = cos.squeeze(axis=[0, 2])
        sin = sin.squeeze(axis=[0, 2])
        cos = cos[position_ids].unsqueeze(2)
        sin = sin[position_ids].unsqueeze(2)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed


def scaled_dot_product_attention(query_states, key_states, value_states, attention_mask):
    bsz, q_len, num_heads, head_dim = query_states.shape
    _, kv_seq_len, _, _ = value_states.shape
    query_states = paddle.transpose(query_states, [0, 2, 1, 3])
    key_states = paddle.transpose(key_states, [0, 2, 1, 3])
    value_states = paddle.transpose(value_states, [0, 2, 1, 3])
    attn_weights = paddle.matmul(query_states / math.sqrt(head_dim), key_states.transpose([0, 1, 3, 2]))
    attention_mask = attention_mask.reshape([bsz, 1, q_len, kv_seq_len])
    attn_weights = attn_weights + attention_mask
    if not paddle.in_dynamic_mode():
        attn_weights = F.softmax(attn_weights, axis=-1, dtype="float32").astype(query_states.dtype)
    else:
        with paddle.amp.auto_cast(False):
            attn_weights = F.softmax(attn_weights, axis=-1, dtype="float32").astype(query_states.dtype)
    attn_output = paddle.matmul(attn_weights, value_states)
    attn_output = attn_output.transpose([0, 2, 1, 3])
    attn_output = attn_output.reshape([bsz, q_len, head_dim * num_heads])
    return attn_output


class Attention(nn.Layer):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        hidden_size = config.hidden_size
        self.hidden_size = hidden_size
        self.num_heads = config.num_heads
        self.head_dim = hidden_size // config.num_heads
        self.q_proj = nn.Linear(hidden_size, hidden_size, bias_attr=False)
        self.k_proj = nn.Linear(hidden_size, hidden_size, bias_attr=False)
        self.v_proj = nn.Linear(hidden_size, hidden_size, bias_attr=False)
        self.o_proj = nn.Linear(hidden_size, hidden_size, bias_attr=False)
        self.rotary_emb = RotaryEmbedding(self.head_dim, max_position_embeddings=config.seq_length, base=10000)

    def forward(self, hidden_states, position_ids=None, attention_mask=None):
        query_states = self.q_proj(hidden_states)
        key_states = self.k_proj(hidden_states)
        value_states = self.v_proj(hidden_states)
        target_query_shape = [0, 0, self.num_heads, self.head_dim]
        target_key_value_shape = [0, 0, self.num_heads, self.head_dim]
        query_states = query_states.reshape(shape=target_query_shape)
        key_states = key_states.reshape(shape=target_key_value_shape)
        value_states = value_states.reshape(shape=target_key_value_shape)
        kv_seq_len = key_states.shape[-3]
        cos, sin = self.rotary_emb(value_states, seq_len=kv_seq_len)
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin, position_ids)
        output = scaled_dot_product_attention(query_states, key_states, value_states, attention_mask)
        attn_output = output
        attn_output = self.o_proj(attn_output)
        return attn_output


class Mlp(nn.Layer):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.intermediate_size = config.intermediate_size
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias_attr=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias_attr=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias_attr=False)

    def forward(self, x):
        x = paddle.nn.functional.swiglu(self.gate_proj(x), self.up_proj(x))
        out = self.down_proj(x)
        return out


class RMSNorm(nn.Layer):
    def __init__(self, hidden_size):
        super().__init__()
        self.hidden_size = hidden_size
        self.weight = paddle.create_parameter(
            shape=[self.hidden_size],
            dtype=paddle.get_default_dtype(),
            default_initializer=nn.initializer.Constant(1.0),
        )
        # The docstring's value (1.0, not the usual 1e-6); kept for fidelity.
        self.variance_epsilon = 1.0

    def forward(self, hidden_states):
        with paddle.amp.auto_cast(False):
            hidden_states = hidden_states.astype("float32")
            variance = hidden_states.pow(2).mean(-1, keepdim=True)
            hidden_states = paddle.rsqrt(variance + self.variance_epsilon) * hidden_states
        if self.weight.dtype in [paddle.float16, paddle.bfloat16]:
            hidden_states = paddle.cast(hidden_states, self.weight.dtype)
        return hidden_states * self.weight


class DecoderLayer(nn.Layer):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.intermediate_size = config.intermediate_size
        self.self_attn = Attention(config)
        self.mlp = Mlp(config)
        self.input_layernorm = RMSNorm(config.hidden_size)
        self.post_attn_layernorm = RMSNorm(config.hidden_size)

    def forward(self, hidden_states, position_ids=None, attention_mask=None):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states = self.self_attn(hidden_states, position_ids, attention_mask)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.post_attn_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        hidden_states = residual + hidden_states
        return hidden_states


def _prepare_decoder_attention_mask(attention_mask, input_shape, dtype):
    batch_size, src_length = attention_mask.shape[0], attention_mask.shape[-1]
    batch_size, target_length = input_shape
    attention_mask = attention_mask[:, None, None, :].astype("bool")
    attention_mask.stop_gradient = True
    expanded_attn_mask = attention_mask.expand([batch_size, 1, target_length, src_length])
    mask = paddle.tril(paddle.ones((target_length, target_length), dtype="bool"))
    combined_attention_mask = mask[None, None, :, :].expand([batch_size, 1, target_length, target_length])
    expanded_attn_mask = expanded_attn_mask & combined_attention_mask
    expanded_attn_mask = paddle.where(expanded_attn_mask, 0.0, paddle.finfo(dtype).min).astype(dtype)
    return expanded_attn_mask


class Model(nn.Layer):
    def __init__(self, config: LlamaConfig | None = None):
        super().__init__()
        config = config or LlamaConfig()
        self.config = config
        self.vocab_size = config.vocab_size
        self.hidden_size = config.hidden_size
        self.intermediate_size = config.intermediate_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.LayerList([DecoderLayer(config) for _ in range(config.num_layers)])
        self.norm = RMSNorm(config.hidden_size)
        self.weight = self.create_parameter(
            shape=[config.hidden_size, config.vocab_size],
            dtype=paddle.get_default_dtype(),
        )
        self.ignore_index = -100
        self.loss_func = paddle.nn.CrossEntropyLoss(reduction="none", ignore_index=self.ignore_index)

    def forward(self, input_ids=None, position_ids=None, attention_mask=None, labels=None):
        batch_size, seq_length = input_ids.shape
        inputs_embeds = self.embed_tokens(input_ids)
        # As in the docstring: the attention_mask argument is ignored (all ones, causal).
        attention_mask = paddle.ones((batch_size, seq_length), dtype=paddle.bool)
        if position_ids is None:
            position_ids = paddle.arange(seq_length, dtype="int64").expand((batch_size, seq_length))
        attention_mask = _prepare_decoder_attention_mask(attention_mask, (batch_size, seq_length), inputs_embeds.dtype)
        hidden_states = inputs_embeds
        for decoder_layer in self.layers:
            hidden_states = decoder_layer(hidden_states, position_ids, attention_mask)
        hidden_states = self.norm(hidden_states)
        logits = paddle.matmul(hidden_states, self.weight)
        loss = None
        if labels is not None:
            masked_lm_loss = self.loss_func(logits.astype("float32"), labels.unsqueeze(2))
            binary_sequence = paddle.where(
                masked_lm_loss > 0,
                paddle.ones_like(masked_lm_loss),
                paddle.zeros_like(masked_lm_loss),
            )
            count = paddle.sum(binary_sequence)
            if count == 0:
                loss = paddle.sum(masked_lm_loss * binary_sequence)
            else:
                loss = paddle.sum(masked_lm_loss * binary_sequence) / count
        return (loss, logits)


def build_model(config: LlamaConfig | None = None, **overrides: int) -> Model:
    """The planner's default factory.

    >>> tiny = build_model(num_layers=2, hidden_size=32, intermediate_size=64,
    ...                    num_heads=4, vocab_size=64, seq_length=16)
    >>> len(tiny.layers)
    2
    """
    if config is None:
        config = LlamaConfig.from_env(**overrides)
    elif overrides:
        config = dataclasses.replace(config, **overrides)
    return Model(config)


def input_spec(config: LlamaConfig | None = None) -> list[paddle.static.InputSpec]:
    """``[InputSpec([4, seq_length], 'int64', 'input_ids')]``, to_distributed's default batch."""
    config = config or LlamaConfig.from_env()
    return [paddle.static.InputSpec([BATCH_SIZE, config.seq_length], "int64", "input_ids")]
