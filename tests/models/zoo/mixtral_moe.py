"""A Mixtral-style sparse mixture-of-experts decoder as HuggingFace writes it: Llama attention
(GQA, rotary), and a ``block_sparse_moe`` whose router ``gate`` picks the top-2 of 4 experts per
token; each expert (``w1``, ``w2``, ``w3``, SwiGLU) runs on the tokens routed to it, gathered by
index and scattered back with ``index_add``.

    >>> model = build_model()
    >>> model(paddle.randint(0, VOCAB, [2, 8])).shape
    [2, 8, 64]
"""

import math

import paddle
import paddle.nn as nn
import paddle.nn.functional as F

VOCAB, HIDDEN, INTER, LAYERS, HEADS, KV_HEADS, EXPERTS, TOP_K = 64, 32, 64, 2, 4, 2, 4, 2


class MixtralRMSNorm(nn.Layer):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = self.create_parameter([hidden_size], default_initializer=nn.initializer.Constant(1.0))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * paddle.rsqrt(variance + self.variance_epsilon))


def rotate_half(x):
    x1, x2 = x.chunk(2, axis=-1)
    return paddle.concat([-x2, x1], axis=-1)


class MixtralAttention(nn.Layer):
    def __init__(self):
        super().__init__()
        self.head_dim = HIDDEN // HEADS
        self.q_proj = nn.Linear(HIDDEN, HEADS * self.head_dim, bias_attr=False)
        self.k_proj = nn.Linear(HIDDEN, KV_HEADS * self.head_dim, bias_attr=False)
        self.v_proj = nn.Linear(HIDDEN, KV_HEADS * self.head_dim, bias_attr=False)
        self.o_proj = nn.Linear(HEADS * self.head_dim, HIDDEN, bias_attr=False)

    def forward(self, x, cos, sin, mask):
        b, s, _ = x.shape
        q = self.q_proj(x).reshape([b, s, HEADS, self.head_dim]).transpose([0, 2, 1, 3])
        k = self.k_proj(x).reshape([b, s, KV_HEADS, self.head_dim]).transpose([0, 2, 1, 3])
        v = self.v_proj(x).reshape([b, s, KV_HEADS, self.head_dim]).transpose([0, 2, 1, 3])
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        n_rep = HEADS // KV_HEADS
        k = k[:, :, None].expand([b, KV_HEADS, n_rep, s, self.head_dim]).reshape([b, HEADS, s, self.head_dim])
        v = v[:, :, None].expand([b, KV_HEADS, n_rep, s, self.head_dim]).reshape([b, HEADS, s, self.head_dim])
        attn = paddle.matmul(q, k, transpose_y=True) / math.sqrt(self.head_dim) + mask
        attn = F.softmax(attn, axis=-1, dtype="float32").astype(q.dtype)
        out = paddle.matmul(attn, v).transpose([0, 2, 1, 3]).reshape([b, s, -1])
        return self.o_proj(out)


class MixtralBlockSparseTop2MLP(nn.Layer):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(HIDDEN, INTER, bias_attr=False)
        self.w2 = nn.Linear(INTER, HIDDEN, bias_attr=False)
        self.w3 = nn.Linear(HIDDEN, INTER, bias_attr=False)

    def forward(self, hidden_states):
        return self.w2(F.silu(self.w1(hidden_states)) * self.w3(hidden_states))


class MixtralSparseMoeBlock(nn.Layer):
    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(HIDDEN, EXPERTS, bias_attr=False)
        self.experts = nn.LayerList([MixtralBlockSparseTop2MLP() for _ in range(EXPERTS)])

    def forward(self, hidden_states):
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        hidden_states = hidden_states.reshape([-1, hidden_dim])
        router_logits = self.gate(hidden_states)
        routing_weights = F.softmax(router_logits, axis=1, dtype="float32")
        routing_weights, selected_experts = paddle.topk(routing_weights, TOP_K, axis=-1)
        routing_weights /= routing_weights.sum(axis=-1, keepdim=True)
        final_hidden_states = paddle.zeros_like(hidden_states)
        expert_mask = F.one_hot(selected_experts, num_classes=EXPERTS).transpose([2, 1, 0])
        for expert_idx in range(EXPERTS):
            idx, top_x = paddle.where(expert_mask[expert_idx])
            current_state = hidden_states[top_x]
            current = self.experts[expert_idx](current_state) * routing_weights[top_x, idx].unsqueeze(-1)
            final_hidden_states = paddle.index_add(final_hidden_states, top_x, 0, current.astype(hidden_states.dtype))
        return final_hidden_states.reshape([batch_size, sequence_length, hidden_dim])


class MixtralDecoderLayer(nn.Layer):
    def __init__(self):
        super().__init__()
        self.self_attn = MixtralAttention()
        self.block_sparse_moe = MixtralSparseMoeBlock()
        self.input_layernorm = MixtralRMSNorm(HIDDEN)
        self.post_attention_layernorm = MixtralRMSNorm(HIDDEN)

    def forward(self, x, cos, sin, mask):
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        return h + self.block_sparse_moe(self.post_attention_layernorm(h))


class MixtralForCausalLM(nn.Layer):
    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.LayerList([MixtralDecoderLayer() for _ in range(LAYERS)])
        self.norm = MixtralRMSNorm(HIDDEN)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias_attr=False)
        head_dim = HIDDEN // HEADS
        inv_freq = 1.0 / (10000.0 ** (paddle.arange(0, head_dim, 2, dtype="float32") / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistable=False)

    def forward(self, input_ids):
        s = input_ids.shape[1]
        freqs = paddle.outer(paddle.arange(s, dtype="float32"), self.inv_freq)
        emb = paddle.concat([freqs, freqs], axis=-1)
        cos, sin = emb.cos()[None, None], emb.sin()[None, None]
        mask = paddle.triu(paddle.full([s, s], float("-inf")), diagonal=1)[None, None]
        h = self.embed_tokens(input_ids)
        for layer in self.layers:
            h = layer(h, cos, sin, mask)
        return self.lm_head(self.norm(h))


def build_model():
    return MixtralForCausalLM()


def input_spec():
    return [paddle.static.InputSpec([2, 8], "int64", "input_ids")]


def loss(model, tokens, labels):
    return F.cross_entropy(model(tokens).reshape([-1, VOCAB]), labels.reshape([-1]))
