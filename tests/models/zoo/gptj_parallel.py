"""A GPT-J-style decoder (parallel residual, as in GPT-J, GPT-NeoX and Falcon): one LayerNorm
feeds both the attention and the MLP, ``x + attn(ln(x)) + mlp(ln(x))``; rotary embedding on the
first ``rotary_dim`` dims with every-two rotation; q/k/v/out_proj without bias; ``fc_in`` /
``fc_out`` with ``gelu_new``; an untied LM head with bias.

    >>> model = build_model()
    >>> model(paddle.randint(0, VOCAB, [2, 8])).shape
    [2, 8, 64]
"""

import math

import paddle
import paddle.nn as nn
import paddle.nn.functional as F

VOCAB, N_EMBD, N_HEAD, N_LAYER, ROTARY_DIM, N_INNER = 64, 32, 4, 2, 4, 128


def create_sinusoidal_positions(num_pos, dim):
    inv_freq = 1.0 / (10000 ** (paddle.arange(0, dim, 2, dtype="float32") / dim))
    sinusoid_inp = paddle.outer(paddle.arange(num_pos, dtype="float32"), inv_freq)
    return paddle.concat([paddle.sin(sinusoid_inp), paddle.cos(sinusoid_inp)], axis=1)


def rotate_every_two(x):
    x1, x2 = x[:, :, :, ::2], x[:, :, :, 1::2]
    return paddle.stack([-x2, x1], axis=-1).flatten(-2)


def apply_rotary_pos_emb(tensor, sin, cos):
    sin = paddle.repeat_interleave(sin[:, :, None, :], 2, axis=3)
    cos = paddle.repeat_interleave(cos[:, :, None, :], 2, axis=3)
    return (tensor * cos) + (rotate_every_two(tensor) * sin)


class GPTJAttention(nn.Layer):
    def __init__(self):
        super().__init__()
        self.head_dim = N_EMBD // N_HEAD
        self.k_proj = nn.Linear(N_EMBD, N_EMBD, bias_attr=False)
        self.v_proj = nn.Linear(N_EMBD, N_EMBD, bias_attr=False)
        self.q_proj = nn.Linear(N_EMBD, N_EMBD, bias_attr=False)
        self.out_proj = nn.Linear(N_EMBD, N_EMBD, bias_attr=False)
        self.register_buffer("embed_positions", create_sinusoidal_positions(64, ROTARY_DIM), persistable=False)

    def forward(self, hidden_states, position_ids, causal_mask):
        b, s, _ = hidden_states.shape
        query = self.q_proj(hidden_states).reshape([b, s, N_HEAD, self.head_dim])
        key = self.k_proj(hidden_states).reshape([b, s, N_HEAD, self.head_dim])
        value = self.v_proj(hidden_states).reshape([b, s, N_HEAD, self.head_dim]).transpose([0, 2, 1, 3])
        sincos = self.embed_positions[position_ids]
        sin, cos = paddle.split(sincos, 2, axis=-1)
        k_rot, k_pass = key[:, :, :, :ROTARY_DIM], key[:, :, :, ROTARY_DIM:]
        q_rot, q_pass = query[:, :, :, :ROTARY_DIM], query[:, :, :, ROTARY_DIM:]
        key = paddle.concat([apply_rotary_pos_emb(k_rot, sin, cos), k_pass], axis=-1).transpose([0, 2, 1, 3])
        query = paddle.concat([apply_rotary_pos_emb(q_rot, sin, cos), q_pass], axis=-1).transpose([0, 2, 1, 3])
        attn_weights = paddle.matmul(query, key, transpose_y=True) / math.sqrt(self.head_dim)
        attn_weights = paddle.where(causal_mask, attn_weights, paddle.full_like(attn_weights, -1e9))
        attn_weights = F.softmax(attn_weights, axis=-1)
        out = paddle.matmul(attn_weights, value).transpose([0, 2, 1, 3]).reshape([b, s, N_EMBD])
        return self.out_proj(out)


class GPTJMLP(nn.Layer):
    def __init__(self):
        super().__init__()
        self.fc_in = nn.Linear(N_EMBD, N_INNER)
        self.fc_out = nn.Linear(N_INNER, N_EMBD)

    def forward(self, hidden_states):
        return self.fc_out(F.gelu(self.fc_in(hidden_states), approximate=True))


class GPTJBlock(nn.Layer):
    def __init__(self):
        super().__init__()
        self.ln_1 = nn.LayerNorm(N_EMBD)
        self.attn = GPTJAttention()
        self.mlp = GPTJMLP()

    def forward(self, hidden_states, position_ids, causal_mask):
        residual = hidden_states
        hidden_states = self.ln_1(hidden_states)
        attn_output = self.attn(hidden_states, position_ids, causal_mask)
        return attn_output + self.mlp(hidden_states) + residual


class GPTJForCausalLM(nn.Layer):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, N_EMBD)
        self.h = nn.LayerList([GPTJBlock() for _ in range(N_LAYER)])
        self.ln_f = nn.LayerNorm(N_EMBD)
        self.lm_head = nn.Linear(N_EMBD, VOCAB)

    def forward(self, input_ids):
        s = input_ids.shape[1]
        position_ids = paddle.arange(s, dtype="int64").unsqueeze(0)
        causal_mask = paddle.tril(paddle.ones([s, s], dtype="bool"))[None, None]
        hidden_states = self.wte(input_ids)
        for block in self.h:
            hidden_states = block(hidden_states, position_ids, causal_mask)
        return self.lm_head(self.ln_f(hidden_states))


def build_model():
    return GPTJForCausalLM()


def input_spec():
    return [paddle.static.InputSpec([2, 8], "int64", "input_ids")]


def loss(model, tokens, labels):
    return F.cross_entropy(model(tokens).reshape([-1, VOCAB]), labels.reshape([-1]))
