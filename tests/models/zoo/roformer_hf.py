"""RoFormer as HF's modeling_roformer writes it, ported to Paddle at a small config (masked LM).

BERT's post-norm encoder with rotary positions instead of absolute ones: the encoder computes
one sinusoidal table (``RoFormerSinusoidalPositionalEmbedding``, sin in the first half, cos in the
second, no parameters) and hands ``[1, 1, seq, head_dim]`` to every layer; the self-attention
rotates query and key on interleaved pairs (``stack([-x[..., 1::2], x[..., ::2]]).reshape_as``)
after ``transpose_for_scores``. Extended additive attention mask from an all-ones mask, GELU
intermediate, an LM head transform (dense, gelu, LayerNorm) and a decoder tied to the word
embeddings with its own bias.

What differs from the torch code is spelling (``reshape`` for ``view``, ``transpose`` with the
whole permutation, ``axis`` for ``dim``); caches, SDPA and flash paths are left out. Planned
blind at mp2 (``--input-spec input_ids:int64:4x16`` and ``6x12``: the same plan).

    >>> model = build_model()
    >>> list(model(paddle.randint(0, VOCAB, [2, SEQ])).shape)
    [2, 16, 256]
"""

import math

import numpy as np
import paddle
import paddle.nn as nn
import paddle.nn.functional as F

VOCAB, HIDDEN, INTER, LAYERS, HEADS, SEQ = 256, 40, 96, 2, 4, 16


class RoFormerConfig:
    vocab_size = VOCAB
    embedding_size = HIDDEN
    hidden_size = HIDDEN
    num_hidden_layers = LAYERS
    num_attention_heads = HEADS
    intermediate_size = INTER
    hidden_act = "gelu"
    hidden_dropout_prob = 0.0
    attention_probs_dropout_prob = 0.0
    max_position_embeddings = 64
    type_vocab_size = 2
    layer_norm_eps = 1e-12
    rotary_value = False


class RoFormerSinusoidalPositionalEmbedding(nn.Embedding):
    """This module produces sinusoidal positional embeddings of any length."""

    def __init__(self, num_positions, embedding_dim):
        super().__init__(num_positions, embedding_dim)
        self.weight.set_value(self._init_weight(num_positions, embedding_dim))
        self.weight.stop_gradient = True

    @staticmethod
    def _init_weight(n_pos, dim):
        """Identical to the XLM create_sinusoidal_embeddings except features are not interleaved. The cos
        features are in the 2nd half of the vector. [dim // 2:]"""
        position_enc = np.array(
            [[pos / np.power(10000, 2 * (j // 2) / dim) for j in range(dim)] for pos in range(n_pos)]
        )
        out = np.zeros((n_pos, dim), dtype="float32")
        sentinel = dim // 2 if dim % 2 == 0 else (dim // 2) + 1
        out[:, 0:sentinel] = np.sin(position_enc[:, 0::2])
        out[:, sentinel:] = np.cos(position_enc[:, 1::2])
        return out

    def forward(self, input_ids_shape, past_key_values_length=0):
        """`input_ids_shape` is expected to be [bsz x seqlen]."""
        bsz, seq_len = input_ids_shape[:2]
        positions = paddle.arange(past_key_values_length, past_key_values_length + seq_len, dtype="int64")
        return super().forward(positions)


class RoFormerEmbeddings(nn.Layer):
    """Construct the embeddings from word and token_type embeddings."""

    def __init__(self, config):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.embedding_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.embedding_size)
        self.LayerNorm = nn.LayerNorm(config.embedding_size, epsilon=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, input_ids=None, token_type_ids=None):
        input_shape = input_ids.shape
        inputs_embeds = self.word_embeddings(input_ids)
        if token_type_ids is None:
            token_type_ids = paddle.zeros(input_shape, dtype="int64")
        token_type_embeddings = self.token_type_embeddings(token_type_ids)
        embeddings = inputs_embeds + token_type_embeddings
        embeddings = self.LayerNorm(embeddings)
        embeddings = self.dropout(embeddings)
        return embeddings


class RoFormerSelfAttention(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.num_attention_heads = config.num_attention_heads
        self.attention_head_size = int(config.hidden_size / config.num_attention_heads)
        self.all_head_size = self.num_attention_heads * self.attention_head_size

        self.query = nn.Linear(config.hidden_size, self.all_head_size)
        self.key = nn.Linear(config.hidden_size, self.all_head_size)
        self.value = nn.Linear(config.hidden_size, self.all_head_size)

        self.dropout = nn.Dropout(config.attention_probs_dropout_prob)
        self.rotary_value = config.rotary_value

    def transpose_for_scores(self, x):
        new_x_shape = x.shape[:-1] + [self.num_attention_heads, self.attention_head_size]
        x = x.reshape(new_x_shape)
        return x.transpose([0, 2, 1, 3])

    def forward(self, hidden_states, attention_mask=None, sinusoidal_pos=None):
        mixed_query_layer = self.query(hidden_states)
        query_layer = self.transpose_for_scores(mixed_query_layer)
        key_layer = self.transpose_for_scores(self.key(hidden_states))
        value_layer = self.transpose_for_scores(self.value(hidden_states))
        if sinusoidal_pos is not None:
            if self.rotary_value:
                query_layer, key_layer, value_layer = self.apply_rotary_position_embeddings(
                    sinusoidal_pos, query_layer, key_layer, value_layer
                )
            else:
                query_layer, key_layer = self.apply_rotary_position_embeddings(sinusoidal_pos, query_layer, key_layer)

        # Take the dot product between "query" and "key" to get the raw attention scores.
        attention_scores = paddle.matmul(query_layer, key_layer.transpose([0, 1, 3, 2]))
        attention_scores = attention_scores / math.sqrt(self.attention_head_size)
        if attention_mask is not None:
            # Apply the attention mask is (precomputed for all layers in RoFormerModel forward() function)
            attention_scores = attention_scores + attention_mask

        # Normalize the attention scores to probabilities.
        attention_probs = F.softmax(attention_scores, axis=-1)
        attention_probs = self.dropout(attention_probs)

        context_layer = paddle.matmul(attention_probs, value_layer)
        context_layer = context_layer.transpose([0, 2, 1, 3])
        new_context_layer_shape = context_layer.shape[:-2] + [self.all_head_size]
        context_layer = context_layer.reshape(new_context_layer_shape)
        return (context_layer,)

    @staticmethod
    def apply_rotary_position_embeddings(sinusoidal_pos, query_layer, key_layer, value_layer=None):
        # https://kexue.fm/archives/8265
        # sin [batch_size, num_heads, sequence_length, embed_size_per_head//2]
        # cos [batch_size, num_heads, sequence_length, embed_size_per_head//2]
        sin, cos = sinusoidal_pos.chunk(2, axis=-1)
        # sin [θ0,θ1,θ2......θd/2-1] -> sin_pos [θ0,θ0,θ1,θ1,θ2,θ2......θd/2-1,θd/2-1]
        sin_pos = paddle.stack([sin, sin], axis=-1).reshape(sinusoidal_pos.shape)
        # cos [θ0,θ1,θ2......θd/2-1] -> cos_pos [θ0,θ0,θ1,θ1,θ2,θ2......θd/2-1,θd/2-1]
        cos_pos = paddle.stack([cos, cos], axis=-1).reshape(sinusoidal_pos.shape)
        # rotate_half_query_layer [-q1,q0,-q3,q2......,-qd-1,qd-2]
        rotate_half_query_layer = paddle.stack([-query_layer[..., 1::2], query_layer[..., ::2]], axis=-1).reshape(
            query_layer.shape
        )
        query_layer = query_layer * cos_pos + rotate_half_query_layer * sin_pos
        # rotate_half_key_layer [-k1,k0,-k3,k2......,-kd-1,kd-2]
        rotate_half_key_layer = paddle.stack([-key_layer[..., 1::2], key_layer[..., ::2]], axis=-1).reshape(
            key_layer.shape
        )
        key_layer = key_layer * cos_pos + rotate_half_key_layer * sin_pos
        if value_layer is not None:
            # rotate_half_value_layer [-v1,v0,-v3,v2......,-vd-1,vd-2]
            rotate_half_value_layer = paddle.stack([-value_layer[..., 1::2], value_layer[..., ::2]], axis=-1).reshape(
                value_layer.shape
            )
            value_layer = value_layer * cos_pos + rotate_half_value_layer * sin_pos
            return query_layer, key_layer, value_layer
        return query_layer, key_layer


class RoFormerSelfOutput(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, epsilon=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, hidden_states, input_tensor):
        hidden_states = self.dense(hidden_states)
        hidden_states = self.dropout(hidden_states)
        hidden_states = self.LayerNorm(hidden_states + input_tensor)
        return hidden_states


class RoFormerAttention(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.self = RoFormerSelfAttention(config)
        self.output = RoFormerSelfOutput(config)

    def forward(self, hidden_states, attention_mask=None, sinusoidal_pos=None):
        self_outputs = self.self(hidden_states, attention_mask, sinusoidal_pos)
        attention_output = self.output(self_outputs[0], hidden_states)
        outputs = (attention_output,) + self_outputs[1:]
        return outputs


class RoFormerIntermediate(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)
        self.intermediate_act_fn = F.gelu

    def forward(self, hidden_states):
        hidden_states = self.dense(hidden_states)
        hidden_states = self.intermediate_act_fn(hidden_states)
        return hidden_states


class RoFormerOutput(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.intermediate_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, epsilon=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, hidden_states, input_tensor):
        hidden_states = self.dense(hidden_states)
        hidden_states = self.dropout(hidden_states)
        hidden_states = self.LayerNorm(hidden_states + input_tensor)
        return hidden_states


class RoFormerLayer(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.attention = RoFormerAttention(config)
        self.intermediate = RoFormerIntermediate(config)
        self.output = RoFormerOutput(config)

    def forward(self, hidden_states, attention_mask=None, sinusoidal_pos=None):
        self_attention_outputs = self.attention(hidden_states, attention_mask, sinusoidal_pos=sinusoidal_pos)
        attention_output = self_attention_outputs[0]
        intermediate_output = self.intermediate(attention_output)
        layer_output = self.output(intermediate_output, attention_output)
        return layer_output


class RoFormerEncoder(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_positions = RoFormerSinusoidalPositionalEmbedding(
            config.max_position_embeddings, config.hidden_size // config.num_attention_heads
        )
        self.layer = nn.LayerList([RoFormerLayer(config) for _ in range(config.num_hidden_layers)])

    def forward(self, hidden_states, attention_mask=None):
        # [sequence_length, embed_size_per_head] -> [batch_size, num_heads, sequence_length, embed_size_per_head]
        sinusoidal_pos = self.embed_positions(hidden_states.shape[:-1])[None, None, :, :]
        for layer_module in self.layer:
            hidden_states = layer_module(hidden_states, attention_mask, sinusoidal_pos)
        return hidden_states


class RoFormerModel(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embeddings = RoFormerEmbeddings(config)
        self.encoder = RoFormerEncoder(config)

    def get_extended_attention_mask(self, attention_mask, dtype):
        extended_attention_mask = attention_mask[:, None, None, :].astype(dtype)
        return (1.0 - extended_attention_mask) * -3.4028234663852886e38

    def forward(self, input_ids):
        input_shape = input_ids.shape
        attention_mask = paddle.ones(input_shape)
        embedding_output = self.embeddings(input_ids=input_ids)
        extended_attention_mask = self.get_extended_attention_mask(attention_mask, embedding_output.dtype)
        return self.encoder(embedding_output, attention_mask=extended_attention_mask)


class RoFormerPredictionHeadTransform(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.embedding_size)
        self.transform_act_fn = F.gelu
        self.LayerNorm = nn.LayerNorm(config.embedding_size, epsilon=config.layer_norm_eps)

    def forward(self, hidden_states):
        hidden_states = self.dense(hidden_states)
        hidden_states = self.transform_act_fn(hidden_states)
        hidden_states = self.LayerNorm(hidden_states)
        return hidden_states


class RoFormerLMPredictionHead(nn.Layer):
    def __init__(self, config, embedding_weights):
        super().__init__()
        self.transform = RoFormerPredictionHeadTransform(config)
        # The output weights are the input embeddings (tied), with an output-only bias for each token.
        self.decoder_weight = embedding_weights
        self.bias = self.create_parameter(shape=[config.vocab_size], is_bias=True)

    def forward(self, hidden_states):
        hidden_states = self.transform(hidden_states)
        return paddle.matmul(hidden_states, self.decoder_weight, transpose_y=True) + self.bias


class RoFormerOnlyMLMHead(nn.Layer):
    def __init__(self, config, embedding_weights):
        super().__init__()
        self.predictions = RoFormerLMPredictionHead(config, embedding_weights)

    def forward(self, sequence_output):
        return self.predictions(sequence_output)


class RoFormerForMaskedLM(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.roformer = RoFormerModel(config)
        self.cls = RoFormerOnlyMLMHead(config, self.roformer.embeddings.word_embeddings.weight)

    def forward(self, input_ids):
        return self.cls(self.roformer(input_ids))


def build_model():
    return RoFormerForMaskedLM(RoFormerConfig())


def input_spec():
    return [paddle.static.InputSpec([2, SEQ], "int64", "input_ids")]


def loss(model, tokens, labels):
    return F.cross_entropy(model(tokens).reshape([-1, VOCAB]), labels.reshape([-1]))
