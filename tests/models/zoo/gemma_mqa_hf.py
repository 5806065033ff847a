"""Gemma (the first one, ``GemmaForCausalLM``) as HF transformers' ``modeling_gemma.py`` writes it,
in its 2B shape: multi-query attention (``num_key_value_heads=1``: one K/V head shared by every
query head, ``repeat_kv`` by expand + reshape), rotary tables from an ``inv_freq`` buffer times
the position ids, RMSNorm scaled by ``1 + weight`` in float32, the embedding multiplied by
``sqrt(hidden_size)``, a GeGLU MLP (tanh GELU), softmax upcast to float32, and the LM head tied
to the embedding.

    >>> model = build_model()
    >>> model(paddle.randint(0, VOCAB, [2, 8])).shape
    [2, 8, 64]
"""

import math

import paddle
import paddle.nn as nn
import paddle.nn.functional as F

VOCAB, HIDDEN, INTER, LAYERS, HEADS, KV_HEADS, HEAD_DIM, MAX_POS = 64, 32, 64, 2, 4, 1, 8, 32


class GemmaRMSNorm(nn.Layer):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = self.create_parameter([dim], default_initializer=nn.initializer.Constant(0.0))

    def _norm(self, x):
        return x * paddle.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        output = self._norm(x.astype("float32"))
        output = output * (1.0 + self.weight.astype("float32"))
        return output.astype(x.dtype)


class GemmaRotaryEmbedding(nn.Layer):
    def __init__(self, dim, max_position_embeddings=2048, base=10000):
        super().__init__()
        self.dim, self.max_position_embeddings, self.base = dim, max_position_embeddings, base
        inv_freq = 1.0 / (self.base ** (paddle.arange(0, self.dim, 2, dtype="int64").astype("float32") / self.dim))
        self.register_buffer("inv_freq", inv_freq, persistable=False)

    @paddle.no_grad()
    def forward(self, x, position_ids):
        # x: [bs, num_attention_heads, seq_len, head_size]
        inv_freq_expanded = self.inv_freq[None, :, None].astype("float32").expand([position_ids.shape[0], -1, 1])
        position_ids_expanded = position_ids[:, None, :].astype("float32")
        freqs = (inv_freq_expanded @ position_ids_expanded).transpose([0, 2, 1])
        emb = paddle.concat((freqs, freqs), axis=-1)
        return emb.cos().astype(x.dtype), emb.sin().astype(x.dtype)


def rotate_half(x):
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


class GemmaMLP(nn.Layer):
    def __init__(self):
        super().__init__()
        self.gate_proj = nn.Linear(HIDDEN, INTER, bias_attr=False)
        self.up_proj = nn.Linear(HIDDEN, INTER, bias_attr=False)
        self.down_proj = nn.Linear(INTER, HIDDEN, bias_attr=False)

    def forward(self, x):
        return self.down_proj(F.gelu(self.gate_proj(x), approximate=True) * self.up_proj(x))


class GemmaAttention(nn.Layer):
    def __init__(self, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.hidden_size, self.num_heads, self.head_dim = HIDDEN, HEADS, HEAD_DIM
        self.num_key_value_heads = KV_HEADS
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.q_proj = nn.Linear(self.hidden_size, self.num_heads * self.head_dim, bias_attr=False)
        self.k_proj = nn.Linear(self.hidden_size, self.num_key_value_heads * self.head_dim, bias_attr=False)
        self.v_proj = nn.Linear(self.hidden_size, self.num_key_value_heads * self.head_dim, bias_attr=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, self.hidden_size, bias_attr=False)
        self.rotary_emb = GemmaRotaryEmbedding(self.head_dim, max_position_embeddings=MAX_POS)

    def forward(self, hidden_states, attention_mask, position_ids):
        bsz, q_len, _ = hidden_states.shape
        query_states = self.q_proj(hidden_states)
        key_states = self.k_proj(hidden_states)
        value_states = self.v_proj(hidden_states)

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
        attn_weights = attn_weights + attention_mask
        attn_weights = F.softmax(attn_weights, axis=-1, dtype="float32").astype(query_states.dtype)
        attn_output = paddle.matmul(attn_weights, value_states)

        attn_output = attn_output.transpose([0, 2, 1, 3]).reshape([bsz, q_len, -1])
        return self.o_proj(attn_output)


class GemmaDecoderLayer(nn.Layer):
    def __init__(self, layer_idx):
        super().__init__()
        self.self_attn = GemmaAttention(layer_idx)
        self.mlp = GemmaMLP()
        self.input_layernorm = GemmaRMSNorm(HIDDEN)
        self.post_attention_layernorm = GemmaRMSNorm(HIDDEN)

    def forward(self, hidden_states, attention_mask, position_ids):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states = self.self_attn(hidden_states, attention_mask, position_ids)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        return residual + hidden_states


class GemmaModel(nn.Layer):
    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.LayerList([GemmaDecoderLayer(i) for i in range(LAYERS)])
        self.norm = GemmaRMSNorm(HIDDEN)

    def forward(self, input_ids):
        inputs_embeds = self.embed_tokens(input_ids)
        seq_length = input_ids.shape[1]
        position_ids = paddle.arange(0, seq_length, dtype="int64").unsqueeze(0)
        min_dtype = paddle.finfo(inputs_embeds.dtype).min
        causal_mask = paddle.triu(paddle.full([seq_length, seq_length], min_dtype, inputs_embeds.dtype), diagonal=1)
        causal_mask = causal_mask[None, None, :, :]
        # normalized: Gemma downcasts the below to the hidden states' dtype
        normalizer = paddle.to_tensor(HIDDEN**0.5, dtype=inputs_embeds.dtype)
        hidden_states = inputs_embeds * normalizer
        for decoder_layer in self.layers:
            hidden_states = decoder_layer(hidden_states, causal_mask, position_ids)
        return self.norm(hidden_states)


class GemmaForCausalLM(nn.Layer):
    def __init__(self):
        super().__init__()
        self.model = GemmaModel()

    def forward(self, input_ids):
        hidden_states = self.model(input_ids)
        # tie_word_embeddings: the head reads the embedding's [vocab, hidden] table
        logits = paddle.matmul(hidden_states, self.model.embed_tokens.weight, transpose_y=True)
        return logits.astype("float32")


def build_model():
    return GemmaForCausalLM()


def input_spec():
    return [paddle.static.InputSpec([2, 8], "int64", "input_ids")]


def loss(model, tokens, labels):
    return F.cross_entropy(model(tokens).reshape([-1, VOCAB]), labels.reshape([-1]))
