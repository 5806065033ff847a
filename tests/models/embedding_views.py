"""HF GPT-2's top as ``GPT2Model.forward`` writes it: the ids first go through
``input_ids.view(-1, input_shape[-1])`` and the output through ``view(output_shape)``, which a
Paddle port (PaddleNLP's GPT) writes ``reshape``: Paddle's ``Tensor.view`` runs in dynamic graph
mode only, so it does not trace (docs/paddle-notes.md). ``build_flatten`` embeds a flat token
list, ``input_ids.flatten(0, -1)``, and reshapes the embeddings back. The blocks are plain
pre-norm GPT blocks.

    >>> [list(build()(paddle.randint(0, VOCAB, [2, 8])).shape) for build in (build_reshape, build_flatten)]
    [[2, 8, 64], [2, 8, 64]]
"""

import paddle
import paddle.nn as nn
import paddle.nn.functional as F

VOCAB, N_POSITIONS, N_EMBD, N_HEAD, N_LAYER = 64, 16, 32, 4, 2


class Attention(nn.Layer):
    def __init__(self):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(N_EMBD, N_EMBD) for _ in range(3))
        self.out_proj = nn.Linear(N_EMBD, N_EMBD)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (
            p(x).reshape([b, s, N_HEAD, -1]).transpose([0, 2, 1, 3]) for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        scores = paddle.matmul(q, k, transpose_y=True) / (N_EMBD // N_HEAD) ** 0.5
        mask = paddle.triu(paddle.full([s, s], float("-inf")), diagonal=1)
        y = paddle.matmul(F.softmax(scores + mask, axis=-1), v)
        return self.out_proj(y.transpose([0, 2, 1, 3]).reshape([b, s, -1]))


class Block(nn.Layer):
    def __init__(self):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(N_EMBD), nn.LayerNorm(N_EMBD)
        self.attn = Attention()
        self.c_fc, self.c_proj = nn.Linear(N_EMBD, 4 * N_EMBD), nn.Linear(4 * N_EMBD, N_EMBD)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.c_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate=True))


class GPT2Model(nn.Layer):
    def __init__(self, spelling):
        super().__init__()
        self.spelling = spelling
        self.wte = nn.Embedding(VOCAB, N_EMBD)
        self.wpe = nn.Embedding(N_POSITIONS, N_EMBD)
        self.drop = nn.Dropout(0.1)
        self.h = nn.LayerList([Block() for _ in range(N_LAYER)])
        self.ln_f = nn.LayerNorm(N_EMBD, epsilon=1e-5)

    def forward(self, input_ids):
        input_shape = input_ids.shape
        if self.spelling == "reshape":
            input_ids = input_ids.reshape([-1, input_shape[-1]])
        else:
            input_ids = input_ids.flatten(0, -1)
        position_ids = paddle.arange(0, input_shape[-1], dtype="int64").unsqueeze(0)
        inputs_embeds = self.wte(input_ids)
        if self.spelling == "flatten":
            inputs_embeds = inputs_embeds.reshape(input_shape + [-1])
        hidden_states = self.drop(inputs_embeds + self.wpe(position_ids))
        for block in self.h:
            hidden_states = block(hidden_states)
        hidden_states = self.ln_f(hidden_states)
        output_shape = [-1] + input_shape[1:] + [hidden_states.shape[-1]]
        return hidden_states.reshape(output_shape)


class GPT2LMHeadModel(nn.Layer):
    def __init__(self, spelling):
        super().__init__()
        self.transformer = GPT2Model(spelling)

    def forward(self, input_ids):
        hidden = self.transformer(input_ids)
        return paddle.matmul(hidden, self.transformer.wte.weight, transpose_y=True)  # lm_head tied to wte


def build_reshape():
    return GPT2LMHeadModel("reshape")


def build_flatten():
    return GPT2LMHeadModel("flatten")


def input_spec():
    return [paddle.static.InputSpec([2, 8], "int64", "input_ids")]
