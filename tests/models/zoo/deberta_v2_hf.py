"""DeBERTa-v2/v3 as HF's modeling_deberta_v2 writes it, ported to Paddle at a small config
(masked LM, DeBERTa-v3's settings: ``relative_attention``, ``position_buckets``,
``pos_att_type`` ``p2c|c2p``, ``share_att_key``, ``norm_rel_ebd`` ``layer_norm``, no conv).

Disentangled attention: heads folded into the batch (``transpose_for_scores`` to
``[batch * heads, seq, head_dim]``), content-to-content scores by ``bmm``, plus
content-to-position and position-to-content scores: the encoder's one relative-position table
(LayerNorm'd) projected by the layer's own ``query_proj``/``key_proj`` (``share_att_key``),
``repeat``ed over the batch (``query_layer.shape[0] // num_attention_heads``), and gathered
(``take_along_axis``) at log-bucketed relative positions. The mask is applied by
``masked_fill``; BERT's post-norm output, GELU intermediate; the LM head's decoder tied to the
word embeddings, with its own bias.

What differs from the torch code is spelling (``reshape`` for ``view``, ``transpose`` with the
whole permutation, ``axis`` for ``dim``); caches, SDPA and flash paths are left out. Planned
blind at mp2 (``--input-spec input_ids:int64:4x16`` and ``6x12``: the same plan).
Its MLP splits as Megatron's. With the heads folded into the batch a split over heads has no
global-view layout, and its row projection (``attention.output.dense``) is no child of the layer
that holds q, k and v: ``attention.self`` runs as a local view whose output, each rank's heads, is
handed to that row projection split along its last dim (test_local_view_joined).

    >>> model = build_model()
    >>> list(model(paddle.randint(0, VOCAB, [2, SEQ])).shape)
    [2, 16, 256]
"""

import paddle
import paddle.nn as nn
import paddle.nn.functional as F

VOCAB, HIDDEN, INTER, LAYERS, HEADS, SEQ = 256, 40, 96, 2, 4, 16


class DebertaV2Config:
    vocab_size = VOCAB
    hidden_size = HIDDEN
    num_hidden_layers = LAYERS
    num_attention_heads = HEADS
    intermediate_size = INTER
    hidden_act = "gelu"
    hidden_dropout_prob = 0.0
    attention_probs_dropout_prob = 0.0
    max_position_embeddings = 64
    type_vocab_size = 0
    layer_norm_eps = 1e-7
    relative_attention = True
    max_relative_positions = -1
    position_buckets = 8
    norm_rel_ebd = "layer_norm"
    share_att_key = True
    pos_att_type = ["p2c", "c2p"]
    position_biased_input = False
    pad_token_id = 0


def make_log_bucket_position(relative_pos, bucket_size, max_position):
    sign = paddle.sign(relative_pos)
    mid = bucket_size // 2
    abs_pos = paddle.where(
        (relative_pos < mid) & (relative_pos > -mid),
        paddle.to_tensor(mid - 1).astype(relative_pos.dtype),
        paddle.abs(relative_pos),
    )
    log_pos = (
        paddle.ceil(
            paddle.log(abs_pos.astype("float32") / mid)
            / paddle.log(paddle.to_tensor((max_position - 1) / mid))
            * (mid - 1)
        )
        + mid
    )
    bucket_pos = paddle.where(abs_pos <= mid, relative_pos.astype(log_pos.dtype), log_pos * sign.astype(log_pos.dtype))
    return bucket_pos


def build_relative_position(query_layer, key_layer, bucket_size=-1, max_position=-1):
    query_size = query_layer.shape[-2]
    key_size = key_layer.shape[-2]

    q_ids = paddle.arange(query_size, dtype="int64")
    k_ids = paddle.arange(key_size, dtype="int64")
    rel_pos_ids = q_ids[:, None] - k_ids[None, :]
    if bucket_size > 0 and max_position > 0:
        rel_pos_ids = make_log_bucket_position(rel_pos_ids, bucket_size, max_position)
    rel_pos_ids = rel_pos_ids.astype("int64")
    rel_pos_ids = rel_pos_ids[:query_size, :]
    rel_pos_ids = rel_pos_ids.unsqueeze(0)
    return rel_pos_ids


class DebertaV2SelfOutput(nn.Layer):
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


class DisentangledSelfAttention(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.num_attention_heads = config.num_attention_heads
        _attention_head_size = config.hidden_size // config.num_attention_heads
        self.attention_head_size = getattr(config, "attention_head_size", _attention_head_size)
        self.all_head_size = self.num_attention_heads * self.attention_head_size
        self.query_proj = nn.Linear(config.hidden_size, self.all_head_size)
        self.key_proj = nn.Linear(config.hidden_size, self.all_head_size)
        self.value_proj = nn.Linear(config.hidden_size, self.all_head_size)

        self.share_att_key = getattr(config, "share_att_key", False)
        self.pos_att_type = config.pos_att_type if config.pos_att_type is not None else []
        self.relative_attention = getattr(config, "relative_attention", False)

        if self.relative_attention:
            self.position_buckets = getattr(config, "position_buckets", -1)
            self.max_relative_positions = getattr(config, "max_relative_positions", -1)
            if self.max_relative_positions < 1:
                self.max_relative_positions = config.max_position_embeddings
            self.pos_ebd_size = self.max_relative_positions
            if self.position_buckets > 0:
                self.pos_ebd_size = self.position_buckets

            self.pos_dropout = nn.Dropout(config.hidden_dropout_prob)

            if not self.share_att_key:
                if "c2p" in self.pos_att_type:
                    self.pos_key_proj = nn.Linear(config.hidden_size, self.all_head_size)
                if "p2c" in self.pos_att_type:
                    self.pos_query_proj = nn.Linear(config.hidden_size, self.all_head_size)

        self.dropout = nn.Dropout(config.attention_probs_dropout_prob)

    @staticmethod
    def transpose_for_scores(x, attention_heads):
        new_x_shape = x.shape[:-1] + [attention_heads, -1]
        x = x.reshape(new_x_shape)
        return x.transpose([0, 2, 1, 3]).reshape([-1, x.shape[1], x.shape[-1]])

    def forward(self, hidden_states, attention_mask, query_states=None, relative_pos=None, rel_embeddings=None):
        if query_states is None:
            query_states = hidden_states
        query_layer = self.transpose_for_scores(self.query_proj(query_states), self.num_attention_heads)
        key_layer = self.transpose_for_scores(self.key_proj(hidden_states), self.num_attention_heads)
        value_layer = self.transpose_for_scores(self.value_proj(hidden_states), self.num_attention_heads)

        rel_att = None
        # Take the dot product between "query" and "key" to get the raw attention scores.
        scale_factor = 1
        if "c2p" in self.pos_att_type:
            scale_factor += 1
        if "p2c" in self.pos_att_type:
            scale_factor += 1
        scale = paddle.sqrt(paddle.to_tensor(query_layer.shape[-1], dtype="float32") * scale_factor)
        attention_scores = paddle.bmm(query_layer, key_layer.transpose([0, 2, 1]) / scale.astype(query_layer.dtype))
        if self.relative_attention:
            rel_embeddings = self.pos_dropout(rel_embeddings)
            rel_att = self.disentangled_attention_bias(
                query_layer, key_layer, relative_pos, rel_embeddings, scale_factor
            )

        if rel_att is not None:
            attention_scores = attention_scores + rel_att
        attention_scores = attention_scores.reshape(
            [-1, self.num_attention_heads, attention_scores.shape[-2], attention_scores.shape[-1]]
        )

        attention_mask = attention_mask.astype("bool")
        attention_scores = attention_scores.masked_fill(~(attention_mask), paddle.finfo(query_layer.dtype).min)
        # bsz x height x length x dimension
        attention_probs = F.softmax(attention_scores, axis=-1)

        attention_probs = self.dropout(attention_probs)
        context_layer = paddle.bmm(
            attention_probs.reshape([-1, attention_probs.shape[-2], attention_probs.shape[-1]]), value_layer
        )
        context_layer = context_layer.reshape(
            [-1, self.num_attention_heads, context_layer.shape[-2], context_layer.shape[-1]]
        ).transpose([0, 2, 1, 3])
        new_context_layer_shape = context_layer.shape[:-2] + [-1]
        context_layer = context_layer.reshape(new_context_layer_shape)
        return (context_layer, None)

    def disentangled_attention_bias(self, query_layer, key_layer, relative_pos, rel_embeddings, scale_factor):
        if relative_pos is None:
            relative_pos = build_relative_position(
                query_layer,
                key_layer,
                bucket_size=self.position_buckets,
                max_position=self.max_relative_positions,
            )
        if relative_pos.dim() == 2:
            relative_pos = relative_pos.unsqueeze(0).unsqueeze(0)
        elif relative_pos.dim() == 3:
            relative_pos = relative_pos.unsqueeze(1)
        # bsz x height x query x key
        elif relative_pos.dim() != 4:
            raise ValueError(f"Relative position ids must be of dim 2 or 3 or 4. {relative_pos.dim()}")

        att_span = self.pos_ebd_size
        relative_pos = relative_pos.astype("int64")

        rel_embeddings = rel_embeddings[0 : att_span * 2, :].unsqueeze(0)
        if self.share_att_key:
            pos_query_layer = paddle.tile(
                self.transpose_for_scores(self.query_proj(rel_embeddings), self.num_attention_heads),
                [query_layer.shape[0] // self.num_attention_heads, 1, 1],
            )
            pos_key_layer = paddle.tile(
                self.transpose_for_scores(self.key_proj(rel_embeddings), self.num_attention_heads),
                [query_layer.shape[0] // self.num_attention_heads, 1, 1],
            )
        else:
            if "c2p" in self.pos_att_type:
                pos_key_layer = paddle.tile(
                    self.transpose_for_scores(self.pos_key_proj(rel_embeddings), self.num_attention_heads),
                    [query_layer.shape[0] // self.num_attention_heads, 1, 1],
                )
            if "p2c" in self.pos_att_type:
                pos_query_layer = paddle.tile(
                    self.transpose_for_scores(self.pos_query_proj(rel_embeddings), self.num_attention_heads),
                    [query_layer.shape[0] // self.num_attention_heads, 1, 1],
                )

        score = 0
        # content->position
        if "c2p" in self.pos_att_type:
            scale = paddle.sqrt(paddle.to_tensor(pos_key_layer.shape[-1], dtype="float32") * scale_factor)
            c2p_att = paddle.bmm(query_layer, pos_key_layer.transpose([0, 2, 1]))
            c2p_pos = paddle.clip(relative_pos + att_span, 0, att_span * 2 - 1)
            c2p_att = paddle.take_along_axis(
                c2p_att,
                c2p_pos.squeeze(0).expand([query_layer.shape[0], query_layer.shape[1], relative_pos.shape[-1]]),
                axis=-1,
            )
            score += c2p_att / scale.astype(c2p_att.dtype)

        # position->content
        if "p2c" in self.pos_att_type:
            scale = paddle.sqrt(paddle.to_tensor(pos_query_layer.shape[-1], dtype="float32") * scale_factor)
            if key_layer.shape[-2] != query_layer.shape[-2]:
                r_pos = build_relative_position(
                    key_layer,
                    key_layer,
                    bucket_size=self.position_buckets,
                    max_position=self.max_relative_positions,
                )
                r_pos = r_pos.unsqueeze(0)
            else:
                r_pos = relative_pos

            p2c_pos = paddle.clip(-r_pos + att_span, 0, att_span * 2 - 1)
            p2c_att = paddle.bmm(key_layer, pos_query_layer.transpose([0, 2, 1]))
            p2c_att = paddle.take_along_axis(
                p2c_att,
                p2c_pos.squeeze(0).expand([query_layer.shape[0], key_layer.shape[-2], key_layer.shape[-2]]),
                axis=-1,
            ).transpose([0, 2, 1])
            score += p2c_att / scale.astype(p2c_att.dtype)

        return score


class DebertaV2Attention(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.self = DisentangledSelfAttention(config)
        self.output = DebertaV2SelfOutput(config)
        self.config = config

    def forward(self, hidden_states, attention_mask, query_states=None, relative_pos=None, rel_embeddings=None):
        self_output, att_matrix = self.self(
            hidden_states,
            attention_mask,
            query_states=query_states,
            relative_pos=relative_pos,
            rel_embeddings=rel_embeddings,
        )
        if query_states is None:
            query_states = hidden_states
        attention_output = self.output(self_output, query_states)
        return (attention_output, None)


class DebertaV2Intermediate(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)
        self.intermediate_act_fn = F.gelu

    def forward(self, hidden_states):
        hidden_states = self.dense(hidden_states)
        hidden_states = self.intermediate_act_fn(hidden_states)
        return hidden_states


class DebertaV2Output(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.intermediate_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, epsilon=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.config = config

    def forward(self, hidden_states, input_tensor):
        hidden_states = self.dense(hidden_states)
        hidden_states = self.dropout(hidden_states)
        hidden_states = self.LayerNorm(hidden_states + input_tensor)
        return hidden_states


class DebertaV2Layer(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.attention = DebertaV2Attention(config)
        self.intermediate = DebertaV2Intermediate(config)
        self.output = DebertaV2Output(config)

    def forward(self, hidden_states, attention_mask, query_states=None, relative_pos=None, rel_embeddings=None):
        attention_output, att_matrix = self.attention(
            hidden_states,
            attention_mask,
            query_states=query_states,
            relative_pos=relative_pos,
            rel_embeddings=rel_embeddings,
        )
        intermediate_output = self.intermediate(attention_output)
        layer_output = self.output(intermediate_output, attention_output)
        return (layer_output, None)


class DebertaV2Encoder(nn.Layer):
    """Modified BertEncoder with relative position bias support"""

    def __init__(self, config):
        super().__init__()
        self.layer = nn.LayerList([DebertaV2Layer(config) for _ in range(config.num_hidden_layers)])
        self.relative_attention = getattr(config, "relative_attention", False)

        if self.relative_attention:
            self.max_relative_positions = getattr(config, "max_relative_positions", -1)
            if self.max_relative_positions < 1:
                self.max_relative_positions = config.max_position_embeddings

            self.position_buckets = getattr(config, "position_buckets", -1)
            pos_ebd_size = self.max_relative_positions * 2

            if self.position_buckets > 0:
                pos_ebd_size = self.position_buckets * 2

            self.rel_embeddings = nn.Embedding(pos_ebd_size, config.hidden_size)

        self.norm_rel_ebd = [x.strip() for x in getattr(config, "norm_rel_ebd", "none").lower().split("|")]

        if "layer_norm" in self.norm_rel_ebd:
            self.LayerNorm = nn.LayerNorm(config.hidden_size, epsilon=config.layer_norm_eps)

        self.conv = None

    def get_rel_embedding(self):
        rel_embeddings = self.rel_embeddings.weight if self.relative_attention else None
        if rel_embeddings is not None and ("layer_norm" in self.norm_rel_ebd):
            rel_embeddings = self.LayerNorm(rel_embeddings)
        return rel_embeddings

    def get_attention_mask(self, attention_mask):
        if attention_mask.dim() <= 2:
            extended_attention_mask = attention_mask.unsqueeze(1).unsqueeze(2)
            attention_mask = extended_attention_mask * extended_attention_mask.squeeze(-2).unsqueeze(-1)
        elif attention_mask.dim() == 3:
            attention_mask = attention_mask.unsqueeze(1)
        return attention_mask

    def get_rel_pos(self, hidden_states, query_states=None, relative_pos=None):
        if self.relative_attention and relative_pos is None:
            if query_states is not None:
                relative_pos = build_relative_position(
                    query_states,
                    hidden_states,
                    bucket_size=self.position_buckets,
                    max_position=self.max_relative_positions,
                )
            else:
                relative_pos = build_relative_position(
                    hidden_states,
                    hidden_states,
                    bucket_size=self.position_buckets,
                    max_position=self.max_relative_positions,
                )
        return relative_pos

    def forward(self, hidden_states, attention_mask, query_states=None, relative_pos=None):
        attention_mask = self.get_attention_mask(attention_mask)
        relative_pos = self.get_rel_pos(hidden_states, query_states, relative_pos)

        next_kv = hidden_states
        rel_embeddings = self.get_rel_embedding()
        for i, layer_module in enumerate(self.layer):
            output_states, attn_weights = layer_module(
                next_kv,
                attention_mask,
                query_states=query_states,
                relative_pos=relative_pos,
                rel_embeddings=rel_embeddings,
            )
            if query_states is not None:
                query_states = output_states
            else:
                next_kv = output_states
        return output_states


class DebertaV2Embeddings(nn.Layer):
    """Construct the embeddings from word, position and token_type embeddings."""

    def __init__(self, config):
        super().__init__()
        self.embedding_size = getattr(config, "embedding_size", config.hidden_size)
        self.word_embeddings = nn.Embedding(config.vocab_size, self.embedding_size, padding_idx=config.pad_token_id)
        self.position_biased_input = getattr(config, "position_biased_input", True)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, epsilon=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.config = config

    def forward(self, input_ids=None, mask=None):
        inputs_embeds = self.word_embeddings(input_ids)
        embeddings = inputs_embeds
        embeddings = self.LayerNorm(embeddings)
        if mask is not None:
            if mask.dim() != embeddings.dim():
                if mask.dim() == 4:
                    mask = mask.squeeze(1).squeeze(1)
                mask = mask.unsqueeze(2)
            mask = mask.astype(embeddings.dtype)
            embeddings = embeddings * mask
        embeddings = self.dropout(embeddings)
        return embeddings


class DebertaV2Model(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.embeddings = DebertaV2Embeddings(config)
        self.encoder = DebertaV2Encoder(config)
        self.config = config

    def forward(self, input_ids):
        attention_mask = paddle.ones(input_ids.shape, dtype="int64")
        embedding_output = self.embeddings(input_ids=input_ids, mask=attention_mask)
        return self.encoder(embedding_output, attention_mask)


class DebertaV2LMPredictionHead(nn.Layer):
    def __init__(self, config, embedding_weights):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.transform_act_fn = F.gelu
        self.LayerNorm = nn.LayerNorm(config.hidden_size, epsilon=config.layer_norm_eps)
        self.decoder_weight = embedding_weights  # tied to the word embeddings
        self.bias = self.create_parameter(shape=[config.vocab_size], is_bias=True)

    def forward(self, hidden_states):
        hidden_states = self.dense(hidden_states)
        hidden_states = self.transform_act_fn(hidden_states)
        hidden_states = self.LayerNorm(hidden_states)
        return paddle.matmul(hidden_states, self.decoder_weight, transpose_y=True) + self.bias


class DebertaV2ForMaskedLM(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.deberta = DebertaV2Model(config)
        self.lm_predictions = DebertaV2LMPredictionHead(config, self.deberta.embeddings.word_embeddings.weight)

    def forward(self, input_ids):
        return self.lm_predictions(self.deberta(input_ids))


def build_model():
    return DebertaV2ForMaskedLM(DebertaV2Config())


def input_spec():
    return [paddle.static.InputSpec([2, SEQ], "int64", "input_ids")]


def loss(model, tokens, labels):
    return F.cross_entropy(model(tokens).reshape([-1, VOCAB]), labels.reshape([-1]))
