"""Ling (inclusionAI's BailingMoe: Ling-lite, Ling-plus) as its Hugging Face remote code writes it
(inclusionAI/Ling, ``models/modeling_bailing_moe.py``), ported to Paddle at a small config: the
eager attention and the training path of the MoE block; no cache.

Attention projects q, k and v with one fused ``query_key_value`` Linear, viewed as
``[batch, seq, heads + 2 * kv_heads, head_dim]`` and split on the head axis (grouped-query),
rotary from a cached ``cos``/``sin`` table indexed by ``position_ids`` inside the attention,
size checks against ``self.num_heads``, ``dense`` out; it returns ``(output, None, None)``. The
feed-forward is ``BailingMoeSparseMoeBlock``: a softmax gate (a raw ``weight`` parameter,
``topk``, the top-k weights renormalised), the tokens repeated ``num_experts_per_tok`` times and
each expert's rows written through a boolean mask (``y[flat_topk_idx == i] = expert(...)``),
the top-k outputs weighted and summed, and a shared expert added for every token. The block
returns ``(y, (router_logits, topk_idx))`` and the decoder layer keeps ``y``.

Hugging Face's DBRX (fused ``Wqkv``) was the first choice of a fused-q|k|v MoE; its experts are
batched weights (``DbrxExpertGLU``'s ``w1``, ``v1``, ``w2`` of ``[experts * ffn, d_model]``), not
numbered layers, which expert recognition does not take (docs/recognition.md). Ling 2.0
(BailingMoeV2) adds per-head q/k norms, whose weights a local view does not take yet.

Its RMSNorm, rotary helpers, ``repeat_kv`` and gated MLP are the remote code's copies of Llama's
and DeepSeek's (what ``duplicates`` lists against the other HF ports), kept so the file stands
alone as the remote code's does.

Spellings that differ from torch's: ``F.linear(x, w)`` with torch's ``[out, in]`` weight is
``paddle.matmul(x, w, transpose_y=True)``; ``.view`` is ``.reshape``.

    >>> model = build_model()
    >>> list(model(paddle.randint(0, VOCAB, [2, 8])).shape)
    [2, 8, 64]
"""

import math

import paddle
import paddle.nn as nn
import paddle.nn.functional as F

VOCAB, HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 64, 48, 2, 4, 2, 12
EXPERTS, TOP_K, MOE_INTER, MAX_POSITIONS = 6, 2, 20, 32


class BailingMoeConfig:
    vocab_size = VOCAB
    hidden_size = HIDDEN
    num_hidden_layers = LAYERS
    num_attention_heads = HEADS
    num_key_value_heads = KV_HEADS
    head_dim = HEAD_DIM
    hidden_act = "silu"
    use_qkv_bias = False
    use_bias = False
    rms_norm_eps = 1e-6
    attention_dropout = 0.0
    max_position_embeddings = MAX_POSITIONS
    rope_theta = 600000.0
    num_experts = EXPERTS
    num_shared_experts = 1
    num_experts_per_tok = TOP_K
    norm_topk_prob = True
    moe_intermediate_size = MOE_INTER
    first_k_dense_replace = 0


ACT2FN = {"silu": F.silu}


class BailingMoeRMSNorm(nn.Layer):
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


class BailingMoeRotaryEmbedding(nn.Layer):
    def __init__(self, dim, max_position_embeddings=2048, base=10000):
        super().__init__()
        self.dim = dim
        self.max_position_embeddings = max_position_embeddings
        self.base = base
        inv_freq = 1.0 / (self.base ** (paddle.arange(0, self.dim, 2).astype("float32") / self.dim))
        self.register_buffer("inv_freq", inv_freq, persistable=False)
        self._set_cos_sin_cache(seq_len=max_position_embeddings, dtype=paddle.get_default_dtype())

    def _set_cos_sin_cache(self, seq_len, dtype):
        self.max_seq_len_cached = seq_len
        t = paddle.arange(self.max_seq_len_cached, dtype=self.inv_freq.dtype)
        freqs = paddle.outer(t, self.inv_freq)
        emb = paddle.concat((freqs, freqs), axis=-1)
        self.register_buffer("cos_cached", emb.cos().astype(dtype), persistable=False)
        self.register_buffer("sin_cached", emb.sin().astype(dtype), persistable=False)

    def forward(self, x, seq_len=None):
        return self.cos_cached[:seq_len].astype(x.dtype), self.sin_cached[:seq_len].astype(x.dtype)


def rotate_half(x):
    """Rotates half the hidden dims of the input."""
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return paddle.concat((-x2, x1), axis=-1)


def apply_rotary_pos_emb(q, k, cos, sin, position_ids, unsqueeze_dim=1):
    cos = cos[position_ids].unsqueeze(unsqueeze_dim)
    sin = sin[position_ids].unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed


class BailingMoeMLP(nn.Layer):
    def __init__(self, config, intermediate_size):
        super().__init__()
        self.config = config
        self.hidden_size = config.hidden_size
        self.intermediate_size = intermediate_size
        self.gate_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias_attr=False)
        self.up_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias_attr=False)
        self.down_proj = nn.Linear(self.intermediate_size, self.hidden_size, bias_attr=False)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class BailingMoeGate(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.top_k = config.num_experts_per_tok
        self.num_experts = config.num_experts
        # topk selection algorithm
        self.norm_topk_prob = config.norm_topk_prob
        self.gating_dim = config.hidden_size
        bound = 1.0 / math.sqrt(self.gating_dim)  # kaiming_uniform_(a=sqrt(5))
        self.weight = self.create_parameter(
            [self.num_experts, self.gating_dim], default_initializer=nn.initializer.Uniform(-bound, bound)
        )

    def forward(self, hidden_states, sort=False):
        bsz, seq_len, h = hidden_states.shape
        # compute gating score
        hidden_states = hidden_states.reshape([-1, h])
        logits = paddle.matmul(hidden_states, self.weight, transpose_y=True)
        scores = F.softmax(logits, axis=-1, dtype="float32")
        # select top-k experts
        topk_weight, topk_idx = paddle.topk(scores, k=self.top_k, axis=-1, sorted=sort)
        # norm gate to sum 1
        if self.top_k > 1 and self.norm_topk_prob:
            denominator = topk_weight.sum(axis=-1, keepdim=True)
            topk_weight = topk_weight / denominator
        return topk_idx, topk_weight, logits


class BailingMoeSparseMoeBlock(nn.Layer):
    """A mixed expert module containing shared experts."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.num_experts_per_tok = config.num_experts_per_tok
        self._setup_experts()
        self.gate = BailingMoeGate(config)
        if config.num_shared_experts is not None:
            self.shared_experts = BailingMoeMLP(
                config=config, intermediate_size=config.moe_intermediate_size * config.num_shared_experts
            )

    def _setup_experts(self):
        self.experts = nn.LayerList(
            [
                BailingMoeMLP(config=self.config, intermediate_size=self.config.moe_intermediate_size)
                for _ in range(self.config.num_experts)
            ]
        )

    def forward(self, hidden_states):
        identity = hidden_states
        bsz, seq_len, h = hidden_states.shape
        topk_idx, topk_weight, router_logits = self.gate(hidden_states)
        hidden_states = hidden_states.reshape([-1, hidden_states.shape[-1]])
        flat_topk_idx = topk_idx.reshape([-1])
        hidden_states = hidden_states.repeat_interleave(self.num_experts_per_tok, axis=0)
        y = paddle.empty_like(hidden_states)
        for i, expert in enumerate(self.experts):
            y[flat_topk_idx == i] = expert(hidden_states[flat_topk_idx == i])
        y = (y.reshape([*topk_weight.shape, -1]) * topk_weight.unsqueeze(-1)).sum(axis=1)
        y = y.astype(hidden_states.dtype).reshape([bsz, seq_len, h])
        if self.config.num_shared_experts is not None:
            y = y + self.shared_experts(identity)
        return y, (router_logits.reshape([bsz, seq_len, -1]), topk_idx.reshape([bsz, seq_len, -1]))


def repeat_kv(hidden_states, n_rep):
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand([batch, num_key_value_heads, n_rep, slen, head_dim])
    return hidden_states.reshape([batch, num_key_value_heads * n_rep, slen, head_dim])


class BailingMoeAttention(nn.Layer):
    """Multi-headed attention from 'Attention Is All You Need' paper"""

    def __init__(self, config, layer_idx):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.attention_dropout = config.attention_dropout
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = config.head_dim or self.hidden_size // self.num_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.max_position_embeddings = config.max_position_embeddings
        self.rope_theta = config.rope_theta
        self.is_causal = True
        self.query_key_value = nn.Linear(
            self.hidden_size,
            (self.num_heads + 2 * self.num_key_value_heads) * self.head_dim,
            bias_attr=None if config.use_qkv_bias else False,
        )
        self.dense = nn.Linear(
            self.num_heads * self.head_dim, self.hidden_size, bias_attr=None if config.use_bias else False
        )
        self.rotary_emb = BailingMoeRotaryEmbedding(
            self.head_dim, max_position_embeddings=self.max_position_embeddings, base=self.rope_theta
        )

    def forward(self, hidden_states, attention_mask=None, position_ids=None):
        bsz, q_len, _ = hidden_states.shape
        qkv = self.query_key_value(hidden_states)
        qkv = qkv.reshape([bsz, q_len, self.num_heads + 2 * self.num_key_value_heads, self.head_dim])
        query_states, key_states, value_states = qkv.split(
            [self.num_heads, self.num_key_value_heads, self.num_key_value_heads], axis=-2
        )
        query_states = query_states.transpose([0, 2, 1, 3])
        key_states = key_states.transpose([0, 2, 1, 3])
        value_states = value_states.transpose([0, 2, 1, 3])
        kv_seq_len = key_states.shape[-2]
        cos, sin = self.rotary_emb(value_states, seq_len=kv_seq_len)
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin, position_ids)
        key_states = repeat_kv(key_states, self.num_key_value_groups)
        value_states = repeat_kv(value_states, self.num_key_value_groups)
        attn_weights = paddle.matmul(query_states / math.sqrt(self.head_dim), key_states.transpose([0, 1, 3, 2]))
        if attn_weights.shape != [bsz, self.num_heads, q_len, kv_seq_len]:
            raise ValueError(
                f"Attention weights should be of size {(bsz, self.num_heads, q_len, kv_seq_len)}, but is"
                f" {attn_weights.shape}"
            )
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask
        attn_weights = F.softmax(attn_weights, axis=-1, dtype="float32").astype(query_states.dtype)
        attn_weights = F.dropout(attn_weights, p=self.attention_dropout, training=self.training)
        attn_output = paddle.matmul(attn_weights, value_states)
        attn_output = attn_output.transpose([0, 2, 1, 3])
        attn_output = attn_output.reshape([bsz, q_len, -1])
        attn_output = self.dense(attn_output)
        return attn_output, None, None


class BailingMoeDecoderLayer(nn.Layer):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.attention = BailingMoeAttention(config=config, layer_idx=layer_idx)
        self.mlp = (
            BailingMoeSparseMoeBlock(config)
            if (config.num_experts is not None and layer_idx >= config.first_k_dense_replace)
            else BailingMoeMLP(config=config, intermediate_size=config.intermediate_size)
        )
        self.input_layernorm = BailingMoeRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = BailingMoeRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, attention_mask=None, position_ids=None):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, self_attn_weights, present_key_value = self.attention(
            hidden_states=hidden_states, attention_mask=attention_mask, position_ids=position_ids
        )
        hidden_states = residual + hidden_states
        # Fully Connected
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        if isinstance(hidden_states, tuple):
            hidden_states, router_logits = hidden_states
        return residual + hidden_states


class BailingMoeModel(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.LayerList(
            [BailingMoeDecoderLayer(config, layer_idx) for layer_idx in range(config.num_hidden_layers)]
        )
        self.norm = BailingMoeRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, input_ids):
        inputs_embeds = self.word_embeddings(input_ids)
        seq_length = input_ids.shape[1]
        position_ids = paddle.arange(seq_length, dtype="int64").unsqueeze(0)
        # _prepare_4d_causal_attention_mask without padding: -inf above the diagonal
        attention_mask = paddle.triu(paddle.full([seq_length, seq_length], float("-inf")), diagonal=1)[None, None]
        hidden_states = inputs_embeds
        for decoder_layer in self.layers:
            hidden_states = decoder_layer(hidden_states, attention_mask=attention_mask, position_ids=position_ids)
        return self.norm(hidden_states)


class BailingMoeForCausalLM(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.model = BailingMoeModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias_attr=False)

    def forward(self, input_ids):
        return self.lm_head(self.model(input_ids))


def build_model():
    return BailingMoeForCausalLM(BailingMoeConfig())


def input_spec():
    return [paddle.static.InputSpec([2, 8], "int64", "input_ids")]


def loss(model, tokens, labels):
    return F.cross_entropy(model(tokens).reshape([-1, VOCAB]), labels.reshape([-1]))
