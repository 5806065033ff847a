"""Perceiver IO as HF's modeling_perceiver writes it (``PerceiverForMaskedLM``), ported to Paddle at
a small config.

A text preprocessor (token and learned position embeddings) feeds the encoder's one
cross-attention: its queries are the learned latents (``PerceiverEmbeddings.latents``, expanded
over the batch), its keys and values the embedded inputs, at different widths (``q_dim`` =
``d_latents`` 40, ``kv_dim`` = ``d_model`` 48; ``cross_attention_shape_for_attention="kv"``:
``qk_channels`` 48). A ``LayerList`` of self-attention ``PerceiverLayer``s follows on the latents.
The decoder (``PerceiverBasicDecoder``) cross-attends from learned output queries
(``PerceiverTrainablePositionEncoding``, ``q_dim`` = ``d_model``) to the latents (``kv_dim`` =
``d_latents``) with ``qk_channels`` 32 and ``v_channels`` 48, no query residual; the logits reuse
the token table (``PerceiverEmbeddingDecoder``: ``x @ embeddings.weight.T + bias``). Every
attention is ``PerceiverSelfAttention`` (``query``/``key``/``value`` after ``layernorm1`` and, in
a cross-attention, ``layernorm2`` on the inputs) with ``PerceiverSelfOutput.dense`` after it, and
an MLP of ``dense1``/``dense2``. So two of the model's four attentions are lone layers, not in a
``LayerList``.

What differs from the torch code is spelling (``reshape`` for ``view``, ``transpose`` with the
whole permutation, ``axis`` for ``dim``); ``return_dict``, ``output_attentions``, chunked feed
forward and the image/audio/multimodal pre- and post-processors are left out. The MLM logits
cover ``max_position_embeddings`` positions as HF's do (inputs padded to that length there);
:func:`loss` reads the first ``seq`` of them. The keyword lists ``PerceiverAttention`` and
``PerceiverLayer`` repeat to pass down (what ``duplicates`` lists in this file) are HF's, kept as
HF writes them.

    >>> model = build_model()
    >>> list(model(paddle.randint(0, VOCAB, [2, MAXPOS])).shape)
    [2, 16, 64]
"""

import math
from dataclasses import dataclass

import paddle
import paddle.nn as nn
import paddle.nn.functional as F

VOCAB, MAXPOS = 64, 16


@dataclass
class PerceiverConfig:
    num_latents: int = 6
    d_latents: int = 40
    d_model: int = 48
    num_blocks: int = 1
    num_self_attends_per_block: int = 2
    num_self_attention_heads: int = 4
    num_cross_attention_heads: int = 2
    qk_channels: int | None = None
    v_channels: int | None = None
    cross_attention_shape_for_attention: str = "kv"
    self_attention_widening_factor: int = 1
    cross_attention_widening_factor: int = 1
    hidden_act: str = "gelu"
    attention_probs_dropout_prob: float = 0.1
    use_query_residual: bool = True
    vocab_size: int = VOCAB
    max_position_embeddings: int = MAXPOS
    # PerceiverForMaskedLM's decoder: HF's 8 heads of qk_channels 8 * 32, tiny here
    decoder_num_heads: int = 4
    decoder_qk_channels: int = 32
    num_labels: int = 3


ACT2FN = {"gelu": F.gelu}


class PerceiverEmbeddings(nn.Layer):
    """Construct the latent embeddings."""

    def __init__(self, config):
        super().__init__()
        self.latents = self.create_parameter(
            [config.num_latents, config.d_latents], default_initializer=nn.initializer.Normal()
        )

    def forward(self, batch_size: int):
        return self.latents.expand([batch_size, -1, -1])  # Thanks, Phil Wang


class PerceiverSelfAttention(nn.Layer):
    """Multi-headed {cross, self}-attention. Can be used both in the encoder as well as in the decoder."""

    def __init__(
        self, config, is_cross_attention=False, qk_channels=None, v_channels=None, num_heads=1, q_dim=None, kv_dim=None
    ):
        super().__init__()
        self.num_heads = num_heads
        # Q and K must have the same number of channels.
        # Default to preserving Q's input's shape.
        if qk_channels is None:
            qk_channels = q_dim
        # V's num_channels determines the shape of the output of QKV-attention.
        # Default to the same number of channels used in the key-query operation.
        if v_channels is None:
            v_channels = qk_channels
        if qk_channels % num_heads != 0:
            raise ValueError(f"qk_channels ({qk_channels}) must be divisible by num_heads ({num_heads}).")
        if v_channels % num_heads != 0:
            raise ValueError(f"v_channels ({v_channels}) must be divisible by num_heads ({num_heads}).")

        self.qk_channels = qk_channels
        self.v_channels = v_channels
        self.qk_channels_per_head = self.qk_channels // num_heads
        self.v_channels_per_head = self.v_channels // num_heads

        # Layer normalization
        self.layernorm1 = nn.LayerNorm(q_dim)
        self.layernorm2 = nn.LayerNorm(kv_dim) if is_cross_attention else nn.Identity()

        # Projection matrices
        self.query = nn.Linear(q_dim, qk_channels)
        self.key = nn.Linear(kv_dim, qk_channels)
        self.value = nn.Linear(kv_dim, v_channels)

        self.dropout = nn.Dropout(config.attention_probs_dropout_prob)

    def transpose_for_scores(self, x, channels_per_head):
        new_x_shape = x.shape[:-1] + [self.num_heads, channels_per_head]
        x = x.reshape(new_x_shape)
        return x.transpose([0, 2, 1, 3])

    def forward(self, hidden_states, attention_mask=None, inputs=None, inputs_mask=None, output_attentions=False):
        hidden_states = self.layernorm1(hidden_states)
        inputs = self.layernorm2(inputs)

        # Project queries, keys and values to a common feature dimension. If this is instantiated as a
        # cross-attention module, the keys and values come from the inputs; the attention mask needs to be
        # such that the inputs's non-relevant tokens are not attended to.
        is_cross_attention = inputs is not None
        queries = self.query(hidden_states)

        if is_cross_attention:
            keys = self.key(inputs)
            values = self.value(inputs)
            attention_mask = inputs_mask
        else:
            keys = self.key(hidden_states)
            values = self.value(hidden_states)

        # Reshape channels for multi-head attention.
        # We reshape from (batch_size, time, channels) to (batch_size, num_heads, time, channels per head)
        queries = self.transpose_for_scores(queries, self.qk_channels_per_head)
        keys = self.transpose_for_scores(keys, self.qk_channels_per_head)
        values = self.transpose_for_scores(values, self.v_channels_per_head)

        # Take the dot product between the queries and keys to get the raw attention scores.
        attention_scores = paddle.matmul(queries, keys.transpose([0, 1, 3, 2]))

        batch_size, num_heads, seq_len, q_head_dim = queries.shape
        _, _, _, v_head_dim = values.shape
        hiddens = self.num_heads * v_head_dim

        attention_scores = attention_scores / math.sqrt(q_head_dim)

        if attention_mask is not None:
            # Apply the attention mask (precomputed for all layers in PerceiverModel forward() function)
            attention_scores = attention_scores + attention_mask

        # Normalize the attention scores to probabilities.
        attention_probs = nn.Softmax(axis=-1)(attention_scores)

        # This is actually dropping out entire tokens to attend to, which might
        # seem a bit unusual, but is taken from the original Transformer paper.
        attention_probs = self.dropout(attention_probs)

        context_layer = paddle.matmul(attention_probs, values)

        context_layer = context_layer.transpose([0, 2, 1, 3])
        new_context_layer_shape = context_layer.shape[:-2] + [hiddens]
        context_layer = context_layer.reshape(new_context_layer_shape)

        outputs = (context_layer, attention_probs) if output_attentions else (context_layer,)

        return outputs


class PerceiverSelfOutput(nn.Layer):
    def __init__(self, config, input_channels, output_channels):
        super().__init__()
        self.dense = nn.Linear(input_channels, output_channels)

    def forward(self, hidden_states):
        hidden_states = self.dense(hidden_states)
        return hidden_states


class PerceiverAttention(nn.Layer):
    """Attention module, including a dense block."""

    def __init__(
        self,
        config,
        is_cross_attention=False,
        qk_channels=None,
        v_channels=None,
        num_heads=1,
        q_dim=None,
        kv_dim=None,
        use_query_residual=True,
    ):
        super().__init__()
        # MultiHead attention
        if is_cross_attention and qk_channels is None:
            if config.cross_attention_shape_for_attention == "q":
                qk_channels = q_dim
            elif config.cross_attention_shape_for_attention == "kv":
                qk_channels = kv_dim
            else:
                raise ValueError(
                    f"Unknown value {config.cross_attention_shape_for_attention} for "
                    "cross_attention_shape_for_attention."
                )
        else:
            if qk_channels is None:
                qk_channels = q_dim
            if v_channels is None:
                v_channels = qk_channels
        self.self = PerceiverSelfAttention(
            config,
            is_cross_attention=is_cross_attention,
            qk_channels=qk_channels,
            v_channels=v_channels,
            num_heads=num_heads,
            q_dim=q_dim,
            kv_dim=kv_dim,
        )
        # dense block
        output_channels = None
        if is_cross_attention:
            output_channels = q_dim
        else:
            if output_channels is None:
                output_channels = v_channels
        self.output = PerceiverSelfOutput(config, input_channels=self.self.v_channels, output_channels=output_channels)
        self.use_query_residual = use_query_residual

    def forward(self, hidden_states, attention_mask=None, inputs=None, inputs_mask=None, output_attentions=False):
        self_outputs = self.self(hidden_states, attention_mask, inputs, inputs_mask, output_attentions)

        # Output projection
        attention_output = self.output(self_outputs[0])

        # Optionally include a residual to the original queries.
        # Consider omitting the residual if the semantics of query and output
        # are different, e.g. if queries are positions and outputs are pixels.
        if self.use_query_residual:
            attention_output = attention_output + hidden_states

        outputs = (attention_output,) + self_outputs[1:]  # add attentions if we output them
        return outputs


class PerceiverMLP(nn.Layer):
    """A Transformer-style dense module to follow attention."""

    def __init__(self, config, input_size, widening_factor):
        super().__init__()
        self.dense1 = nn.Linear(input_size, widening_factor * input_size)
        self.intermediate_act_fn = ACT2FN[config.hidden_act]
        self.dense2 = nn.Linear(widening_factor * input_size, input_size)

    def forward(self, hidden_states):
        hidden_states = self.dense1(hidden_states)
        hidden_states = self.intermediate_act_fn(hidden_states)
        hidden_states = self.dense2(hidden_states)
        return hidden_states


class PerceiverLayer(nn.Layer):
    def __init__(
        self,
        config,
        is_cross_attention=False,
        qk_channels=None,
        v_channels=None,
        num_heads=1,
        q_dim=None,
        kv_dim=None,
        widening_factor=4,
        use_query_residual=True,
    ):
        super().__init__()
        self.seq_len_dim = 1
        self.attention = PerceiverAttention(
            config,
            is_cross_attention=is_cross_attention,
            qk_channels=qk_channels,
            v_channels=v_channels,
            num_heads=num_heads,
            q_dim=q_dim,
            kv_dim=kv_dim,
            use_query_residual=use_query_residual,
        )
        self.layernorm = nn.LayerNorm(q_dim)
        self.mlp = PerceiverMLP(config, input_size=q_dim, widening_factor=widening_factor)

    def forward(self, hidden_states, attention_mask=None, inputs=None, inputs_mask=None, output_attentions=False):
        attention_outputs = self.attention(hidden_states, attention_mask, inputs, inputs_mask, output_attentions)
        attention_output = attention_outputs[0]

        outputs = attention_outputs[1:]  # add attentions if we output attention weights

        layer_output = self.feed_forward_chunk(attention_output)

        layer_output = layer_output + attention_output  # residual connection

        outputs = (layer_output,) + outputs

        return outputs

    def feed_forward_chunk(self, attention_output):
        layer_output = self.layernorm(attention_output)
        layer_output = self.mlp(layer_output)
        return layer_output


class PerceiverEncoder(nn.Layer):
    """The Perceiver Encoder: a scalable, fully attentional encoder."""

    def __init__(self, config, kv_dim=None):
        super().__init__()
        self.config = config

        # Check that we can use multihead-attention with these shapes.
        if config.d_latents % config.num_self_attention_heads != 0:
            raise ValueError(
                f"num_z_channels ({config.d_latents}) must be divisible by"
                f" num_self_attend_heads ({config.num_self_attention_heads})."
            )
        if config.d_latents % config.num_cross_attention_heads != 0:
            raise ValueError(
                f"num_z_channels ({config.d_latents}) must be divisible by"
                f" num_cross_attend_heads ({config.num_cross_attention_heads})."
            )

        # Construct the cross attention layer.
        self.cross_attention = PerceiverLayer(
            config,
            is_cross_attention=True,
            qk_channels=config.qk_channels,
            v_channels=config.v_channels,
            num_heads=config.num_cross_attention_heads,
            q_dim=config.d_latents,
            kv_dim=kv_dim,
            widening_factor=config.cross_attention_widening_factor,
            use_query_residual=config.use_query_residual,
        )

        # Construct a single block of self-attention layers.
        # We get deeper architectures by applying this block more than once.
        self_attention_layers = []
        for _ in range(config.num_self_attends_per_block):
            layer = PerceiverLayer(
                config,
                is_cross_attention=False,
                qk_channels=config.qk_channels,
                v_channels=config.v_channels,
                num_heads=config.num_self_attention_heads,
                q_dim=config.d_latents,
                kv_dim=config.d_latents,
                widening_factor=config.self_attention_widening_factor,
            )
            self_attention_layers.append(layer)

        self.self_attends = nn.LayerList(self_attention_layers)

    def forward(self, hidden_states, attention_mask=None, inputs=None, inputs_mask=None):
        # Apply the cross-attention between the latents (hidden_states) and inputs:
        layer_outputs = self.cross_attention(
            hidden_states, attention_mask=attention_mask, inputs=inputs, inputs_mask=inputs_mask
        )
        hidden_states = layer_outputs[0]

        # Apply the block of self-attention layers more than once:
        for _ in range(self.config.num_blocks):
            for i, layer_module in enumerate(self.self_attends):
                layer_outputs = layer_module(hidden_states, attention_mask=attention_mask)
                hidden_states = layer_outputs[0]

        return (hidden_states,)


class PerceiverTrainablePositionEncoding(nn.Layer):
    """Trainable position encoding."""

    def __init__(self, index_dims, num_channels=128):
        super().__init__()
        self._num_channels = num_channels
        self._index_dims = index_dims
        index_dim = math.prod([index_dims] if isinstance(index_dims, int) else index_dims)
        self.position_embeddings = self.create_parameter(
            [index_dim, num_channels], default_initializer=nn.initializer.Normal()
        )

    def output_size(self, *args, **kwargs) -> int:
        return self._num_channels

    def forward(self, batch_size):
        position_embeddings = self.position_embeddings
        if batch_size is not None:
            position_embeddings = position_embeddings.expand([batch_size, -1, -1])
        return position_embeddings


class PerceiverBasicDecoder(nn.Layer):
    """Cross-attention-based decoder: the output queries (a trainable position encoding) attend to
    the final latents, which produce keys and values (``position_encoding_type="trainable"`` only)."""

    def __init__(
        self,
        config,
        output_num_channels,
        output_index_dims=None,
        num_channels=128,
        qk_channels=None,
        v_channels=None,
        num_heads=1,
        widening_factor=1,
        use_query_residual=False,
        final_project=True,
        trainable_position_encoding_kwargs=None,
    ):
        super().__init__()
        self.output_num_channels = output_num_channels
        self.output_position_encodings = PerceiverTrainablePositionEncoding(**trainable_position_encoding_kwargs)
        self.positions_projection = nn.Identity()
        self.output_index_dims = output_index_dims
        self.num_channels = num_channels
        self.final_project = final_project
        self.decoding_cross_attention = PerceiverLayer(
            config,
            is_cross_attention=True,
            qk_channels=qk_channels,
            v_channels=v_channels,
            num_heads=num_heads,
            q_dim=num_channels,
            kv_dim=config.d_latents,
            widening_factor=widening_factor,
            use_query_residual=use_query_residual,
        )
        self.final_layer = nn.Linear(num_channels, output_num_channels) if final_project else nn.Identity()

    def decoder_query(self, inputs, modality_sizes=None, inputs_without_pos=None, subsampled_points=None):
        batch_size = inputs.shape[0]
        # Construct the position encoding.
        pos_emb = self.output_position_encodings(batch_size)
        # Optionally project them to a target dimension.
        pos_emb = self.positions_projection(pos_emb)
        return pos_emb

    def forward(self, query, z, query_mask=None, output_attentions=False):
        # Cross-attention decoding.
        # key, value: B x N x K; query: B x M x K
        # Attention maps -> B x N x M
        # Output -> B x M x K
        layer_outputs = self.decoding_cross_attention(query, attention_mask=query_mask, inputs=z, inputs_mask=None)
        output = layer_outputs[0]
        logits = self.final_layer(output)
        return logits


class PerceiverClassificationDecoder(nn.Layer):
    """Cross-attention based classification decoder. Light-weight wrapper of [`PerceiverBasicDecoder`] for logit output.
    Will turn the output of the Perceiver encoder which is of shape (batch_size, num_latents, d_latents) to a tensor of
    shape (batch_size, num_labels). The queries are of shape (batch_size, 1, num_labels)."""

    def __init__(self, config, **decoder_kwargs):
        super().__init__()

        self.num_labels = config.num_labels
        self.decoder = PerceiverBasicDecoder(
            config,
            output_num_channels=self.num_labels,
            output_index_dims=1,  # Predict a single logit array.
            **decoder_kwargs,
        )

    def decoder_query(self, inputs, modality_sizes=None, inputs_without_pos=None, subsampled_points=None):
        return self.decoder.decoder_query(
            inputs, modality_sizes, inputs_without_pos, subsampled_points=subsampled_points
        )

    def forward(self, query, z, query_mask=None, output_attentions=False):
        logits = self.decoder(query, z, output_attentions=output_attentions)

        # B x 1 x num_classes -> B x num_classes
        logits = logits[:, 0, :]

        return logits


class PerceiverTextPreprocessor(nn.Layer):
    """Text preprocessing for Perceiver Encoder: token and learned position embeddings."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embeddings = nn.Embedding(num_embeddings=config.vocab_size, embedding_dim=config.d_model)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.d_model)

    @property
    def num_channels(self) -> int:
        return self.config.d_model

    def forward(self, inputs, pos=None, network_input_is_1d=True, interpolate_pos_encoding=False):
        embeddings_without_pos = self.embeddings(inputs)

        seq_length = inputs.shape[1]
        position_ids = paddle.arange(0, seq_length)
        embeddings = embeddings_without_pos + self.position_embeddings(position_ids)

        return embeddings, None, embeddings_without_pos


class PerceiverEmbeddingDecoder(nn.Layer):
    """Module to decode embeddings (for masked language modeling): the logits reuse the token table."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.vocab_size = config.vocab_size
        self.bias = self.create_parameter([self.vocab_size], is_bias=True)

    def forward(self, hidden_states, embedding_layer):
        batch_size, seq_len, d_model = hidden_states.shape
        # Flatten batch dim
        output = paddle.matmul(hidden_states.reshape([-1, d_model]), embedding_layer.weight.transpose([1, 0]))
        output = output + self.bias

        return output.reshape([batch_size, seq_len, self.vocab_size])


class PerceiverModel(nn.Layer):
    def __init__(self, config, decoder=None, input_preprocessor=None):
        super().__init__()
        self.config = config
        self.input_preprocessor = input_preprocessor
        self.embeddings = PerceiverEmbeddings(config)
        self.encoder = PerceiverEncoder(
            config, kv_dim=input_preprocessor.num_channels if input_preprocessor is not None else config.d_model
        )
        self.decoder = decoder

    def invert_attention_mask(self, encoder_attention_mask):
        encoder_extended_attention_mask = encoder_attention_mask[:, None, None, :]
        return (1.0 - encoder_extended_attention_mask) * paddle.finfo(encoder_extended_attention_mask.dtype).min

    def forward(self, inputs, attention_mask=None):
        inputs, modality_sizes, inputs_without_pos = self.input_preprocessor(inputs)

        batch_size, seq_length, _ = inputs.shape

        # If no attention mask is provided, make them all ones
        if attention_mask is None:
            attention_mask = paddle.ones((batch_size, seq_length))
        # Make the attention mask broadcastable to [batch_size, num_heads, seq_length, seq_length]
        extended_attention_mask = self.invert_attention_mask(attention_mask)

        embedding_output = self.embeddings(batch_size=batch_size)

        encoder_outputs = self.encoder(
            embedding_output, attention_mask=None, inputs=inputs, inputs_mask=extended_attention_mask
        )
        sequence_output = encoder_outputs[0]

        decoder_query = self.decoder.decoder_query(inputs, modality_sizes, inputs_without_pos)
        logits = self.decoder(decoder_query, z=sequence_output, query_mask=extended_attention_mask)
        return logits, sequence_output


class PerceiverForMaskedLM(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.config = config
        text_preprocessor = PerceiverTextPreprocessor(config)

        trainable_position_encoding_kwargs_decoder = {
            "num_channels": text_preprocessor.num_channels,
            "index_dims": config.max_position_embeddings,
        }

        self.perceiver = PerceiverModel(
            config,
            input_preprocessor=text_preprocessor,
            decoder=PerceiverBasicDecoder(
                config,
                output_num_channels=config.d_latents,
                output_index_dims=config.max_position_embeddings,  # we need to define the seq_len of the inputs beforehand
                num_channels=text_preprocessor.num_channels,
                qk_channels=config.decoder_qk_channels,
                v_channels=text_preprocessor.num_channels,
                num_heads=config.decoder_num_heads,
                use_query_residual=False,
                final_project=False,
                trainable_position_encoding_kwargs=trainable_position_encoding_kwargs_decoder,
            ),
        )
        self.embedding_decoder = PerceiverEmbeddingDecoder(config)

    def forward(self, inputs, attention_mask=None):
        outputs = self.perceiver(inputs=inputs, attention_mask=attention_mask)
        logits = self.embedding_decoder(outputs[0], embedding_layer=self.perceiver.input_preprocessor.embeddings)
        return logits


class PerceiverForSequenceClassification(nn.Layer):
    def __init__(self, config):
        super().__init__()

        trainable_position_encoding_kwargs_decoder = {"num_channels": config.d_latents, "index_dims": 1}

        self.num_labels = config.num_labels
        self.perceiver = PerceiverModel(
            config,
            input_preprocessor=PerceiverTextPreprocessor(config),
            decoder=PerceiverClassificationDecoder(
                config,
                num_channels=config.d_latents,
                trainable_position_encoding_kwargs=trainable_position_encoding_kwargs_decoder,
                use_query_residual=True,
            ),
        )

    def forward(self, inputs, attention_mask=None):
        outputs = self.perceiver(inputs=inputs, attention_mask=attention_mask)
        return outputs[0]


def build_model():
    return PerceiverForMaskedLM(PerceiverConfig())


def build_for_sequence_classification():
    """HF's text classifier: the decoder's one learned query (``q_dim`` = ``d_latents``) attends to
    the latents and a ``final_layer`` Linear projects it to ``num_labels``."""
    return PerceiverForSequenceClassification(PerceiverConfig())


def input_spec():
    return [paddle.static.InputSpec([2, MAXPOS], "int64", "inputs")]


def loss(model, tokens, labels):
    """The MLM loss over the first ``seq`` positions of the logits (HF pads inputs to ``MAXPOS``)."""
    logits = model(tokens)[:, : labels.shape[1]]
    return F.cross_entropy(logits.reshape([-1, VOCAB]), labels.reshape([-1]))
