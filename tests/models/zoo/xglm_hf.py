"""HF XGLM (facebook/xglm), ported to Paddle as its modeling_xglm.py writes it: sinusoidal
positions offset by 2 from a buffer, the token embeddings scaled by sqrt(d_model), pre-LN decoder
layers whose attention is BART's (query scaled first, ``_shape`` then heads folded into the batch
for ``bmm``, the output reshaped with ``self.embed_dim``), fc1/fc2 with GELU, a final LayerNorm and
an LM head tied to the token embeddings. Sizes: no two of batch 2, sequence 12, heads 4, head dim
10, hidden 40, FFN 72, vocabulary 96 coincide."""

from __future__ import annotations

import math

import paddle
import paddle.nn as nn
import paddle.nn.functional as F

VOCAB, SEQ = 96, 12


class XGLMConfig:
    vocab_size = VOCAB
    max_position_embeddings = 64
    d_model = 40
    ffn_dim = 72
    num_layers = 2
    attention_heads = 4
    dropout = 0.0
    attention_dropout = 0.0
    activation_dropout = 0.0
    scale_embedding = True
    pad_token_id = 1


class XGLMSinusoidalPositionalEmbedding(nn.Layer):
    def __init__(self, num_positions, embedding_dim, padding_idx=None):
        super().__init__()
        self.offset = 2
        self.embedding_dim = embedding_dim
        self.padding_idx = padding_idx
        self.register_buffer("weights", self.get_embedding(num_positions + self.offset, embedding_dim, padding_idx))

    @staticmethod
    def get_embedding(num_embeddings, embedding_dim, padding_idx=None):
        half_dim = embedding_dim // 2
        emb = math.log(10000) / (half_dim - 1)
        emb = paddle.exp(paddle.arange(half_dim, dtype="float32") * -emb)
        emb = paddle.arange(num_embeddings, dtype="float32").unsqueeze(1) * emb.unsqueeze(0)
        emb = paddle.concat([paddle.sin(emb), paddle.cos(emb)], axis=1).reshape([num_embeddings, -1])
        if padding_idx is not None:
            emb[padding_idx, :] = 0
        return emb

    def forward(self, position_ids, past_key_values_length=0):
        bsz, seq_len = position_ids.shape
        position_ids = position_ids + self.offset
        return self.weights.index_select(position_ids.reshape([-1]), axis=0).reshape([bsz, seq_len, -1]).detach()


class XGLMAttention(nn.Layer):
    def __init__(self, embed_dim, num_heads, dropout=0.0, bias=True):
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.dropout = dropout
        self.head_dim = embed_dim // num_heads
        self.scaling = self.head_dim**-0.5
        self.k_proj = nn.Linear(embed_dim, embed_dim, bias_attr=bias)
        self.v_proj = nn.Linear(embed_dim, embed_dim, bias_attr=bias)
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias_attr=bias)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias_attr=bias)

    def _shape(self, tensor, seq_len, bsz):
        return tensor.reshape([bsz, seq_len, self.num_heads, self.head_dim]).transpose([0, 2, 1, 3])

    def forward(self, hidden_states, attention_mask=None):
        bsz, tgt_len, _ = hidden_states.shape
        query_states = self.q_proj(hidden_states) * self.scaling
        key_states = self._shape(self.k_proj(hidden_states), -1, bsz)
        value_states = self._shape(self.v_proj(hidden_states), -1, bsz)

        proj_shape = [bsz * self.num_heads, -1, self.head_dim]
        query_states = self._shape(query_states, tgt_len, bsz).reshape(proj_shape)
        key_states = key_states.reshape(proj_shape)
        value_states = value_states.reshape(proj_shape)

        src_len = key_states.shape[1]
        attn_weights = paddle.bmm(query_states, key_states.transpose([0, 2, 1]))
        if attention_mask is not None:
            attn_weights = attn_weights.reshape([bsz, self.num_heads, tgt_len, src_len]) + attention_mask
            attn_weights = attn_weights.reshape([bsz * self.num_heads, tgt_len, src_len])
        attn_weights = F.softmax(attn_weights, axis=-1)
        attn_probs = F.dropout(attn_weights, p=self.dropout, training=self.training)
        attn_output = paddle.bmm(attn_probs, value_states)

        attn_output = attn_output.reshape([bsz, self.num_heads, tgt_len, self.head_dim])
        attn_output = attn_output.transpose([0, 2, 1, 3])
        attn_output = attn_output.reshape([bsz, tgt_len, self.embed_dim])
        return self.out_proj(attn_output)


class XGLMDecoderLayer(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.embed_dim = config.d_model
        self.self_attn = XGLMAttention(self.embed_dim, config.attention_heads, config.attention_dropout)
        self.dropout = config.dropout
        self.activation_dropout = config.activation_dropout
        self.self_attn_layer_norm = nn.LayerNorm(self.embed_dim)
        self.fc1 = nn.Linear(self.embed_dim, config.ffn_dim)
        self.fc2 = nn.Linear(config.ffn_dim, self.embed_dim)
        self.final_layer_norm = nn.LayerNorm(self.embed_dim)

    def forward(self, hidden_states, attention_mask=None):
        residual = hidden_states
        hidden_states = self.self_attn_layer_norm(hidden_states)
        hidden_states = self.self_attn(hidden_states, attention_mask=attention_mask)
        hidden_states = F.dropout(hidden_states, p=self.dropout, training=self.training)
        hidden_states = residual + hidden_states

        residual = hidden_states
        hidden_states = self.final_layer_norm(hidden_states)
        hidden_states = F.gelu(self.fc1(hidden_states))
        hidden_states = F.dropout(hidden_states, p=self.activation_dropout, training=self.training)
        hidden_states = self.fc2(hidden_states)
        hidden_states = F.dropout(hidden_states, p=self.dropout, training=self.training)
        return residual + hidden_states


def _make_causal_mask(bsz, tgt_len, dtype):
    mask = paddle.triu(paddle.full([tgt_len, tgt_len], float("-inf"), dtype=dtype), diagonal=1)
    return mask.unsqueeze(0).unsqueeze(0).expand([bsz, 1, tgt_len, tgt_len])


class XGLMModel(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.embed_scale = math.sqrt(config.d_model) if config.scale_embedding else 1.0
        self.embed_tokens = nn.Embedding(config.vocab_size, config.d_model)
        self.embed_positions = XGLMSinusoidalPositionalEmbedding(
            config.max_position_embeddings, config.d_model, config.pad_token_id
        )
        self.layers = nn.LayerList([XGLMDecoderLayer(config) for _ in range(config.num_layers)])
        self.layer_norm = nn.LayerNorm(config.d_model)

    def forward(self, input_ids):
        bsz, seq_len = input_ids.shape
        position_ids = paddle.arange(seq_len, dtype="int64").unsqueeze(0).expand([bsz, seq_len])
        inputs_embeds = self.embed_tokens(input_ids) * self.embed_scale
        attention_mask = _make_causal_mask(bsz, seq_len, inputs_embeds.dtype)
        hidden_states = inputs_embeds + self.embed_positions(position_ids)
        for decoder_layer in self.layers:
            hidden_states = decoder_layer(hidden_states, attention_mask=attention_mask)
        return self.layer_norm(hidden_states)


class XGLMForCausalLM(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.model = XGLMModel(config)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias_attr=False)
        self.lm_head.weight = self.model.embed_tokens.weight  # tied, [vocab, d] as Paddle's Embedding holds it

    def forward(self, input_ids):
        hidden_states = self.model(input_ids)
        return paddle.matmul(hidden_states, self.lm_head.weight, transpose_y=True)


def build_model():
    return XGLMForCausalLM(XGLMConfig())


def input_spec():
    return [paddle.static.InputSpec([2, SEQ], "int64", "input_ids")]


def loss(model, tokens, labels):
    return F.cross_entropy(model(tokens).reshape([-1, VOCAB]), labels.reshape([-1]))
