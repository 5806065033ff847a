"""ALBERT as HF's modeling_albert writes it, ported to Paddle at a small config (masked LM).

Factorised embeddings (``embedding_size`` 16 projected to the hidden size by
``embedding_hidden_mapping_in``) and cross-layer sharing: one ``AlbertLayerGroup`` holding one
``AlbertLayer``, run ``num_hidden_layers`` times by the transformer's loop. Each layer: q/k/v and
``dense`` in one ``AlbertAttention`` (post-norm), ``ffn`` -> gelu_new -> ``ffn_output``, post-norm.

What differs from the torch code is spelling (``reshape`` for ``view``, ``transpose`` with the
whole permutation, ``axis`` for ``dim``); the SDPA and flash paths are left out. Planned blind at
mp2 (``--input-spec input_ids:int64:4x16`` and ``6x12``: the same plan): the one shared layer is
the one block, its attention and MLP split three times over the same weights.

    >>> model = build_model()
    >>> list(model(paddle.randint(0, VOCAB, [2, SEQ])).shape)
    [2, 16, 256]
"""

import math

import paddle
import paddle.nn as nn
import paddle.nn.functional as F

VOCAB, EMBED, HIDDEN, INTER, LAYERS, HEADS, SEQ = 256, 16, 40, 96, 3, 4, 16


class AlbertConfig:
    vocab_size = VOCAB
    embedding_size = EMBED
    hidden_size = HIDDEN
    num_hidden_layers = LAYERS
    num_hidden_groups = 1
    num_attention_heads = HEADS
    intermediate_size = INTER
    inner_group_num = 1
    hidden_act = "gelu_new"
    hidden_dropout_prob = 0.0
    attention_probs_dropout_prob = 0.0
    max_position_embeddings = 64
    type_vocab_size = 2
    layer_norm_eps = 1e-12


class AlbertEmbeddings(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.embedding_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.embedding_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.embedding_size)
        self.LayerNorm = nn.LayerNorm(config.embedding_size, epsilon=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.register_buffer(
            "position_ids", paddle.arange(config.max_position_embeddings).expand([1, -1]), persistable=False
        )
        self.register_buffer(
            "token_type_ids", paddle.zeros([1, config.max_position_embeddings], dtype="int64"), persistable=False
        )

    def forward(self, input_ids):
        seq_length = input_ids.shape[1]
        position_ids = self.position_ids[:, :seq_length]
        token_type_ids = self.token_type_ids[:, :seq_length].expand([input_ids.shape[0], seq_length])
        inputs_embeds = self.word_embeddings(input_ids)
        token_type_embeddings = self.token_type_embeddings(token_type_ids)
        embeddings = inputs_embeds + token_type_embeddings
        embeddings = embeddings + self.position_embeddings(position_ids)
        embeddings = self.LayerNorm(embeddings)
        embeddings = self.dropout(embeddings)
        return embeddings


class AlbertAttention(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.num_attention_heads = config.num_attention_heads
        self.hidden_size = config.hidden_size
        self.attention_head_size = config.hidden_size // config.num_attention_heads
        self.all_head_size = self.num_attention_heads * self.attention_head_size
        self.scaling = self.attention_head_size**-0.5
        self.query = nn.Linear(config.hidden_size, self.all_head_size)
        self.key = nn.Linear(config.hidden_size, self.all_head_size)
        self.value = nn.Linear(config.hidden_size, self.all_head_size)
        self.attention_dropout = nn.Dropout(config.attention_probs_dropout_prob)
        self.output_dropout = nn.Dropout(config.hidden_dropout_prob)
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, epsilon=config.layer_norm_eps)

    def forward(self, hidden_states, attention_mask=None):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.attention_head_size)

        query_layer = self.query(hidden_states).reshape(hidden_shape).transpose([0, 2, 1, 3])
        key_layer = self.key(hidden_states).reshape(hidden_shape).transpose([0, 2, 1, 3])
        value_layer = self.value(hidden_states).reshape(hidden_shape).transpose([0, 2, 1, 3])

        attn_weights = paddle.matmul(query_layer, key_layer.transpose([0, 1, 3, 2])) * self.scaling
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask
        attn_weights = F.softmax(attn_weights, axis=-1)
        attn_weights = self.attention_dropout(attn_weights)
        attn_output = paddle.matmul(attn_weights, value_layer).transpose([0, 2, 1, 3])

        attn_output = attn_output.reshape([*input_shape, -1])
        attn_output = self.dense(attn_output)
        attn_output = self.output_dropout(attn_output)
        attn_output = self.LayerNorm(hidden_states + attn_output)
        return attn_output, attn_weights


def gelu_new(x):
    return 0.5 * x * (1.0 + paddle.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * paddle.pow(x, 3.0))))


class AlbertLayer(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.full_layer_layer_norm = nn.LayerNorm(config.hidden_size, epsilon=config.layer_norm_eps)
        self.attention = AlbertAttention(config)
        self.ffn = nn.Linear(config.hidden_size, config.intermediate_size)
        self.ffn_output = nn.Linear(config.intermediate_size, config.hidden_size)
        self.activation = gelu_new
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, hidden_states, attention_mask=None):
        attention_output = self.attention(hidden_states, attention_mask)
        ffn_output = self.ff_chunk(attention_output[0])
        hidden_states = self.full_layer_layer_norm(ffn_output + attention_output[0])
        return (hidden_states,) + attention_output[1:]

    def ff_chunk(self, attention_output):
        ffn_output = self.ffn(attention_output)
        ffn_output = self.activation(ffn_output)
        ffn_output = self.ffn_output(ffn_output)
        return ffn_output


class AlbertLayerGroup(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.albert_layers = nn.LayerList([AlbertLayer(config) for _ in range(config.inner_group_num)])

    def forward(self, hidden_states, attention_mask=None):
        for layer_index, albert_layer in enumerate(self.albert_layers):
            layer_output = albert_layer(hidden_states, attention_mask)
            hidden_states = layer_output[0]
        return (hidden_states,)


class AlbertTransformer(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embedding_hidden_mapping_in = nn.Linear(config.embedding_size, config.hidden_size)
        self.albert_layer_groups = nn.LayerList([AlbertLayerGroup(config) for _ in range(config.num_hidden_groups)])

    def forward(self, hidden_states, attention_mask=None):
        hidden_states = self.embedding_hidden_mapping_in(hidden_states)
        for i in range(self.config.num_hidden_layers):
            # Index of the hidden group
            group_idx = int(i / (self.config.num_hidden_layers / self.config.num_hidden_groups))
            layer_group_output = self.albert_layer_groups[group_idx](hidden_states, attention_mask)
            hidden_states = layer_group_output[0]
        return hidden_states


class AlbertModel(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embeddings = AlbertEmbeddings(config)
        self.encoder = AlbertTransformer(config)

    def forward(self, input_ids):
        attention_mask = paddle.ones(input_ids.shape)
        extended_attention_mask = attention_mask.unsqueeze(1).unsqueeze(2)
        extended_attention_mask = (1.0 - extended_attention_mask) * -3.4028234663852886e38
        embedding_output = self.embeddings(input_ids)
        return self.encoder(embedding_output, extended_attention_mask)


class AlbertMLMHead(nn.Layer):
    def __init__(self, config, embedding_weights):
        super().__init__()
        self.LayerNorm = nn.LayerNorm(config.embedding_size, epsilon=config.layer_norm_eps)
        self.bias = self.create_parameter(shape=[config.vocab_size], is_bias=True)
        self.dense = nn.Linear(config.hidden_size, config.embedding_size)
        self.decoder_weight = embedding_weights  # tied to the word embeddings
        self.activation = gelu_new

    def forward(self, hidden_states):
        hidden_states = self.dense(hidden_states)
        hidden_states = self.activation(hidden_states)
        hidden_states = self.LayerNorm(hidden_states)
        return paddle.matmul(hidden_states, self.decoder_weight, transpose_y=True) + self.bias


class AlbertForMaskedLM(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.albert = AlbertModel(config)
        self.predictions = AlbertMLMHead(config, self.albert.embeddings.word_embeddings.weight)

    def forward(self, input_ids):
        return self.predictions(self.albert(input_ids))


def build_model():
    return AlbertForMaskedLM(AlbertConfig())


def input_spec():
    return [paddle.static.InputSpec([2, SEQ], "int64", "input_ids")]


def loss(model, tokens, labels):
    return F.cross_entropy(model(tokens).reshape([-1, VOCAB]), labels.reshape([-1]))
