"""GPT-2 as HuggingFace's ``modeling_gpt2`` writes it: ``Conv1D`` layers (weight ``[nx, nf]``,
``addmm``), one fused ``c_attn`` split into q, k, v, a causal mask applied with ``where`` from a
``bias`` buffer, ``gelu_new`` written out with tanh, dropouts, an LM head tied to ``wte``.

    >>> model = build_model()
    >>> model(paddle.randint(0, VOCAB, [2, 8])).shape
    [2, 8, 64]
"""

import math

import paddle
import paddle.nn as nn
import paddle.nn.functional as F

VOCAB, N_EMBD, N_HEAD, N_LAYER, N_POSITIONS = 64, 32, 4, 2, 32


def gelu_new(x):
    return 0.5 * x * (1.0 + paddle.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * paddle.pow(x, 3.0))))


class Conv1D(nn.Layer):
    """Basically a linear layer with transposed weights (``nf`` outputs, ``nx`` inputs)."""

    def __init__(self, nf, nx):
        super().__init__()
        self.nf = nf
        self.weight = self.create_parameter([nx, nf], default_initializer=nn.initializer.Normal(std=0.02))
        self.bias = self.create_parameter([nf], is_bias=True)

    def forward(self, x):
        size_out = x.shape[:-1] + [self.nf]
        x = paddle.addmm(self.bias, x.reshape([-1, x.shape[-1]]), self.weight)
        return x.reshape(size_out)


class GPT2Attention(nn.Layer):
    def __init__(self):
        super().__init__()
        self.register_buffer(
            "bias",
            paddle.tril(paddle.ones([N_POSITIONS, N_POSITIONS], dtype="bool")).reshape(
                [1, 1, N_POSITIONS, N_POSITIONS]
            ),
            persistable=False,
        )
        self.embed_dim, self.num_heads = N_EMBD, N_HEAD
        self.head_dim = N_EMBD // N_HEAD
        self.split_size = N_EMBD
        self.c_attn = Conv1D(3 * N_EMBD, N_EMBD)
        self.c_proj = Conv1D(N_EMBD, N_EMBD)
        self.attn_dropout = nn.Dropout(0.1)
        self.resid_dropout = nn.Dropout(0.1)

    def _split_heads(self, tensor):
        return tensor.reshape(tensor.shape[:-1] + [self.num_heads, self.head_dim]).transpose([0, 2, 1, 3])

    def _merge_heads(self, tensor):
        tensor = tensor.transpose([0, 2, 1, 3])
        return tensor.reshape(tensor.shape[:-2] + [self.num_heads * self.head_dim])

    def _attn(self, query, key, value):
        attn_weights = paddle.matmul(query, key.transpose([0, 1, 3, 2])) / math.sqrt(value.shape[-1])
        query_length, key_length = query.shape[-2], key.shape[-2]
        causal_mask = self.bias[:, :, key_length - query_length : key_length, :key_length]
        mask_value = paddle.full([], paddle.finfo(attn_weights.dtype).min, dtype=attn_weights.dtype)
        attn_weights = paddle.where(causal_mask, attn_weights, mask_value)
        attn_weights = self.attn_dropout(F.softmax(attn_weights, axis=-1))
        return paddle.matmul(attn_weights, value)

    def forward(self, hidden_states):
        query, key, value = self.c_attn(hidden_states).split([self.split_size] * 3, axis=2)
        attn_output = self._attn(self._split_heads(query), self._split_heads(key), self._split_heads(value))
        return self.resid_dropout(self.c_proj(self._merge_heads(attn_output)))


class GPT2MLP(nn.Layer):
    def __init__(self, intermediate_size):
        super().__init__()
        self.c_fc = Conv1D(intermediate_size, N_EMBD)
        self.c_proj = Conv1D(N_EMBD, intermediate_size)
        self.dropout = nn.Dropout(0.1)

    def forward(self, hidden_states):
        return self.dropout(self.c_proj(gelu_new(self.c_fc(hidden_states))))


class GPT2Block(nn.Layer):
    def __init__(self):
        super().__init__()
        self.ln_1 = nn.LayerNorm(N_EMBD, epsilon=1e-5)
        self.attn = GPT2Attention()
        self.ln_2 = nn.LayerNorm(N_EMBD, epsilon=1e-5)
        self.mlp = GPT2MLP(4 * N_EMBD)

    def forward(self, hidden_states):
        hidden_states = self.attn(self.ln_1(hidden_states)) + hidden_states
        return hidden_states + self.mlp(self.ln_2(hidden_states))


class GPT2Model(nn.Layer):
    def __init__(self, n_layer=N_LAYER):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, N_EMBD)
        self.wpe = nn.Embedding(N_POSITIONS, N_EMBD)
        self.drop = nn.Dropout(0.1)
        self.h = nn.LayerList([GPT2Block() for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(N_EMBD, epsilon=1e-5)

    def forward(self, input_ids):
        position_ids = paddle.arange(input_ids.shape[-1], dtype="int64").unsqueeze(0)
        hidden_states = self.drop(self.wte(input_ids) + self.wpe(position_ids))
        for block in self.h:
            hidden_states = block(hidden_states)
        return self.ln_f(hidden_states)


class GPT2LMHeadModel(nn.Layer):
    def __init__(self, n_layer=N_LAYER):
        super().__init__()
        self.transformer = GPT2Model(n_layer)

    def forward(self, input_ids):
        hidden = self.transformer(input_ids)
        return paddle.matmul(hidden, self.transformer.wte.weight, transpose_y=True)  # lm_head tied to wte


def build_model():
    return GPT2LMHeadModel()


def build_4_layers():
    """Four blocks: two pipeline chunks on each of two stages (VPP)."""
    return GPT2LMHeadModel(n_layer=4)


def input_spec():
    return [paddle.static.InputSpec([2, 8], "int64", "input_ids")]


def logits_loss(logits, labels):
    """GPT-2's loss from the logits (a pipeline's ``loss_fn``)."""
    return F.cross_entropy(logits.reshape([-1, VOCAB]), labels.reshape([-1]))


def loss(model, tokens, labels):
    return logits_loss(model(tokens), labels)
