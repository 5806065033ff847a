"""OPT as HF's ``modeling_opt`` writes it (2022), ported to Paddle.

What this spelling has that the rest of the zoo does not: the query is scaled *before* the
scores (``self.q_proj(h) * self.scaling``), heads are merged into the batch by a ``_shape``
helper and the scores are ``bmm`` over ``[bsz * heads, tgt, src]``; the learned positions are
looked up at ``position + 2`` (OPT's offset), from a cumulative sum of the attention mask; the
MLP is ``fc1``/``fc2`` directly in the decoder layer (no MLP sub-layer); the LM head is tied to
the token embedding by sharing its Parameter; the token embedding has a ``padding_idx``
(HF's ``config.pad_token_id``, 1): that row looks up zeros and gets no gradient.
"""

import paddle
import paddle.nn.functional as F
from paddle import nn

VOCAB, HIDDEN, HEADS, FFN, LAYERS, POSITIONS = 64, 32, 4, 64, 2, 16
PAD = 1  # OPTConfig.pad_token_id


class OPTLearnedPositionalEmbedding(nn.Embedding):
    """OPT's positions: ``cumsum(mask) * mask - 1``, shifted by 2 (the table has 2 more rows)."""

    def __init__(self, num_embeddings, embedding_dim):
        self.offset = 2
        super().__init__(num_embeddings + self.offset, embedding_dim)

    def forward(self, attention_mask):
        attention_mask = attention_mask.astype("int64")
        positions = (paddle.cumsum(attention_mask, axis=1) * attention_mask) - 1
        return super().forward(positions + self.offset)


class OPTAttention(nn.Layer):
    def __init__(self):
        super().__init__()
        self.embed_dim, self.num_heads = HIDDEN, HEADS
        self.head_dim = HIDDEN // HEADS
        self.scaling = self.head_dim**-0.5
        self.k_proj = nn.Linear(HIDDEN, HIDDEN)
        self.v_proj = nn.Linear(HIDDEN, HIDDEN)
        self.q_proj = nn.Linear(HIDDEN, HIDDEN)
        self.out_proj = nn.Linear(HIDDEN, HIDDEN)

    def _shape(self, tensor, seq_len, bsz):
        return tensor.reshape([bsz, seq_len, self.num_heads, self.head_dim]).transpose([0, 2, 1, 3])

    def forward(self, hidden_states, causal_mask):
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
        attn_weights = attn_weights.reshape([bsz, self.num_heads, tgt_len, src_len]) + causal_mask
        attn_weights = attn_weights.reshape([bsz * self.num_heads, tgt_len, src_len])
        attn_probs = F.softmax(attn_weights, axis=-1)

        attn_output = paddle.bmm(attn_probs, value_states)
        attn_output = attn_output.reshape([bsz, self.num_heads, tgt_len, self.head_dim]).transpose([0, 2, 1, 3])
        attn_output = attn_output.reshape([bsz, tgt_len, self.embed_dim])
        return self.out_proj(attn_output)


class OPTDecoderLayer(nn.Layer):
    def __init__(self):
        super().__init__()
        self.self_attn = OPTAttention()
        self.self_attn_layer_norm = nn.LayerNorm(HIDDEN)
        self.fc1 = nn.Linear(HIDDEN, FFN)
        self.fc2 = nn.Linear(FFN, HIDDEN)
        self.final_layer_norm = nn.LayerNorm(HIDDEN)

    def forward(self, hidden_states, causal_mask):
        residual = hidden_states
        hidden_states = self.self_attn(self.self_attn_layer_norm(hidden_states), causal_mask)
        hidden_states = residual + hidden_states

        residual = hidden_states
        hidden_states = self.fc2(F.relu(self.fc1(self.final_layer_norm(hidden_states))))
        return residual + hidden_states


class OPTDecoder(nn.Layer):
    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, HIDDEN, padding_idx=PAD)
        self.embed_positions = OPTLearnedPositionalEmbedding(POSITIONS, HIDDEN)
        self.layers = nn.LayerList([OPTDecoderLayer() for _ in range(LAYERS)])
        self.final_layer_norm = nn.LayerNorm(HIDDEN)

    def forward(self, input_ids):
        seq_len = input_ids.shape[1]
        attention_mask = paddle.ones_like(input_ids)
        causal = paddle.triu(paddle.full([seq_len, seq_len], float("-inf")), diagonal=1)
        hidden_states = self.embed_tokens(input_ids) + self.embed_positions(attention_mask)
        for layer in self.layers:
            hidden_states = layer(hidden_states, causal)
        return self.final_layer_norm(hidden_states)


class OPTForCausalLM(nn.Layer):
    def __init__(self):
        super().__init__()
        self.model = nn.Layer()
        self.model.decoder = OPTDecoder()
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias_attr=False)
        # tie_word_embeddings: HF ties lm_head.weight to embed_tokens.weight; in Paddle the Linear
        # weight is [in, out], so the head reads the table transposed
        self.lm_head.weight = self.model.decoder.embed_tokens.weight

    def forward(self, input_ids):
        hidden = self.model.decoder(input_ids)
        return paddle.matmul(hidden, self.lm_head.weight, transpose_y=True)


def build_model():
    return OPTForCausalLM()


def input_spec():
    return [paddle.static.InputSpec([2, 8], "int64", "input_ids")]


def loss(model, tokens, labels):
    return F.cross_entropy(model(tokens).reshape([-1, VOCAB]), labels.reshape([-1]))
