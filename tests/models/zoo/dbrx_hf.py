"""DBRX as HuggingFace transformers writes it (src/transformers/models/dbrx/modeling_dbrx.py,
``DbrxForCausalLM``), ported to Paddle at a small config.

Config objects as DBRX nests them (``attn_config``, ``ffn_config``). Each block is
``norm_attn_norm`` (bias-free LayerNorm, attention, residual, a second LayerNorm returning the
residual beside the normed state) and ``ffn`` (router and experts). Attention: one fused
``Wqkv`` of ``d_model + 2 * kv_n_heads * head_dim`` columns clamped to ``[-clip_qkv,
clip_qkv]``, split into q, k, v (grouped-query: 2 KV heads of 4), ``.view(bsz, q_len, heads,
head_dim).transpose(1, 2)``, a rotary layer inside the attention, ``repeat_kv``, eager scores
divided by ``sqrt(head_dim)`` plus an additive causal mask, ``out_proj``. MoE: ``DbrxRouter``
(softmax in float32, ``topk``, top weights divided by their p-norm), ``DbrxExperts`` holding its
experts as ``DbrxExpertGLU``'s batched weights ``w1``, ``v1``, ``w2`` of ``[experts * ffn,
d_model]``, viewed ``[experts, ffn, d_model]`` and chunked per expert, looping over the experts
with ``where(expert_mask[expert_idx])``, a ``continue`` for an expert no token chose, and
``index_add_`` of each expert's weighted output. Sizes: batch 3, sequence 7, 4 heads of 10,
width 40, 3 experts of 24 (top 2): no two equal.
"""

import math

import paddle
import paddle.nn as nn
import paddle.nn.functional as F

VOCAB, SEQ = 96, 7


class DbrxAttentionConfig:
    attn_pdrop = 0.0
    clip_qkv = 8.0
    kv_n_heads = 2
    rope_theta = 10000.0


class DbrxFFNConfig:
    ffn_act_fn = {"name": "silu"}
    ffn_hidden_size = 24
    moe_num_experts = 3
    moe_top_k = 2
    moe_jitter_eps = None
    moe_loss_weight = 0.01
    moe_normalize_expert_weights = 1


class DbrxConfig:
    d_model = 40
    n_heads = 4
    n_layers = 2
    max_seq_len = 64
    vocab_size = VOCAB
    resid_pdrop = 0.0
    emb_pdrop = 0.0
    pad_token_id = None
    attn_config = DbrxAttentionConfig()
    ffn_config = DbrxFFNConfig()


class DbrxRotaryEmbedding(nn.Layer):
    def __init__(self, dim, max_position_embeddings=2048, base=10000):
        super().__init__()
        self.dim = dim
        self.max_position_embeddings = max_position_embeddings
        self.base = base
        inv_freq = 1.0 / (self.base ** (paddle.arange(0, self.dim, 2, dtype="int64").astype("float32") / self.dim))
        self.register_buffer("inv_freq", inv_freq, persistable=False)

    @paddle.no_grad()
    def forward(self, x, position_ids, seq_len=None):
        # x: [bs, num_attention_heads, seq_len, head_size]
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


def repeat_kv(hidden_states, n_rep):
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand([batch, num_key_value_heads, n_rep, slen, head_dim])
    return hidden_states.reshape([batch, num_key_value_heads * n_rep, slen, head_dim])


class DbrxAttention(nn.Layer):
    """Multi-head self attention."""

    def __init__(self, config, block_idx=None):
        super().__init__()
        self.config = config
        self.hidden_size = config.d_model
        self.num_heads = config.n_heads
        self.head_dim = self.hidden_size // self.num_heads
        self.max_position_embeddings = config.max_seq_len
        self.block_idx = block_idx

        attn_config = config.attn_config
        self.attn_pdrop = attn_config.attn_pdrop
        self.clip_qkv = attn_config.clip_qkv
        self.num_key_value_heads = attn_config.kv_n_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.rope_theta = attn_config.rope_theta
        self.is_causal = True

        self.Wqkv = nn.Linear(
            self.hidden_size, self.hidden_size + 2 * self.num_key_value_heads * self.head_dim, bias_attr=False
        )
        self.out_proj = nn.Linear(self.hidden_size, self.hidden_size, bias_attr=False)
        self.rotary_emb = DbrxRotaryEmbedding(
            self.head_dim,
            max_position_embeddings=self.max_position_embeddings,
            base=self.rope_theta,
        )

    def forward(self, hidden_states, position_ids, attention_mask=None, **kwargs):
        bsz, q_len, _ = hidden_states.shape

        qkv_states = self.Wqkv(hidden_states)
        min_val = -self.clip_qkv if self.clip_qkv is not None else None
        max_val = self.clip_qkv
        qkv_states = qkv_states.clip(min=min_val, max=max_val)

        query_states, key_states, value_states = qkv_states.split(
            [
                self.hidden_size,
                self.num_key_value_heads * self.head_dim,
                self.num_key_value_heads * self.head_dim,
            ],
            axis=2,
        )

        query_states = query_states.reshape([bsz, q_len, self.num_heads, self.head_dim]).transpose([0, 2, 1, 3])
        key_states = key_states.reshape([bsz, q_len, self.num_key_value_heads, self.head_dim]).transpose([0, 2, 1, 3])
        value_states = value_states.reshape([bsz, q_len, self.num_key_value_heads, self.head_dim]).transpose(
            [0, 2, 1, 3]
        )

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
        attn_weights = F.dropout(attn_weights, p=self.attn_pdrop, training=self.training)
        attn_output = paddle.matmul(attn_weights, value_states)

        attn_output = attn_output.transpose([0, 2, 1, 3])
        attn_output = attn_output.reshape([bsz, q_len, self.hidden_size])
        attn_output = self.out_proj(attn_output)
        return attn_output, attn_weights


class DbrxNormAttentionNorm(nn.Layer):
    def __init__(self, config, block_idx=None):
        super().__init__()
        self.block_idx = block_idx
        self.resid_pdrop = config.resid_pdrop
        self.norm_1 = nn.LayerNorm(config.d_model, bias_attr=False)
        self.attn = DbrxAttention(config=config, block_idx=block_idx)
        self.norm_2 = nn.LayerNorm(config.d_model, bias_attr=False)

    def forward(self, hidden_states, position_ids, attention_mask=None, **kwargs):
        residual_states = hidden_states
        hidden_states = self.norm_1(hidden_states).astype(hidden_states.dtype)

        hidden_states, attn_weights = self.attn(
            hidden_states=hidden_states,
            attention_mask=attention_mask,
            position_ids=position_ids,
        )

        hidden_states = F.dropout(hidden_states, p=self.resid_pdrop, training=self.training)
        hidden_states = hidden_states + residual_states

        residual_states = hidden_states
        hidden_states = self.norm_2(hidden_states).astype(hidden_states.dtype)

        return residual_states, hidden_states, attn_weights


class DbrxRouter(nn.Layer):
    def __init__(self, hidden_size, moe_num_experts, moe_top_k, moe_jitter_eps, moe_normalize_expert_weights):
        super().__init__()
        self.hidden_size = hidden_size
        self.moe_num_experts = moe_num_experts
        self.moe_top_k = moe_top_k
        self.moe_jitter_eps = moe_jitter_eps
        self.moe_normalize_expert_weights = moe_normalize_expert_weights

        self.layer = nn.Linear(self.hidden_size, self.moe_num_experts, bias_attr=False)

    def forward(self, hidden_states):
        if self.training and self.moe_jitter_eps is not None:
            hidden_states *= paddle.uniform(
                hidden_states.shape, min=1.0 - self.moe_jitter_eps, max=1.0 + self.moe_jitter_eps
            )
        hidden_states = hidden_states.reshape([-1, hidden_states.shape[-1]])
        weights = F.softmax(self.layer(hidden_states), axis=-1, dtype="float32")
        top_weights, top_experts = paddle.topk(weights, self.moe_top_k, axis=-1)

        top_weights_scale = (
            paddle.norm(top_weights, p=self.moe_normalize_expert_weights, axis=-1, keepdim=True)
            if self.moe_normalize_expert_weights is not None
            else 1.0
        )
        top_weights = top_weights / top_weights_scale

        weights = weights.astype(hidden_states.dtype)
        top_weights = top_weights.astype(hidden_states.dtype)
        return weights, top_weights, top_experts


class DbrxExpertGLU(nn.Layer):
    def __init__(self, hidden_size, ffn_hidden_size, moe_num_experts, ffn_act_fn):
        super().__init__()
        self.hidden_size = hidden_size
        self.ffn_hidden_size = ffn_hidden_size
        self.moe_num_experts = moe_num_experts

        init = nn.initializer.Normal(std=0.02)
        self.w1 = self.create_parameter([moe_num_experts * ffn_hidden_size, hidden_size], default_initializer=init)
        self.v1 = self.create_parameter([moe_num_experts * ffn_hidden_size, hidden_size], default_initializer=init)
        self.w2 = self.create_parameter([moe_num_experts * ffn_hidden_size, hidden_size], default_initializer=init)

        act_fn_name = ffn_act_fn.get("name", "silu")
        self.activation_fn = getattr(F, act_fn_name)

    def forward(self, x, expert_w1, expert_v1, expert_w2):
        gate_proj = x.matmul(expert_w1.t())
        up_proj = x.matmul(expert_v1.t())
        gate_proj = self.activation_fn(gate_proj)
        intermediate_states = gate_proj * up_proj
        down_proj = intermediate_states.matmul(expert_w2)
        return down_proj


class DbrxExperts(nn.Layer):
    def __init__(self, hidden_size, ffn_hidden_size, moe_num_experts, ffn_act_fn):
        super().__init__()
        self.moe_num_experts = moe_num_experts
        self.mlp = DbrxExpertGLU(
            hidden_size=hidden_size,
            ffn_hidden_size=ffn_hidden_size,
            moe_num_experts=moe_num_experts,
            ffn_act_fn=ffn_act_fn,
        )

    def forward(self, x, weights, top_weights, top_experts):
        bsz, q_len, hidden_size = x.shape
        x = x.reshape([-1, hidden_size])
        out = paddle.zeros_like(x)

        expert_mask = F.one_hot(top_experts, num_classes=self.moe_num_experts).transpose([2, 1, 0])
        # Chunk experts at once to avoid storing full parameter multiple times in autograd
        w1_chunked = self.mlp.w1.reshape(
            [self.mlp.moe_num_experts, self.mlp.ffn_hidden_size, self.mlp.hidden_size]
        ).chunk(self.moe_num_experts, axis=0)
        v1_chunked = self.mlp.v1.reshape(
            [self.mlp.moe_num_experts, self.mlp.ffn_hidden_size, self.mlp.hidden_size]
        ).chunk(self.moe_num_experts, axis=0)
        w2_chunked = self.mlp.w2.reshape(
            [self.mlp.moe_num_experts, self.mlp.ffn_hidden_size, self.mlp.hidden_size]
        ).chunk(self.moe_num_experts, axis=0)
        w1_chunked = [w1.squeeze(axis=0) for w1 in w1_chunked]
        v1_chunked = [v1.squeeze(axis=0) for v1 in v1_chunked]
        w2_chunked = [w2.squeeze(axis=0) for w2 in w2_chunked]
        for expert_idx in range(0, self.moe_num_experts):
            topk_idx, token_idx = paddle.where(expert_mask[expert_idx])
            if token_idx.shape[0] == 0:
                continue

            token_list = token_idx.squeeze(-1)
            topk_list = topk_idx.squeeze(-1)

            expert_tokens = x[token_list].reshape([-1, hidden_size])
            expert_out = (
                self.mlp(expert_tokens, w1_chunked[expert_idx], v1_chunked[expert_idx], w2_chunked[expert_idx])
                * top_weights[token_list, topk_list, None]
            )

            out = paddle.index_add(out, token_list, 0, expert_out)

        out = out.reshape([bsz, q_len, hidden_size])
        return out


class DbrxFFN(nn.Layer):
    def __init__(self, config):
        super().__init__()
        ffn_config = config.ffn_config
        self.router = DbrxRouter(
            hidden_size=config.d_model,
            moe_num_experts=ffn_config.moe_num_experts,
            moe_top_k=ffn_config.moe_top_k,
            moe_jitter_eps=ffn_config.moe_jitter_eps,
            moe_normalize_expert_weights=ffn_config.moe_normalize_expert_weights,
        )
        self.experts = DbrxExperts(
            hidden_size=config.d_model,
            ffn_hidden_size=ffn_config.ffn_hidden_size,
            moe_num_experts=ffn_config.moe_num_experts,
            ffn_act_fn=ffn_config.ffn_act_fn,
        )

    def forward(self, x):
        weights, top_weights, top_experts = self.router(x)
        out = self.experts(x, weights, top_weights, top_experts)
        return out, weights


class DbrxBlock(nn.Layer):
    def __init__(self, config, block_idx):
        super().__init__()
        self.hidden_size = config.d_model
        self.resid_pdrop = config.resid_pdrop
        self.block_idx = block_idx
        self.norm_attn_norm = DbrxNormAttentionNorm(config=config, block_idx=block_idx)
        self.ffn = DbrxFFN(config=config)

    def forward(self, hidden_states, attention_mask=None, position_ids=None, **kwargs):
        resid_states, hidden_states, self_attn_weights = self.norm_attn_norm(
            hidden_states=hidden_states,
            attention_mask=attention_mask,
            position_ids=position_ids,
        )

        hidden_states, router_logits = self.ffn(hidden_states)
        hidden_states = F.dropout(hidden_states, p=self.resid_pdrop, training=self.training)
        hidden_states = resid_states + hidden_states
        return (hidden_states,)


class DbrxModel(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.emb_pdrop = config.emb_pdrop

        self.wte = nn.Embedding(config.vocab_size, config.d_model, self.padding_idx)
        self.blocks = nn.LayerList([DbrxBlock(config, block_idx) for block_idx in range(config.n_layers)])
        self.norm_f = nn.LayerNorm(config.d_model, bias_attr=False)

    def forward(self, input_ids=None, position_ids=None):
        inputs_embeds = self.wte(input_ids)
        inputs_embeds = F.dropout(inputs_embeds, p=self.emb_pdrop, training=self.training)

        if position_ids is None:
            position_ids = paddle.arange(inputs_embeds.shape[1]).unsqueeze(0)

        seq_length = inputs_embeds.shape[1]
        min_dtype = paddle.finfo(inputs_embeds.dtype).min
        causal_mask = paddle.full([seq_length, seq_length], min_dtype, inputs_embeds.dtype)
        causal_mask = paddle.triu(causal_mask, diagonal=1)[None, None, :, :]

        hidden_states = inputs_embeds
        for block in self.blocks:
            block_outputs = block(hidden_states, attention_mask=causal_mask, position_ids=position_ids)
            hidden_states = block_outputs[0]

        return self.norm_f(hidden_states)


class DbrxForCausalLM(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.transformer = DbrxModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias_attr=False)

    def forward(self, input_ids=None, labels=None):
        hidden_states = self.transformer(input_ids=input_ids)
        logits = self.lm_head(hidden_states)
        if labels is None:
            return logits
        return F.cross_entropy(logits.reshape([-1, self.vocab_size]), labels.reshape([-1]))


def build_model():
    return DbrxForCausalLM(DbrxConfig())


def input_spec():
    return [paddle.static.InputSpec([3, SEQ], "int64", "input_ids")]


def loss(model, tokens, labels):
    return model(input_ids=tokens, labels=labels)
