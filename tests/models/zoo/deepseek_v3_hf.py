"""DeepSeek-V3 as HuggingFace transformers writes it (src/transformers/models/deepseek_v3/
modeling_deepseek_v3.py, commit 00b676f), ported line by line to Paddle at a small config shaped
like Moonlight's (one expert group).

Attention is multi-head latent attention: ``q_proj``, a low-rank ``kv_a_proj_with_mqa`` whose
output is split into the latent (``kv_a_layernorm``, then ``kv_b_proj`` up to the heads' keys and
values) and one rotary key shared by every head, interleaved rotary, ``o_proj``.
Feed-forward: dense in the first layer (``first_k_dense_replace=1``), then ``DeepseekV3MoE``: a
sigmoid ``DeepseekV3TopkRouter`` (a raw ``weight`` parameter, a score-correction buffer,
group-limited top-k: each group's top-2 scores summed, the best ``topk_group`` groups kept, then
``topk`` over the experts), the experts run in a loop guarded by ``if token_indices.numel() > 0``,
and a shared expert added for every token.

One spelling differs from torch's: ``F.linear(x, w)`` with torch's ``[out, in]`` weight is
``paddle.matmul(x, w, transpose_y=True)``.

    >>> model = build_model()
    >>> list(model(paddle.randint(0, VOCAB, [2, 8])).shape)
    [2, 8, 64]
"""

import paddle
import paddle.nn as nn
import paddle.nn.functional as F

VOCAB, HIDDEN, LAYERS, HEADS, INTER = 64, 32, 2, 4, 64
EXPERTS, TOP_K, MOE_INTER = 4, 2, 16


class DeepseekV3Config:
    vocab_size = VOCAB
    hidden_size = HIDDEN
    intermediate_size = INTER
    moe_intermediate_size = MOE_INTER
    num_hidden_layers = LAYERS
    num_attention_heads = HEADS
    num_key_value_heads = HEADS
    n_shared_experts = 1
    n_routed_experts = EXPERTS
    routed_scaling_factor = 2.5
    kv_lora_rank = 16
    q_lora_rank = None
    qk_rope_head_dim = 4
    v_head_dim = 8
    qk_nope_head_dim = 8
    qk_head_dim = 12
    n_group = 1
    topk_group = 1
    num_experts_per_tok = TOP_K
    first_k_dense_replace = 1
    norm_topk_prob = True
    hidden_act = "silu"
    rms_norm_eps = 1e-6
    rope_theta = 10000.0
    rope_interleave = True
    attention_bias = False
    attention_dropout = 0.0


ACT2FN = {"silu": F.silu}


class DeepseekV3RMSNorm(nn.Layer):
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


class DeepseekV3RotaryEmbedding(nn.Layer):
    def __init__(self, config):
        super().__init__()
        dim = config.qk_rope_head_dim
        inv_freq = 1.0 / (config.rope_theta ** (paddle.arange(0, dim, 2, dtype="int64").astype("float32") / dim))
        self.register_buffer("inv_freq", inv_freq, persistable=False)
        self.attention_scaling = 1.0

    @paddle.no_grad()
    def forward(self, x, position_ids):
        inv_freq_expanded = self.inv_freq[None, :, None].astype("float32").expand([position_ids.shape[0], -1, 1])
        position_ids_expanded = position_ids[:, None, :].astype("float32")
        freqs = (inv_freq_expanded @ position_ids_expanded).transpose([0, 2, 1])
        emb = paddle.concat((freqs, freqs), axis=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.astype(x.dtype), sin.astype(x.dtype)


class DeepseekV3MLP(nn.Layer):
    def __init__(self, config, hidden_size=None, intermediate_size=None):
        super().__init__()
        self.config = config
        self.hidden_size = config.hidden_size if hidden_size is None else hidden_size
        self.intermediate_size = config.intermediate_size if intermediate_size is None else intermediate_size

        self.gate_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias_attr=False)
        self.up_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias_attr=False)
        self.down_proj = nn.Linear(self.intermediate_size, self.hidden_size, bias_attr=False)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x):
        down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
        return down_proj


class DeepseekV3TopkRouter(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.top_k = config.num_experts_per_tok
        self.n_routed_experts = config.n_routed_experts
        self.routed_scaling_factor = config.routed_scaling_factor
        self.n_group = config.n_group
        self.topk_group = config.topk_group
        self.norm_topk_prob = config.norm_topk_prob

        self.weight = self.create_parameter([self.n_routed_experts, config.hidden_size])
        self.register_buffer("e_score_correction_bias", paddle.zeros([self.n_routed_experts]))

    @paddle.no_grad()
    def get_topk_indices(self, scores):
        scores_for_choice = scores.reshape([-1, self.n_routed_experts]) + self.e_score_correction_bias.unsqueeze(0)
        group_scores = (
            scores_for_choice.reshape([-1, self.n_group, self.n_routed_experts // self.n_group])
            .topk(2, axis=-1)[0]
            .sum(axis=-1)
        )
        group_idx = paddle.topk(group_scores, k=self.topk_group, axis=-1, sorted=False)[1]
        group_mask = paddle.zeros_like(group_scores)
        group_mask.put_along_axis_(group_idx, 1.0, 1)
        score_mask = (
            group_mask.unsqueeze(-1)
            .expand([-1, self.n_group, self.n_routed_experts // self.n_group])
            .reshape([-1, self.n_routed_experts])
        )
        scores_for_choice = scores_for_choice.masked_fill(~score_mask.astype("bool"), 0.0)
        topk_indices = paddle.topk(scores_for_choice, k=self.top_k, axis=-1, sorted=False)[1]
        return topk_indices

    def forward(self, hidden_states):
        hidden_states = hidden_states.reshape([-1, self.config.hidden_size])
        router_logits = paddle.matmul(hidden_states.astype("float32"), self.weight.astype("float32"), transpose_y=True)
        scores = F.sigmoid(router_logits)
        topk_indices = self.get_topk_indices(scores)
        topk_weights = paddle.take_along_axis(scores, topk_indices, 1)
        if self.norm_topk_prob:
            denominator = topk_weights.sum(axis=-1, keepdim=True) + 1e-20
            topk_weights /= denominator
        topk_weights = topk_weights * self.routed_scaling_factor
        return topk_indices, topk_weights


class DeepseekV3MoE(nn.Layer):
    """A mixed expert module containing shared experts."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.experts = nn.LayerList(
            [
                DeepseekV3MLP(config, intermediate_size=config.moe_intermediate_size)
                for _ in range(config.n_routed_experts)
            ]
        )
        self.gate = DeepseekV3TopkRouter(config)
        self.shared_experts = DeepseekV3MLP(
            config=config, intermediate_size=config.moe_intermediate_size * config.n_shared_experts
        )

    def moe(self, hidden_states, topk_indices, topk_weights):
        final_hidden_states = paddle.zeros_like(hidden_states, dtype=topk_weights.dtype)
        expert_mask = F.one_hot(topk_indices, num_classes=len(self.experts))
        expert_mask = expert_mask.transpose([2, 0, 1])

        for expert_idx in range(len(self.experts)):
            expert = self.experts[expert_idx]
            mask = expert_mask[expert_idx]
            token_indices, weight_indices = paddle.where(mask)

            if token_indices.numel() > 0:
                expert_weights = topk_weights[token_indices, weight_indices]
                expert_input = hidden_states[token_indices]
                expert_output = expert(expert_input)
                weighted_output = expert_output * expert_weights.unsqueeze(-1)
                final_hidden_states.index_add_(token_indices, 0, weighted_output)

        # in original deepseek, the output of the experts are gathered once we leave this module
        # thus the moe module is itelsf an IsolatedParallel module
        # and all expert are "local" meaning we shard but we don't gather
        return final_hidden_states.astype(hidden_states.dtype)

    def forward(self, hidden_states):
        residuals = hidden_states
        orig_shape = hidden_states.shape
        topk_indices, topk_weights = self.gate(hidden_states)
        hidden_states = hidden_states.reshape([-1, hidden_states.shape[-1]])
        hidden_states = self.moe(hidden_states, topk_indices, topk_weights).reshape(orig_shape)
        hidden_states = hidden_states + self.shared_experts(residuals)
        return hidden_states


def rotate_half(x):
    """Rotates half the hidden dims of the input."""
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return paddle.concat((-x2, x1), axis=-1)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
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


def apply_rotary_pos_emb_interleave(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)

    b, h, s, d = q.shape
    q = q.reshape([b, h, s, d // 2, 2]).transpose([0, 1, 2, 4, 3]).reshape([b, h, s, d])

    b, h, s, d = k.shape
    k = k.reshape([b, h, s, d // 2, 2]).transpose([0, 1, 2, 4, 3]).reshape([b, h, s, d])

    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed


class DeepseekV3Attention(nn.Layer):
    """Multi-headed attention from 'Attention Is All You Need' paper"""

    def __init__(self, config, layer_idx):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.attention_dropout = config.attention_dropout
        self.num_heads = config.num_attention_heads
        self.q_lora_rank = config.q_lora_rank
        self.qk_rope_head_dim = config.qk_rope_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.v_head_dim = config.v_head_dim
        self.qk_nope_head_dim = config.qk_nope_head_dim
        self.qk_head_dim = config.qk_head_dim

        self.is_causal = True
        if self.q_lora_rank is None:
            self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.qk_head_dim, bias_attr=False)
        else:
            self.q_a_proj = nn.Linear(config.hidden_size, config.q_lora_rank, bias_attr=config.attention_bias)
            self.q_a_layernorm = DeepseekV3RMSNorm(config.q_lora_rank)
            self.q_b_proj = nn.Linear(config.q_lora_rank, self.num_heads * self.qk_head_dim, bias_attr=False)

        bias = None if config.attention_bias else False
        self.kv_a_proj_with_mqa = nn.Linear(
            config.hidden_size, self.kv_lora_rank + self.qk_rope_head_dim, bias_attr=bias
        )
        self.kv_a_layernorm = DeepseekV3RMSNorm(self.kv_lora_rank)
        self.kv_b_proj = nn.Linear(
            self.kv_lora_rank, self.num_heads * (self.qk_nope_head_dim + self.v_head_dim), bias_attr=False
        )

        self.o_proj = nn.Linear(self.num_heads * self.v_head_dim, config.hidden_size, bias_attr=bias)

        self.scaling = self.qk_head_dim ** (-0.5)

    def forward(self, hidden_states, position_embeddings, attention_mask):
        batch_size, seq_length = hidden_states.shape[:-1]
        query_shape = (batch_size, seq_length, -1, self.qk_head_dim)
        key_shape = (batch_size, seq_length, -1, self.qk_nope_head_dim + self.v_head_dim)

        if self.q_lora_rank is None:
            q_states = self.q_proj(hidden_states)
        else:
            q_states = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
        q_states = q_states.reshape(query_shape).transpose([0, 2, 1, 3])
        q_pass, q_rot = paddle.split(q_states, [self.qk_nope_head_dim, self.qk_rope_head_dim], axis=-1)

        compressed_kv = self.kv_a_proj_with_mqa(hidden_states)
        k_pass, k_rot = paddle.split(compressed_kv, [self.kv_lora_rank, self.qk_rope_head_dim], axis=-1)

        k_pass = self.kv_b_proj(self.kv_a_layernorm(k_pass)).reshape(key_shape).transpose([0, 2, 1, 3])
        k_pass, value_states = paddle.split(k_pass, [self.qk_nope_head_dim, self.v_head_dim], axis=-1)

        k_rot = k_rot.reshape([batch_size, 1, seq_length, self.qk_rope_head_dim])

        cos, sin = position_embeddings
        if self.config.rope_interleave:  # support using interleaved weights for efficiency
            q_rot, k_rot = apply_rotary_pos_emb_interleave(q_rot, k_rot, cos, sin)
        else:
            q_rot, k_rot = apply_rotary_pos_emb(q_rot, k_rot, cos, sin)
        k_rot = k_rot.expand([*k_pass.shape[:-1], -1])

        query_states = paddle.concat((q_pass, q_rot), axis=-1)
        key_states = paddle.concat((k_pass, k_rot), axis=-1)

        attn_output, attn_weights = eager_attention_forward(
            self,
            query_states,
            key_states,
            value_states,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
        )

        attn_output = attn_output.reshape([batch_size, seq_length, -1])
        attn_output = self.o_proj(attn_output)
        return attn_output, attn_weights


class DeepseekV3DecoderLayer(nn.Layer):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.hidden_size = config.hidden_size

        self.self_attn = DeepseekV3Attention(config=config, layer_idx=layer_idx)

        if layer_idx >= config.first_k_dense_replace:
            self.mlp = DeepseekV3MoE(config)
        else:
            self.mlp = DeepseekV3MLP(config)

        self.input_layernorm = DeepseekV3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = DeepseekV3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, attention_mask=None, position_embeddings=None):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        # Self Attention
        hidden_states, _ = self.self_attn(
            hidden_states=hidden_states, attention_mask=attention_mask, position_embeddings=position_embeddings
        )
        hidden_states = residual + hidden_states

        # Fully Connected
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        hidden_states = residual + hidden_states
        return hidden_states


def create_causal_mask(input_embeds):
    """What transformers' masking_utils gives eager attention without padding: a
    ``[batch, 1, q, kv]`` float mask, 0 where a query may attend and the dtype's minimum above
    the diagonal."""
    batch, seq = input_embeds.shape[0], input_embeds.shape[1]
    min_value = paddle.finfo(input_embeds.dtype).min
    mask = paddle.triu(paddle.full([seq, seq], min_value, dtype=input_embeds.dtype), diagonal=1)
    return mask[None, None].expand([batch, 1, seq, seq])


class DeepseekV3Model(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.vocab_size = config.vocab_size

        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.LayerList(
            [DeepseekV3DecoderLayer(config, layer_idx) for layer_idx in range(config.num_hidden_layers)]
        )
        self.norm = DeepseekV3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = DeepseekV3RotaryEmbedding(config=config)

    def forward(self, input_ids):
        inputs_embeds = self.embed_tokens(input_ids)
        cache_position = paddle.arange(0, inputs_embeds.shape[1])
        position_ids = cache_position.unsqueeze(0)
        causal_mask = create_causal_mask(inputs_embeds)

        hidden_states = inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids)

        for decoder_layer in self.layers[: self.config.num_hidden_layers]:
            hidden_states = decoder_layer(
                hidden_states, attention_mask=causal_mask, position_embeddings=position_embeddings
            )

        hidden_states = self.norm(hidden_states)
        return hidden_states


class DeepseekV3ForCausalLM(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.model = DeepseekV3Model(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias_attr=False)

    def forward(self, input_ids):
        hidden_states = self.model(input_ids)
        return self.lm_head(hidden_states)


def build_model():
    return DeepseekV3ForCausalLM(DeepseekV3Config())


class DeepseekV3QueryLatentConfig(DeepseekV3Config):
    """DeepSeek-V3's own shape (Moonlight has none): the query through a latent too, ``q_a_proj``
    -> ``q_a_layernorm`` -> ``q_b_proj``, of a rank no other size equals."""

    q_lora_rank = 24


def build_with_query_latent():
    return DeepseekV3ForCausalLM(DeepseekV3QueryLatentConfig())


def input_spec():
    return [paddle.static.InputSpec([2, 8], "int64", "input_ids")]


def loss(model, tokens, labels):
    return F.cross_entropy(model(tokens).reshape([-1, VOCAB]), labels.reshape([-1]))
