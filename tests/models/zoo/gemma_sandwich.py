"""A Gemma-2-style decoder: sandwich norms (``input_layernorm``, ``post_attention_layernorm``,
``pre_feedforward_layernorm``, ``post_feedforward_layernorm``), RMSNorm scaled by ``1 + weight``,
the embedding multiplied by ``sqrt(hidden)``, attention logit soft-capping ``tanh(x / c) * c``,
GQA, GeGLU MLP (tanh GELU), an LM head tied to the embedding with final logit soft-capping.

    >>> model = build_model()
    >>> model(paddle.randint(0, VOCAB, [2, 8])).shape
    [2, 8, 64]
"""

import paddle
import paddle.nn as nn
import paddle.nn.functional as F

VOCAB, HIDDEN, INTER, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 64, 32, 64, 2, 4, 2, 8
ATTN_SOFTCAP, FINAL_SOFTCAP, QUERY_PRE_ATTN_SCALAR = 50.0, 30.0, 8


class Gemma2RMSNorm(nn.Layer):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = self.create_parameter([dim], default_initializer=nn.initializer.Constant(0.0))

    def forward(self, x):
        output = x.astype("float32")
        output = output * paddle.rsqrt(output.pow(2).mean(-1, keepdim=True) + self.eps)
        return (output * (1.0 + self.weight.astype("float32"))).astype(x.dtype)


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return paddle.concat([-x2, x1], axis=-1)


class Gemma2Attention(nn.Layer):
    def __init__(self):
        super().__init__()
        self.scaling = QUERY_PRE_ATTN_SCALAR**-0.5
        self.q_proj = nn.Linear(HIDDEN, HEADS * HEAD_DIM, bias_attr=False)
        self.k_proj = nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM, bias_attr=False)
        self.v_proj = nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM, bias_attr=False)
        self.o_proj = nn.Linear(HEADS * HEAD_DIM, HIDDEN, bias_attr=False)

    def forward(self, x, cos, sin, mask):
        b, s, _ = x.shape
        q = self.q_proj(x).reshape([b, s, -1, HEAD_DIM]).transpose([0, 2, 1, 3])
        k = self.k_proj(x).reshape([b, s, -1, HEAD_DIM]).transpose([0, 2, 1, 3])
        v = self.v_proj(x).reshape([b, s, -1, HEAD_DIM]).transpose([0, 2, 1, 3])
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        rep = HEADS // KV_HEADS
        k = k.unsqueeze(2).tile([1, 1, rep, 1, 1]).reshape([b, HEADS, s, HEAD_DIM])
        v = v.unsqueeze(2).tile([1, 1, rep, 1, 1]).reshape([b, HEADS, s, HEAD_DIM])
        attn_weights = paddle.matmul(q, k, transpose_y=True) * self.scaling
        attn_weights = paddle.tanh(attn_weights / ATTN_SOFTCAP) * ATTN_SOFTCAP
        attn_weights = F.softmax(attn_weights + mask, axis=-1)
        out = paddle.matmul(attn_weights, v).transpose([0, 2, 1, 3]).reshape([b, s, -1])
        return self.o_proj(out)


class Gemma2MLP(nn.Layer):
    def __init__(self):
        super().__init__()
        self.gate_proj = nn.Linear(HIDDEN, INTER, bias_attr=False)
        self.up_proj = nn.Linear(HIDDEN, INTER, bias_attr=False)
        self.down_proj = nn.Linear(INTER, HIDDEN, bias_attr=False)

    def forward(self, x):
        return self.down_proj(F.gelu(self.gate_proj(x), approximate=True) * self.up_proj(x))


class Gemma2DecoderLayer(nn.Layer):
    def __init__(self):
        super().__init__()
        self.self_attn = Gemma2Attention()
        self.mlp = Gemma2MLP()
        self.input_layernorm = Gemma2RMSNorm(HIDDEN)
        self.post_attention_layernorm = Gemma2RMSNorm(HIDDEN)
        self.pre_feedforward_layernorm = Gemma2RMSNorm(HIDDEN)
        self.post_feedforward_layernorm = Gemma2RMSNorm(HIDDEN)

    def forward(self, hidden_states, cos, sin, mask):
        residual = hidden_states
        hidden_states = self.self_attn(self.input_layernorm(hidden_states), cos, sin, mask)
        hidden_states = residual + self.post_attention_layernorm(hidden_states)
        residual = hidden_states
        hidden_states = self.mlp(self.pre_feedforward_layernorm(hidden_states))
        return residual + self.post_feedforward_layernorm(hidden_states)


class Gemma2ForCausalLM(nn.Layer):
    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.LayerList([Gemma2DecoderLayer() for _ in range(LAYERS)])
        self.norm = Gemma2RMSNorm(HIDDEN)
        inv_freq = 1.0 / (10000.0 ** (paddle.arange(0, HEAD_DIM, 2, dtype="float32") / HEAD_DIM))
        self.register_buffer("inv_freq", inv_freq, persistable=False)

    def forward(self, input_ids):
        s = input_ids.shape[1]
        hidden_states = self.embed_tokens(input_ids)
        normalizer = paddle.to_tensor(HIDDEN**0.5, dtype=hidden_states.dtype)
        hidden_states = hidden_states * normalizer
        freqs = paddle.outer(paddle.arange(s, dtype="float32"), self.inv_freq)
        emb = paddle.concat([freqs, freqs], axis=-1)
        cos, sin = emb.cos()[None, None], emb.sin()[None, None]
        mask = paddle.triu(paddle.full([s, s], -1e9), diagonal=1)[None, None]
        for layer in self.layers:
            hidden_states = layer(hidden_states, cos, sin, mask)
        logits = paddle.matmul(self.norm(hidden_states), self.embed_tokens.weight, transpose_y=True)
        return paddle.tanh(logits / FINAL_SOFTCAP) * FINAL_SOFTCAP


def build_model():
    return Gemma2ForCausalLM()


def input_spec():
    return [paddle.static.InputSpec([2, 8], "int64", "input_ids")]


def loss(model, tokens, labels):
    return F.cross_entropy(model(tokens).reshape([-1, VOCAB]), labels.reshape([-1]))
