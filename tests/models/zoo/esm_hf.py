"""ESM-2 as HuggingFace transformers writes it (src/transformers/models/esm/modeling_esm.py),
ported to Paddle at a small config (masked LM, ``EsmForMaskedLM``).

A pre-LN BERT with rotary positions: ``EsmAttention`` LayerNorms its input, the self-attention
(``query``/``key``/``value`` with biases, ``transpose_for_scores``) scales the query by
``head_size ** -0.5`` and then rotates query and key with ``RotaryEmbedding``, whose cos/sin
tables are cached on the layer in forward (``_update_cos_sin_tables``, recomputed when the
sequence length changes); ``EsmSelfOutput`` adds the residual with no norm. ``EsmLayer``
LayerNorms before its GELU intermediate. Token dropout: the embeddings of ``<mask>`` tokens are
zeroed and the rest rescaled by the observed mask ratio; the encoder ends with
``emb_layer_norm_after``; the LM head (dense, GELU, LayerNorm) decodes with the word embeddings
(tied) plus its own bias.

What differs from the torch code is spelling (``reshape`` for ``view``, ``transpose`` with the
whole permutation, ``axis`` for ``dim``, ``paddle.outer``); caches, contact prediction, SDPA and
flash paths are left out.

    >>> model = build_model()
    >>> list(model(paddle.randint(0, VOCAB, [2, 10])).shape)
    [2, 10, 33]
"""

import math

import paddle
import paddle.nn as nn
import paddle.nn.functional as F

VOCAB, SEQ = 33, 12


class EsmConfig:
    vocab_size = VOCAB
    hidden_size = 40
    num_hidden_layers = 2
    num_attention_heads = 4
    intermediate_size = 72
    hidden_dropout_prob = 0.0
    attention_probs_dropout_prob = 0.0
    layer_norm_eps = 1e-5
    pad_token_id = 1
    mask_token_id = 32
    token_dropout = True
    emb_layer_norm_before = False


def gelu(x):
    """ESM's own gelu (the erf form)."""
    return x * 0.5 * (1.0 + paddle.erf(x / math.sqrt(2.0)))


def rotate_half(x):
    x1, x2 = x.chunk(2, axis=-1)
    return paddle.concat((-x2, x1), axis=-1)


def apply_rotary_pos_emb(x, cos, sin):
    cos = cos[:, :, : x.shape[-2], :]
    sin = sin[:, :, : x.shape[-2], :]
    return (x * cos) + (rotate_half(x) * sin)


class RotaryEmbedding(nn.Layer):
    def __init__(self, dim: int):
        super().__init__()
        inv_freq = 1.0 / (10000 ** (paddle.arange(0, dim, 2, dtype="int64").astype("float32") / dim))
        self.register_buffer("inv_freq", inv_freq)
        self._seq_len_cached = None
        self._cos_cached = None
        self._sin_cached = None

    def _update_cos_sin_tables(self, x, seq_dimension=2):
        seq_len = x.shape[seq_dimension]
        if seq_len != self._seq_len_cached:
            self._seq_len_cached = seq_len
            t = paddle.arange(x.shape[seq_dimension]).astype(self.inv_freq.dtype)
            freqs = paddle.outer(t, self.inv_freq)
            emb = paddle.concat((freqs, freqs), axis=-1)
            self._cos_cached = emb.cos()[None, None, :, :]
            self._sin_cached = emb.sin()[None, None, :, :]
        return self._cos_cached, self._sin_cached

    def forward(self, q, k):
        self._cos_cached, self._sin_cached = self._update_cos_sin_tables(k, seq_dimension=-2)
        return (
            apply_rotary_pos_emb(q, self._cos_cached, self._sin_cached).astype(q.dtype),
            apply_rotary_pos_emb(k, self._cos_cached, self._sin_cached).astype(k.dtype),
        )


class EsmEmbeddings(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.layer_norm = nn.LayerNorm(config.hidden_size) if config.emb_layer_norm_before else None
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.padding_idx = config.pad_token_id
        self.token_dropout = config.token_dropout
        self.mask_token_id = config.mask_token_id

    def forward(self, input_ids, attention_mask):
        embeddings = self.word_embeddings(input_ids)
        if self.token_dropout:
            embeddings = embeddings.masked_fill((input_ids == self.mask_token_id).unsqueeze(-1), 0.0)
            mask_ratio_train = 0.15 * 0.8  # hardcoded as the ratio used in all ESM model training runs
            src_lengths = attention_mask.sum(-1)
            mask_ratio_observed = (input_ids == self.mask_token_id).sum(-1).astype("float32") / src_lengths
            embeddings = (embeddings * (1 - mask_ratio_train) / (1 - mask_ratio_observed)[:, None, None]).astype(
                embeddings.dtype
            )
        if self.layer_norm is not None:
            embeddings = self.layer_norm(embeddings)
        embeddings = (embeddings * attention_mask.unsqueeze(-1)).astype(embeddings.dtype)
        return self.dropout(embeddings)


class EsmSelfAttention(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.num_attention_heads = config.num_attention_heads
        self.attention_head_size = int(config.hidden_size / config.num_attention_heads)
        self.all_head_size = self.num_attention_heads * self.attention_head_size
        self.query = nn.Linear(config.hidden_size, self.all_head_size)
        self.key = nn.Linear(config.hidden_size, self.all_head_size)
        self.value = nn.Linear(config.hidden_size, self.all_head_size)
        self.dropout = nn.Dropout(config.attention_probs_dropout_prob)
        self.rotary_embeddings = RotaryEmbedding(dim=self.attention_head_size)

    def transpose_for_scores(self, x):
        new_x_shape = x.shape[:-1] + [self.num_attention_heads, self.attention_head_size]
        return x.reshape(new_x_shape).transpose([0, 2, 1, 3])

    def forward(self, hidden_states, attention_mask=None):
        query_layer = self.transpose_for_scores(self.query(hidden_states))
        key_layer = self.transpose_for_scores(self.key(hidden_states))
        value_layer = self.transpose_for_scores(self.value(hidden_states))
        # ESM scales the query down by the same factor as BERT, before rotary (as the original ESM code)
        query_layer = query_layer * self.attention_head_size**-0.5
        query_layer, key_layer = self.rotary_embeddings(query_layer, key_layer)
        attention_scores = paddle.matmul(query_layer, key_layer.transpose([0, 1, 3, 2]))
        if attention_mask is not None:
            attention_scores = attention_scores + attention_mask
        attention_probs = F.softmax(attention_scores, axis=-1)
        attention_probs = self.dropout(attention_probs)
        context_layer = paddle.matmul(attention_probs.astype(value_layer.dtype), value_layer)
        context_layer = context_layer.transpose([0, 2, 1, 3])
        new_context_layer_shape = context_layer.shape[:-2] + [self.all_head_size]
        return context_layer.reshape(new_context_layer_shape)


class EsmSelfOutput(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, hidden_states, input_tensor):
        hidden_states = self.dropout(self.dense(hidden_states))
        return hidden_states + input_tensor


class EsmAttention(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.self = EsmSelfAttention(config)
        self.output = EsmSelfOutput(config)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, epsilon=config.layer_norm_eps)

    def forward(self, hidden_states, attention_mask=None):
        hidden_states_ln = self.LayerNorm(hidden_states)
        self_outputs = self.self(hidden_states_ln, attention_mask)
        return self.output(self_outputs, hidden_states)


class EsmIntermediate(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)

    def forward(self, hidden_states):
        return gelu(self.dense(hidden_states))


class EsmOutput(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.intermediate_size, config.hidden_size)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, hidden_states, input_tensor):
        hidden_states = self.dropout(self.dense(hidden_states))
        return hidden_states + input_tensor


class EsmLayer(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.attention = EsmAttention(config)
        self.intermediate = EsmIntermediate(config)
        self.output = EsmOutput(config)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, epsilon=config.layer_norm_eps)

    def forward(self, hidden_states, attention_mask=None):
        attention_output = self.attention(hidden_states, attention_mask)
        return self.feed_forward_chunk(attention_output)

    def feed_forward_chunk(self, attention_output):
        attention_output_ln = self.LayerNorm(attention_output)
        intermediate_output = self.intermediate(attention_output_ln)
        return self.output(intermediate_output, attention_output)


class EsmEncoder(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.layer = nn.LayerList([EsmLayer(config) for _ in range(config.num_hidden_layers)])
        self.emb_layer_norm_after = nn.LayerNorm(config.hidden_size, epsilon=config.layer_norm_eps)

    def forward(self, hidden_states, attention_mask=None):
        for layer_module in self.layer:
            hidden_states = layer_module(hidden_states, attention_mask)
        return self.emb_layer_norm_after(hidden_states)


class EsmModel(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embeddings = EsmEmbeddings(config)
        self.encoder = EsmEncoder(config)

    def forward(self, input_ids, attention_mask=None):
        if attention_mask is None:
            attention_mask = paddle.ones_like(input_ids)
        embedding_output = self.embeddings(input_ids, attention_mask.astype("float32"))
        # get_extended_attention_mask: [batch, 1, 1, seq], 0 where attended, the dtype's min elsewhere
        extended_attention_mask = attention_mask[:, None, None, :].astype("float32")
        extended_attention_mask = (1.0 - extended_attention_mask) * float(paddle.finfo(paddle.float32).min)
        return self.encoder(embedding_output, extended_attention_mask)


class EsmLMHead(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.layer_norm = nn.LayerNorm(config.hidden_size, epsilon=config.layer_norm_eps)
        self.bias = self.create_parameter([config.vocab_size], is_bias=True)

    def forward(self, features, decoder_weight):
        x = gelu(self.dense(features))
        x = self.layer_norm(x)
        # the decoder is tied to the word embeddings (HF's tie_weights), plus the head's own bias
        return paddle.matmul(x, decoder_weight, transpose_y=True) + self.bias


class EsmForMaskedLM(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.esm = EsmModel(config)
        self.lm_head = EsmLMHead(config)

    def forward(self, input_ids, attention_mask=None):
        sequence_output = self.esm(input_ids, attention_mask)
        return self.lm_head(sequence_output, self.esm.embeddings.word_embeddings.weight)


def build_model():
    return EsmForMaskedLM(EsmConfig())


def input_spec():
    return [paddle.static.InputSpec([2, SEQ], "int64", "input_ids")]


def loss(model, tokens, labels):
    return F.cross_entropy(model(tokens).reshape([-1, VOCAB]), labels.reshape([-1]))
