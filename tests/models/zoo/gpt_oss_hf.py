"""GPT-OSS as HuggingFace transformers writes it (src/transformers/models/gpt_oss/
modeling_gpt_oss.py), ported to Paddle at a small config.

Attention: biased ``q_proj``/``k_proj``/``v_proj``/``o_proj``, grouped-query (``repeat_kv``),
rotary by GPT-OSS's own ``_apply_rotary_emb`` (the head's halves rotated against a table of half
the head dim), and *attention sinks*: a learned ``sinks`` parameter, one logit per head,
reshaped to ``[1, heads, 1, 1]``, expanded and concatenated to the scores as an extra key column,
the row max subtracted, softmax, and the sink column dropped (``probs[..., :-1]``). Layers
alternate sliding-window and full attention (``layer_types``), each taking its mask from a dict
the model builds once. MoE feed-forward: ``GptOssTopKRouter`` (a ``weight`` and ``bias`` read
by ``F.linear``, top-k, softmax over the chosen, scattered back into dense scores) and
``GptOssExperts``, the experts' weights as 3-D parameters (``gate_up_proj [E, H, 2D]`` with gate
and up interleaved, read ``[..., ::2]`` and ``[..., 1::2]``; clamped, ``gate * sigmoid(alpha *
gate) * (up + 1)``; ``down_proj [E, D, H]``), run on CPU the way HF runs them there and in
training: a loop over the experts that got tokens (``expert_hit``), each gathering its tokens and
``index_add_``-ing its weighted output back.

What differs from the torch code is spelling (``reshape`` for ``view``, ``transpose`` with the
whole permutation, ``axis`` for ``dim``; Paddle's ``x[None, index]`` reads as ``x[index]`` with the
new axis after it, so none is written; ``paddle.where(cond)`` for ``torch.where(cond)``); YaRN
rope scaling, caches, the batched inference path and the router's auxiliary loss are left out.

    >>> model = build_model()
    >>> list(model(paddle.randint(0, VOCAB, [2, 10])).shape)
    [2, 10, 90]
"""

import paddle
import paddle.nn as nn
import paddle.nn.functional as F

VOCAB, SEQ = 90, 10


class GptOssConfig:
    vocab_size = VOCAB
    hidden_size = 40
    intermediate_size = 24
    num_hidden_layers = 2
    num_attention_heads = 4
    num_key_value_heads = 2
    head_dim = 12
    num_local_experts = 4
    num_experts_per_tok = 2
    sliding_window = 4
    layer_types = ["sliding_attention", "full_attention"]
    rms_norm_eps = 1e-5
    rope_theta = 150000.0
    attention_dropout = 0.0
    swiglu_limit = 7.0


class GptOssRMSNorm(nn.Layer):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = self.create_parameter([hidden_size], default_initializer=nn.initializer.Constant(1.0))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.astype("float32")
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * paddle.rsqrt(variance + self.variance_epsilon)
        return (self.weight * hidden_states).astype(input_dtype)


class GptOssExperts(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.num_experts = config.num_local_experts
        self.hidden_size = config.hidden_size
        self.expert_dim = self.intermediate_size
        init = nn.initializer.Normal(std=0.02)
        self.gate_up_proj = self.create_parameter(
            [self.num_experts, self.hidden_size, 2 * self.expert_dim], default_initializer=init
        )
        self.gate_up_proj_bias = self.create_parameter([self.num_experts, 2 * self.expert_dim], is_bias=True)
        self.down_proj = self.create_parameter(
            [self.num_experts, self.expert_dim, self.hidden_size], default_initializer=init
        )
        self.down_proj_bias = self.create_parameter([self.num_experts, self.hidden_size], is_bias=True)
        self.alpha = 1.702
        self.limit = config.swiglu_limit

    def forward(self, hidden_states, router_indices=None, routing_weights=None):
        batch_size = hidden_states.shape[0]
        hidden_states = hidden_states.reshape([-1, self.hidden_size])  # (num_tokens, hidden_size)
        num_experts = routing_weights.shape[1]
        next_states = paddle.zeros_like(hidden_states, dtype=hidden_states.dtype)
        with paddle.no_grad():
            expert_mask = F.one_hot(router_indices, num_classes=num_experts)
            expert_mask = expert_mask.transpose([2, 1, 0])
            # we sum on the top_k and on the sequence length to get which experts
            # are hit this time around
            expert_hit = paddle.greater_than(expert_mask.sum(axis=(-1, -2)), paddle.zeros([])).nonzero()
        for expert_idx in expert_hit[:]:
            expert_idx = expert_idx[0]
            with paddle.no_grad():
                _, token_idx = paddle.where(expert_mask[expert_idx] > 0)
            current_state = hidden_states[token_idx]
            gate_up = current_state @ self.gate_up_proj[expert_idx] + self.gate_up_proj_bias[expert_idx]
            gate, up = gate_up[..., ::2], gate_up[..., 1::2]
            gate = gate.clip(min=None, max=self.limit)
            up = up.clip(min=-self.limit, max=self.limit)
            glu = gate * F.sigmoid(gate * self.alpha)
            gated_output = (up + 1) * glu
            out = gated_output @ self.down_proj[expert_idx] + self.down_proj_bias[expert_idx]
            weighted_output = out * routing_weights[token_idx, expert_idx, None]
            next_states = paddle.index_add(next_states, token_idx, 0, weighted_output.astype(hidden_states.dtype))
        return next_states.reshape([batch_size, -1, self.hidden_size])


class GptOssTopKRouter(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.num_experts = config.num_local_experts
        self.hidden_dim = config.hidden_size
        self.weight = self.create_parameter(
            [self.num_experts, self.hidden_dim], default_initializer=nn.initializer.Normal(std=0.02)
        )
        self.bias = self.create_parameter([self.num_experts], is_bias=True)

    def forward(self, hidden_states):
        hidden_states = hidden_states.reshape([-1, self.hidden_dim])
        router_logits = F.linear(hidden_states, self.weight.T, self.bias)  # (seq_len, num_experts)
        router_top_value, router_indices = paddle.topk(router_logits, self.top_k, axis=-1)  # (seq_len, top_k)
        router_top_value = F.softmax(router_top_value, axis=1, dtype=router_top_value.dtype)
        router_scores = paddle.put_along_axis(paddle.zeros_like(router_logits), router_indices, router_top_value, 1)
        return router_scores, router_indices


class GptOssMLP(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.router = GptOssTopKRouter(config)
        self.experts = GptOssExperts(config)

    def forward(self, hidden_states):
        router_scores, router_indices = self.router(hidden_states)  # (num_experts, seq_len)
        routed_out = self.experts(hidden_states, router_indices=router_indices, routing_weights=router_scores)
        return routed_out, router_scores


class GptOssRotaryEmbedding(nn.Layer):
    def __init__(self, config):
        super().__init__()
        dim = config.head_dim
        inv_freq = 1.0 / (config.rope_theta ** (paddle.arange(0, dim, 2, dtype="int64").astype("float32") / dim))
        self.register_buffer("inv_freq", inv_freq, persistable=False)
        self.attention_scaling = 1.0

    def forward(self, x, position_ids):
        inv_freq_expanded = self.inv_freq[None, :, None].astype("float32").expand([position_ids.shape[0], -1, 1])
        position_ids_expanded = position_ids[:, None, :].astype("float32")
        freqs = paddle.matmul(inv_freq_expanded, position_ids_expanded).transpose([0, 2, 1])
        emb = freqs
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.astype(x.dtype), sin.astype(x.dtype)


def repeat_kv(hidden_states, n_rep):
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand([batch, num_key_value_heads, n_rep, slen, head_dim])
    return hidden_states.reshape([batch, num_key_value_heads * n_rep, slen, head_dim])


def _apply_rotary_emb(x, cos, sin):
    first_half, second_half = paddle.chunk(x, 2, axis=-1)
    first_ = first_half * cos - second_half * sin
    second_ = second_half * cos + first_half * sin
    return paddle.concat((first_, second_), axis=-1)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = _apply_rotary_emb(q, cos, sin)
    k_embed = _apply_rotary_emb(k, cos, sin)
    return q_embed, k_embed


def eager_attention_forward(module, query, key, value, attention_mask, scaling, dropout=0.0):
    key_states = repeat_kv(key, module.num_key_value_groups)
    value_states = repeat_kv(value, module.num_key_value_groups)
    attn_weights = paddle.matmul(query, key_states.transpose([0, 1, 3, 2])) * scaling
    if attention_mask is not None:
        causal_mask = attention_mask[:, :, :, : key_states.shape[-2]]
        attn_weights = attn_weights + causal_mask

    sinks = module.sinks.reshape([1, -1, 1, 1]).expand([query.shape[0], -1, query.shape[-2], -1])
    combined_logits = paddle.concat([attn_weights, sinks], axis=-1)

    # This was not in the original implementation and slightly affect results; it prevents overflow in BF16/FP16
    # when training with bsz>1 we clamp max values.
    combined_logits = combined_logits - combined_logits.max(axis=-1, keepdim=True)
    probs = F.softmax(combined_logits, axis=-1, dtype=combined_logits.dtype)
    scores = probs[..., :-1]  # we drop the sink here
    attn_weights = F.dropout(scores, p=dropout, training=module.training)
    attn_output = paddle.matmul(attn_weights, value_states)
    attn_output = attn_output.transpose([0, 2, 1, 3])
    return attn_output, attn_weights


class GptOssAttention(nn.Layer):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        self.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * self.head_dim)
        self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim)
        self.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim)
        self.o_proj = nn.Linear(config.num_attention_heads * self.head_dim, config.hidden_size)
        self.sliding_window = config.sliding_window if config.layer_types[layer_idx] == "sliding_attention" else None
        self.sinks = self.create_parameter([config.num_attention_heads], default_initializer=nn.initializer.Normal())

    def forward(self, hidden_states, position_embeddings, attention_mask):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query_states = self.q_proj(hidden_states).reshape(hidden_shape).transpose([0, 2, 1, 3])
        key_states = self.k_proj(hidden_states).reshape(hidden_shape).transpose([0, 2, 1, 3])
        value_states = self.v_proj(hidden_states).reshape(hidden_shape).transpose([0, 2, 1, 3])
        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
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
        attn_output = self.o_proj(attn_output)
        return attn_output, attn_weights


class GptOssDecoderLayer(nn.Layer):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.self_attn = GptOssAttention(config=config, layer_idx=layer_idx)
        self.mlp = GptOssMLP(config)
        self.input_layernorm = GptOssRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = GptOssRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.attention_type = config.layer_types[layer_idx]

    def forward(self, hidden_states, attention_mask, position_embeddings):
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
        hidden_states, _ = self.mlp(hidden_states)  # diff with llama: router scores
        return residual + hidden_states


def create_causal_mask(seq_len, sliding_window=None):
    """HF's eager causal masks as dense additive ``[1, 1, q, k]`` tensors: ``-inf`` above the diagonal
    (and, for a sliding window, at or beyond ``sliding_window`` positions back)."""
    rows = paddle.arange(seq_len).unsqueeze(-1)
    cols = paddle.arange(seq_len).unsqueeze(0)
    allowed = cols <= rows
    if sliding_window is not None:
        allowed = paddle.logical_and(allowed, rows - cols < sliding_window)
    mask = paddle.where(allowed, paddle.zeros([seq_len, seq_len]), paddle.full([seq_len, seq_len], float("-inf")))
    return mask[None, None, :, :]


class GptOssModel(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.LayerList([GptOssDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = GptOssRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = GptOssRotaryEmbedding(config=config)

    def forward(self, input_ids):
        inputs_embeds = self.embed_tokens(input_ids)
        seq_len = input_ids.shape[1]
        position_ids = paddle.arange(seq_len).unsqueeze(0)
        causal_mask_mapping = {
            "full_attention": create_causal_mask(seq_len),
            "sliding_attention": create_causal_mask(seq_len, self.config.sliding_window),
        }
        hidden_states = inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids)
        for decoder_layer in self.layers:
            hidden_states = decoder_layer(
                hidden_states,
                attention_mask=causal_mask_mapping[decoder_layer.attention_type],
                position_embeddings=position_embeddings,
            )
        return self.norm(hidden_states)


class GptOssForCausalLM(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.model = GptOssModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias_attr=False)

    def forward(self, input_ids):
        return self.lm_head(self.model(input_ids))


def build_model():
    return GptOssForCausalLM(GptOssConfig())


def input_spec():
    return [paddle.static.InputSpec([2, SEQ], "int64", "input_ids")]


def loss(model, tokens, labels):
    return F.cross_entropy(model(tokens).reshape([-1, VOCAB]), labels.reshape([-1]))
