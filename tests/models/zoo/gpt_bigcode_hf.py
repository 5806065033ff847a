"""GPT-BigCode (StarCoder, SantaCoder) as HF's ``modeling_gpt_bigcode`` writes it (2023), ported to Paddle.

What this spelling has that the rest of the zoo does not: multi-query attention whose one fused
projection is cut in *two* (``query, key_value = c_attn(h).split((embed_dim, 2 * kv_dim))``, then
``key_value.split((head_dim, head_dim))``), and scores computed with the heads folded into the
*query's sequence* (``query.reshape(batch, q_len * num_heads, head_dim)``) against the one shared
key, by ``baddbmm`` with ``beta=0`` and the scale as ``alpha``; the mask applied by
``where(mask, scores, mask_value)``; ``gelu(approximate="tanh")``; the head tied to ``wte``.

    >>> model = build_model()
    >>> list(model(paddle.randint(0, VOCAB, [2, 8])).shape)
    [2, 8, 64]
"""

import paddle
import paddle.nn.functional as F
from paddle import nn

VOCAB, N_EMBD, N_HEAD, N_LAYER, N_POSITIONS = 64, 32, 4, 2, 16


class GPTBigCodeAttention(nn.Layer):
    def __init__(self):
        super().__init__()
        self.embed_dim = N_EMBD
        self.num_heads = N_HEAD
        self.head_dim = self.embed_dim // self.num_heads
        self.kv_heads = 1  # multi_query
        self.kv_dim = self.kv_heads * self.head_dim
        self.scale_attn_weights = True
        self.c_attn = nn.Linear(self.embed_dim, self.embed_dim + 2 * self.kv_dim)
        self.c_proj = nn.Linear(self.embed_dim, self.embed_dim)
        self.attn_dropout = nn.Dropout(0.0)
        self.resid_dropout = nn.Dropout(0.0)

    def _attn(self, query, key, value, attention_mask=None):
        # query: [batch, q_len, embed] -> [batch, q_len * heads, head_dim]; key: [batch, head_dim, k_len]
        query_shape = query.shape
        batch_size, query_length = query_shape[0], query_shape[1]
        key_length = key.shape[-1]
        scale_factor = self.head_dim**-0.5 if self.scale_attn_weights else 1.0
        query = query.reshape([batch_size, query_length * self.num_heads, self.head_dim])
        empty = paddle.zeros([batch_size, query_length * self.num_heads, key_length], dtype=query.dtype)
        attn_weights = paddle.baddbmm(empty, query, key, beta=0.0, alpha=scale_factor)
        attn_weights = attn_weights.reshape([batch_size, query_length, self.num_heads, key_length])
        if attention_mask is not None:
            mask_value = paddle.full([], float(paddle.finfo(attn_weights.dtype).min), dtype=attn_weights.dtype)
            attn_weights = paddle.where(attention_mask, attn_weights, mask_value)
        attn_weights = F.softmax(attn_weights, axis=-1)
        attn_weights = self.attn_dropout(attn_weights)
        flat = attn_weights.reshape([batch_size, query_length * self.num_heads, key_length])
        attn_output = paddle.bmm(flat, value).reshape(query_shape)
        return attn_output, attn_weights

    def forward(self, hidden_states, attention_mask=None):
        query, key_value = self.c_attn(hidden_states).split([self.embed_dim, 2 * self.kv_dim], axis=2)
        key, value = key_value.split([self.head_dim, self.head_dim], axis=-1)
        attn_output, attn_weights = self._attn(query, key.transpose([0, 2, 1]), value, attention_mask)
        attn_output = self.c_proj(attn_output)
        attn_output = self.resid_dropout(attn_output)
        return attn_output, attn_weights


class GPTBigCodeMLP(nn.Layer):
    def __init__(self, intermediate_size):
        super().__init__()
        self.c_fc = nn.Linear(N_EMBD, intermediate_size)
        self.c_proj = nn.Linear(intermediate_size, N_EMBD)
        self.dropout = nn.Dropout(0.0)

    def forward(self, hidden_states):
        hidden_states = F.gelu(self.c_fc(hidden_states), approximate=True)
        return self.dropout(self.c_proj(hidden_states))


class GPTBigCodeBlock(nn.Layer):
    def __init__(self):
        super().__init__()
        self.ln_1 = nn.LayerNorm(N_EMBD, epsilon=1e-5)
        self.attn = GPTBigCodeAttention()
        self.ln_2 = nn.LayerNorm(N_EMBD, epsilon=1e-5)
        self.mlp = GPTBigCodeMLP(4 * N_EMBD)

    def forward(self, hidden_states, attention_mask=None):
        residual = hidden_states
        attn_output, _ = self.attn(self.ln_1(hidden_states), attention_mask=attention_mask)
        hidden_states = attn_output + residual
        residual = hidden_states
        return residual + self.mlp(self.ln_2(hidden_states))


class GPTBigCodeModel(nn.Layer):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, N_EMBD)
        self.wpe = nn.Embedding(N_POSITIONS, N_EMBD)
        self.drop = nn.Dropout(0.0)
        self.h = nn.LayerList([GPTBigCodeBlock() for _ in range(N_LAYER)])
        self.ln_f = nn.LayerNorm(N_EMBD, epsilon=1e-5)
        self.register_buffer(
            "bias", paddle.tril(paddle.ones([N_POSITIONS, N_POSITIONS], dtype="bool")), persistable=False
        )

    def forward(self, input_ids):
        batch_size, seq_len = input_ids.shape
        position_ids = paddle.arange(seq_len, dtype="int64").unsqueeze(0)
        # [1, q_len, 1, k_len]: broadcast over the batch and the heads folded beside the query
        self_attention_mask = self.bias[:seq_len, :seq_len].unsqueeze(0).unsqueeze(2)
        hidden_states = self.drop(self.wte(input_ids) + self.wpe(position_ids))
        for block in self.h:
            hidden_states = block(hidden_states, attention_mask=self_attention_mask)
        return self.ln_f(hidden_states)


class GPTBigCodeForCausalLM(nn.Layer):
    def __init__(self):
        super().__init__()
        self.transformer = GPTBigCodeModel()

    def forward(self, input_ids):
        # tie_word_embeddings: Paddle ports read the head from wte ([vocab, embed]) transposed
        return paddle.matmul(self.transformer(input_ids), self.transformer.wte.weight, transpose_y=True)


def build_model():
    return GPTBigCodeForCausalLM()


def input_spec():
    return [paddle.static.InputSpec([2, 8], "int64", "input_ids")]


def loss(model, tokens, labels):
    return F.cross_entropy(model(tokens).reshape([-1, VOCAB]), labels.reshape([-1]))
