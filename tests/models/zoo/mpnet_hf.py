"""MPNet as HuggingFace transformers writes it (src/transformers/models/mpnet/modeling_mpnet.py),
ported to Paddle at a small config (masked LM, ``MPNetForMaskedLM``).

A post-norm BERT whose attention projections are called ``q``/``k``/``v``/``o`` (all biased) and
whose positions are both absolute (RoBERTa-style position ids counted from ``padding_idx`` by a
``cumsum`` over the non-pad tokens) and relative: the encoder owns one
``relative_attention_bias`` Embedding ``[buckets, heads]``, looks it up at T5-style log buckets of
``memory_position - context_position`` (``relative_position_bucket``), permutes it to ``[1,
heads, q, k]`` and expands it over the batch (``compute_position_bias``), and every layer's
attention adds it to its scores (``attention_scores += position_bias``) with the extended
additive mask. The LM head (dense, GELU, LayerNorm) decodes with the word embeddings (tied) plus
its own bias.

What differs from the torch code is spelling (``reshape`` for ``view``, ``transpose`` with the
whole permutation, ``axis`` for ``dim``); head masks and attention outputs are left out.

    >>> model = build_model()
    >>> list(model(paddle.randint(0, VOCAB, [2, 10])).shape)
    [2, 10, 90]
"""

import math

import paddle
import paddle.nn as nn
import paddle.nn.functional as F

VOCAB, SEQ = 90, 12


class MPNetConfig:
    vocab_size = VOCAB
    hidden_size = 40
    num_hidden_layers = 2
    num_attention_heads = 4
    intermediate_size = 72
    hidden_dropout_prob = 0.0
    attention_probs_dropout_prob = 0.0
    max_position_embeddings = 24
    layer_norm_eps = 1e-12
    relative_attention_num_buckets = 32
    pad_token_id = 1


def create_position_ids_from_input_ids(input_ids, padding_idx):
    mask = (input_ids != padding_idx).astype("int32")
    incremental_indices = paddle.cumsum(mask, axis=1).astype(mask.dtype) * mask
    return incremental_indices.astype("int64") + padding_idx


class MPNetEmbeddings(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.padding_idx = 1
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=self.padding_idx)
        self.position_embeddings = nn.Embedding(
            config.max_position_embeddings, config.hidden_size, padding_idx=self.padding_idx
        )
        self.LayerNorm = nn.LayerNorm(config.hidden_size, epsilon=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, input_ids):
        position_ids = create_position_ids_from_input_ids(input_ids, self.padding_idx)
        embeddings = self.word_embeddings(input_ids) + self.position_embeddings(position_ids)
        return self.dropout(self.LayerNorm(embeddings))


class MPNetSelfAttention(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.num_attention_heads = config.num_attention_heads
        self.attention_head_size = int(config.hidden_size / config.num_attention_heads)
        self.all_head_size = self.num_attention_heads * self.attention_head_size
        self.q = nn.Linear(config.hidden_size, self.all_head_size)
        self.k = nn.Linear(config.hidden_size, self.all_head_size)
        self.v = nn.Linear(config.hidden_size, self.all_head_size)
        self.o = nn.Linear(config.hidden_size, config.hidden_size)
        self.dropout = nn.Dropout(config.attention_probs_dropout_prob)

    def transpose_for_scores(self, x):
        new_x_shape = x.shape[:-1] + [self.num_attention_heads, self.attention_head_size]
        return x.reshape(new_x_shape).transpose([0, 2, 1, 3])

    def forward(self, hidden_states, attention_mask=None, position_bias=None):
        q = self.transpose_for_scores(self.q(hidden_states))
        k = self.transpose_for_scores(self.k(hidden_states))
        v = self.transpose_for_scores(self.v(hidden_states))
        # Take the dot product between "query" and "key" to get the raw attention scores.
        attention_scores = paddle.matmul(q, k.transpose([0, 1, 3, 2]))
        attention_scores = attention_scores / math.sqrt(self.attention_head_size)
        # Apply relative position embedding (precomputed in MPNetEncoder) if provided.
        if position_bias is not None:
            attention_scores += position_bias
        if attention_mask is not None:
            attention_scores = attention_scores + attention_mask
        attention_probs = F.softmax(attention_scores, axis=-1)
        attention_probs = self.dropout(attention_probs)
        c = paddle.matmul(attention_probs, v)
        c = c.transpose([0, 2, 1, 3])
        new_c_shape = c.shape[:-2] + [self.all_head_size]
        c = c.reshape(new_c_shape)
        return self.o(c)


class MPNetAttention(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.attn = MPNetSelfAttention(config)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, epsilon=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, hidden_states, attention_mask=None, position_bias=None):
        self_outputs = self.attn(hidden_states, attention_mask, position_bias)
        return self.LayerNorm(self.dropout(self_outputs) + hidden_states)


class MPNetIntermediate(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)
        self.intermediate_act_fn = nn.GELU()

    def forward(self, hidden_states):
        return self.intermediate_act_fn(self.dense(hidden_states))


class MPNetOutput(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.intermediate_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, epsilon=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, hidden_states, input_tensor):
        hidden_states = self.dropout(self.dense(hidden_states))
        return self.LayerNorm(hidden_states + input_tensor)


class MPNetLayer(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.attention = MPNetAttention(config)
        self.intermediate = MPNetIntermediate(config)
        self.output = MPNetOutput(config)

    def forward(self, hidden_states, attention_mask=None, position_bias=None):
        attention_output = self.attention(hidden_states, attention_mask, position_bias=position_bias)
        intermediate_output = self.intermediate(attention_output)
        return self.output(intermediate_output, attention_output)


class MPNetEncoder(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.n_heads = config.num_attention_heads
        self.layer = nn.LayerList([MPNetLayer(config) for _ in range(config.num_hidden_layers)])
        self.relative_attention_bias = nn.Embedding(config.relative_attention_num_buckets, self.n_heads)

    def forward(self, hidden_states, attention_mask=None):
        position_bias = self.compute_position_bias(hidden_states)
        for layer_module in self.layer:
            hidden_states = layer_module(hidden_states, attention_mask, position_bias=position_bias)
        return hidden_states

    def compute_position_bias(self, x, position_ids=None, num_buckets=32):
        bsz, qlen, klen = x.shape[0], x.shape[1], x.shape[1]
        if position_ids is not None:
            context_position = position_ids[:, :, None]
            memory_position = position_ids[:, None, :]
        else:
            context_position = paddle.arange(qlen, dtype="int64")[:, None]
            memory_position = paddle.arange(klen, dtype="int64")[None, :]
        relative_position = memory_position - context_position
        rp_bucket = self.relative_position_bucket(relative_position, num_buckets=num_buckets)
        values = self.relative_attention_bias(rp_bucket)
        values = values.transpose([2, 0, 1]).unsqueeze(0)
        return values.expand((bsz, -1, qlen, klen))

    @staticmethod
    def relative_position_bucket(relative_position, num_buckets=32, max_distance=128):
        ret = 0
        n = -relative_position
        num_buckets //= 2
        ret += (n < 0).astype("int64") * num_buckets
        n = paddle.abs(n)
        max_exact = num_buckets // 2
        is_small = n < max_exact
        val_if_large = max_exact + (
            paddle.log(n.astype("float32") / max_exact) / math.log(max_distance / max_exact) * (num_buckets - max_exact)
        ).astype("int64")
        val_if_large = paddle.minimum(val_if_large, paddle.full_like(val_if_large, num_buckets - 1))
        ret += paddle.where(is_small, n, val_if_large)
        return ret


class MPNetModel(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.embeddings = MPNetEmbeddings(config)
        self.encoder = MPNetEncoder(config)

    def forward(self, input_ids, attention_mask=None):
        if attention_mask is None:
            attention_mask = paddle.ones(input_ids.shape)
        extended_attention_mask = attention_mask[:, None, None, :].astype("float32")
        extended_attention_mask = (1.0 - extended_attention_mask) * float(paddle.finfo(paddle.float32).min)
        embedding_output = self.embeddings(input_ids)
        return self.encoder(embedding_output, extended_attention_mask)


class MPNetLMHead(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.layer_norm = nn.LayerNorm(config.hidden_size, epsilon=config.layer_norm_eps)
        self.bias = self.create_parameter([config.vocab_size], is_bias=True)

    def forward(self, features, decoder_weight):
        x = F.gelu(self.dense(features))
        x = self.layer_norm(x)
        # the decoder is tied to the word embeddings (HF's tie_weights), plus the head's own bias
        return paddle.matmul(x, decoder_weight, transpose_y=True) + self.bias


class MPNetForMaskedLM(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.mpnet = MPNetModel(config)
        self.lm_head = MPNetLMHead(config)

    def forward(self, input_ids, attention_mask=None):
        sequence_output = self.mpnet(input_ids, attention_mask)
        return self.lm_head(sequence_output, self.mpnet.embeddings.word_embeddings.weight)


def build_model():
    return MPNetForMaskedLM(MPNetConfig())


def input_spec():
    return [paddle.static.InputSpec([2, SEQ], "int64", "input_ids")]


def loss(model, tokens, labels):
    return F.cross_entropy(model(tokens).reshape([-1, VOCAB]), labels.reshape([-1]))
