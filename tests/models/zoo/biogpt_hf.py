"""BioGPT as HF's modeling_biogpt writes it (its BART-derived attention), ported to Paddle at a
small config.

Token embeddings scaled by ``sqrt(hidden_size)`` (``scale_embedding``); learned positions looked
up at ``cumsum(mask) * mask - 1 + 2`` (the offset of 2); pre-LN decoder layers whose MLP is
``fc1``/``fc2`` directly in the layer; BART's attention: the query scaled before the scores
(``q_proj(h) * self.scaling``), heads folded into the batch by ``_shape`` and ``proj_shape``,
scores by ``bmm``, the causal mask added on a ``[bsz, heads, tgt, src]`` view; the output
reshaped with ``self.embed_dim``. A final LayerNorm and an untied ``output_projection``.

What differs from the torch code is spelling (``reshape`` for ``view``, ``transpose`` with the
whole permutation, ``axis`` for ``dim``); caches, SDPA and flash paths are left out. Planned
blind at mp2 (``--input-spec input_ids:int64:4x16`` and ``6x12``: the same plan).

    >>> model = build_model()
    >>> list(model(paddle.randint(0, VOCAB, [2, SEQ])).shape)
    [2, 16, 256]
"""

import math

import paddle
import paddle.nn as nn
import paddle.nn.functional as F

VOCAB, HIDDEN, INTER, LAYERS, HEADS, SEQ = 256, 40, 96, 2, 4, 16


class BioGptConfig:
    vocab_size = VOCAB
    hidden_size = HIDDEN
    num_hidden_layers = LAYERS
    num_attention_heads = HEADS
    intermediate_size = INTER
    hidden_act = "gelu"
    hidden_dropout_prob = 0.0
    attention_probs_dropout_prob = 0.0
    activation_dropout = 0.0
    max_position_embeddings = 64
    layer_norm_eps = 1e-12
    scale_embedding = True
    pad_token_id = 1


class BioGptLearnedPositionalEmbedding(nn.Embedding):
    """This module learns positional embeddings up to a fixed maximum size."""

    def __init__(self, num_embeddings, embedding_dim):
        # BioGpt is set up so that if padding_idx is specified then offset the embedding ids by 2
        # and adjust num_embeddings appropriately. Other models don't have this hack
        self.offset = 2
        super().__init__(num_embeddings + self.offset, embedding_dim)

    def forward(self, attention_mask, past_key_values_length=0):
        """`input_ids_shape` is expected to be [bsz x seqlen]."""
        attention_mask = attention_mask.astype("int64")
        # create positions depending on attention_mask
        positions = (paddle.cumsum(attention_mask, axis=1).astype(attention_mask.dtype) * attention_mask) - 1
        # cut positions if `past_key_values_length` is > 0
        positions = positions[:, past_key_values_length:]
        return super().forward(positions + self.offset)


class BioGptAttention(nn.Layer):
    """Multi-headed attention from 'Attention Is All You Need' paper"""

    def __init__(self, embed_dim, num_heads, dropout=0.0, is_decoder=False, bias=True):
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.dropout = dropout
        self.head_dim = embed_dim // num_heads
        if (self.head_dim * num_heads) != self.embed_dim:
            raise ValueError(
                f"embed_dim must be divisible by num_heads (got `embed_dim`: {self.embed_dim}"
                f" and `num_heads`: {num_heads})."
            )
        self.scaling = self.head_dim**-0.5
        self.is_decoder = is_decoder

        self.k_proj = nn.Linear(embed_dim, embed_dim, bias_attr=bias)
        self.v_proj = nn.Linear(embed_dim, embed_dim, bias_attr=bias)
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias_attr=bias)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias_attr=bias)

    def _shape(self, tensor, seq_len, bsz):
        return tensor.reshape([bsz, seq_len, self.num_heads, self.head_dim]).transpose([0, 2, 1, 3])

    def forward(self, hidden_states, attention_mask=None):
        """Input shape: Batch x Time x Channel"""
        bsz, tgt_len, _ = hidden_states.shape

        # get query proj
        query_states = self.q_proj(hidden_states) * self.scaling
        # self_attention
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

        # Use the `embed_dim` from the config (stored in the class) rather than `hidden_state` because `attn_output` can be
        # partitioned across GPUs when using tensor-parallelism.
        attn_output = attn_output.reshape([bsz, tgt_len, self.embed_dim])

        attn_output = self.out_proj(attn_output)
        return attn_output, None


class BioGptDecoderLayer(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.embed_dim = config.hidden_size

        self.self_attn = BioGptAttention(
            embed_dim=self.embed_dim,
            num_heads=config.num_attention_heads,
            dropout=config.attention_probs_dropout_prob,
            is_decoder=True,
        )
        self.dropout = config.hidden_dropout_prob
        self.activation_fn = F.gelu
        self.activation_dropout = config.activation_dropout

        self.self_attn_layer_norm = nn.LayerNorm(self.embed_dim)

        self.fc1 = nn.Linear(self.embed_dim, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, self.embed_dim)
        self.final_layer_norm = nn.LayerNorm(self.embed_dim)

    def forward(self, hidden_states, attention_mask=None):
        residual = hidden_states

        hidden_states = self.self_attn_layer_norm(hidden_states)

        # Self Attention
        hidden_states, self_attn_weights = self.self_attn(hidden_states=hidden_states, attention_mask=attention_mask)
        hidden_states = F.dropout(hidden_states, p=self.dropout, training=self.training)
        hidden_states = residual + hidden_states

        # Fully Connected
        residual = hidden_states
        hidden_states = self.final_layer_norm(hidden_states)
        hidden_states = self.fc1(hidden_states)
        hidden_states = self.activation_fn(hidden_states)
        hidden_states = F.dropout(hidden_states, p=self.activation_dropout, training=self.training)
        hidden_states = self.fc2(hidden_states)
        hidden_states = F.dropout(hidden_states, p=self.dropout, training=self.training)
        hidden_states = residual + hidden_states
        return hidden_states


def causal_mask(inputs_embeds):
    seq = inputs_embeds.shape[1]
    full = paddle.full([seq, seq], float("-inf"), dtype=inputs_embeds.dtype)
    return paddle.triu(full, diagonal=1)[None, None, :, :]


class BioGptModel(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.dropout = config.hidden_dropout_prob
        self.embed_dim = config.hidden_size
        self.padding_idx = config.pad_token_id
        self.embed_scale = math.sqrt(config.hidden_size) if config.scale_embedding else 1.0

        self.embed_tokens = nn.Embedding(config.vocab_size, self.embed_dim, padding_idx=self.padding_idx)
        self.embed_positions = BioGptLearnedPositionalEmbedding(config.max_position_embeddings, self.embed_dim)

        self.layers = nn.LayerList([BioGptDecoderLayer(config) for _ in range(config.num_hidden_layers)])
        self.layer_norm = nn.LayerNorm(self.embed_dim)

    def forward(self, input_ids):
        inputs_embeds = self.embed_tokens(input_ids) * self.embed_scale
        attention_mask = paddle.ones(inputs_embeds.shape[:2], dtype="bool")
        # embed positions
        positions = self.embed_positions(attention_mask)
        mask = causal_mask(inputs_embeds)

        hidden_states = inputs_embeds + positions
        hidden_states = F.dropout(hidden_states, p=self.dropout, training=self.training)
        for decoder_layer in self.layers:
            hidden_states = decoder_layer(hidden_states, attention_mask=mask)
        hidden_states = self.layer_norm(hidden_states)
        return hidden_states


class BioGptForCausalLM(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.biogpt = BioGptModel(config)
        self.output_projection = nn.Linear(config.hidden_size, config.vocab_size, bias_attr=False)

    def forward(self, input_ids):
        return self.output_projection(self.biogpt(input_ids))


def build_model():
    return BioGptForCausalLM(BioGptConfig())


def input_spec():
    return [paddle.static.InputSpec([2, SEQ], "int64", "input_ids")]


def loss(model, tokens, labels):
    return F.cross_entropy(model(tokens).reshape([-1, VOCAB]), labels.reshape([-1]))
