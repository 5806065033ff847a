"""HF Wav2Vec2 (facebook/wav2vec2-base), ``Wav2Vec2ForCTC`` ported to Paddle as its modeling_wav2vec2.py
writes it: a config object; a feature encoder of 1-D convolutions over the raw audio (``input_values[:,
None]``; the first with a GroupNorm of one group per channel, the rest convolution and GELU); the
feature projection (LayerNorm, Linear); the positional convolution embedding, a grouped ``Conv1D`` with
an even kernel trimmed by ``Wav2Vec2SamePadLayer``, wrapped in ``nn.utils.weight_norm(self.conv,
name="weight", dim=2)`` as HF did before parametrizations (Paddle has the hook, not the parametrization;
it computes the weight's norm while building, so the model does not build under ``paddle.LazyGuard()``);
the post-norm encoder (``do_stable_layer_norm=False``) with LayerDrop (``paddle.rand([]) < layerdrop``
skips a layer in training), whose ``Wav2Vec2Attention`` is BART's (separate q/k/v, the query scaled by
``head_dim ** -0.5``, ``_shape`` then heads folded into the batch for ``bmm``, the output reshaped with
``self.embed_dim``); the CTC head and HF's CTC loss (``log_softmax`` in float32, time first, blank =
``pad_token_id``). Float audio in: 400 samples give 19 frames. Sizes: no two of batch 3, frames 19,
heads 4, head dim 10, hidden 40 coincide (conv channels 24, intermediate 56, 8 positional-conv groups,
vocabulary 30).

    >>> model = build_model()
    >>> list(model(paddle.randn([3, SAMPLES])).shape)
    [3, 19, 30]
"""

from __future__ import annotations

import paddle
import paddle.nn as nn
import paddle.nn.functional as F

VOCAB, SAMPLES = 30, 400


class Wav2Vec2Config:
    vocab_size = VOCAB
    hidden_size = 40
    num_hidden_layers = 2
    num_attention_heads = 4
    intermediate_size = 56
    hidden_act = "gelu"
    hidden_dropout = 0.1
    activation_dropout = 0.1
    # HF's default is 0.1; the tests compare training with one device without dropout, and this one is a
    # float read by F.dropout, no nn.Dropout the harness can zero (inside the attention's local view each
    # rank draws for its own heads' shape: not the slice one device draws, docs/internals.md "Randomness")
    attention_dropout = 0.0
    feat_proj_dropout = 0.0
    final_dropout = 0.1
    layerdrop = 0.1  # every rank draws LayerDrop's paddle.rand([]) as one device does: it trains alike
    layer_norm_eps = 1e-5
    feat_extract_norm = "group"
    feat_extract_activation = "gelu"
    conv_dim = (24, 24, 24)
    conv_stride = (5, 2, 2)
    conv_kernel = (10, 3, 3)
    conv_bias = False
    num_conv_pos_embeddings = 6
    num_conv_pos_embedding_groups = 8
    do_stable_layer_norm = False
    apply_spec_augment = False
    pad_token_id = 0
    ctc_loss_reduction = "mean"

    @property
    def num_feat_extract_layers(self):
        return len(self.conv_dim)


class Wav2Vec2NoLayerNormConvLayer(nn.Layer):
    def __init__(self, config, layer_id=0):
        super().__init__()
        self.in_conv_dim = config.conv_dim[layer_id - 1] if layer_id > 0 else 1
        self.out_conv_dim = config.conv_dim[layer_id]
        self.conv = nn.Conv1D(
            self.in_conv_dim,
            self.out_conv_dim,
            kernel_size=config.conv_kernel[layer_id],
            stride=config.conv_stride[layer_id],
            bias_attr=None if config.conv_bias else False,
        )
        self.activation = nn.GELU()

    def forward(self, hidden_states):
        hidden_states = self.conv(hidden_states)
        return self.activation(hidden_states)


class Wav2Vec2GroupNormConvLayer(nn.Layer):
    def __init__(self, config, layer_id=0):
        super().__init__()
        self.in_conv_dim = config.conv_dim[layer_id - 1] if layer_id > 0 else 1
        self.out_conv_dim = config.conv_dim[layer_id]
        self.conv = nn.Conv1D(
            self.in_conv_dim,
            self.out_conv_dim,
            kernel_size=config.conv_kernel[layer_id],
            stride=config.conv_stride[layer_id],
            bias_attr=None if config.conv_bias else False,
        )
        self.activation = nn.GELU()
        self.layer_norm = nn.GroupNorm(num_groups=self.out_conv_dim, num_channels=self.out_conv_dim)

    def forward(self, hidden_states):
        hidden_states = self.conv(hidden_states)
        hidden_states = self.layer_norm(hidden_states)
        return self.activation(hidden_states)


class Wav2Vec2PositionalConvEmbedding(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.conv = nn.Conv1D(
            config.hidden_size,
            config.hidden_size,
            kernel_size=config.num_conv_pos_embeddings,
            padding=config.num_conv_pos_embeddings // 2,
            groups=config.num_conv_pos_embedding_groups,
        )
        self.conv = nn.utils.weight_norm(self.conv, name="weight", dim=2)
        self.padding = Wav2Vec2SamePadLayer(config.num_conv_pos_embeddings)
        self.activation = nn.GELU()

    def forward(self, hidden_states):
        hidden_states = hidden_states.transpose([0, 2, 1])
        hidden_states = self.conv(hidden_states)
        hidden_states = self.padding(hidden_states)
        hidden_states = self.activation(hidden_states)
        return hidden_states.transpose([0, 2, 1])


class Wav2Vec2SamePadLayer(nn.Layer):
    def __init__(self, num_conv_pos_embeddings):
        super().__init__()
        self.num_pad_remove = 1 if num_conv_pos_embeddings % 2 == 0 else 0

    def forward(self, hidden_states):
        if self.num_pad_remove > 0:
            hidden_states = hidden_states[:, :, : -self.num_pad_remove]
        return hidden_states


class Wav2Vec2FeatureEncoder(nn.Layer):
    """Construct the features from raw audio waveform"""

    def __init__(self, config):
        super().__init__()
        conv_layers = [Wav2Vec2GroupNormConvLayer(config, layer_id=0)] + [
            Wav2Vec2NoLayerNormConvLayer(config, layer_id=i + 1) for i in range(config.num_feat_extract_layers - 1)
        ]
        self.conv_layers = nn.LayerList(conv_layers)

    def forward(self, input_values):
        hidden_states = input_values[:, None]
        for conv_layer in self.conv_layers:
            hidden_states = conv_layer(hidden_states)
        return hidden_states


class Wav2Vec2FeatureProjection(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.layer_norm = nn.LayerNorm(config.conv_dim[-1], epsilon=config.layer_norm_eps)
        self.projection = nn.Linear(config.conv_dim[-1], config.hidden_size)
        self.dropout = nn.Dropout(config.feat_proj_dropout)

    def forward(self, hidden_states):
        # non-projected hidden states are needed for quantization
        norm_hidden_states = self.layer_norm(hidden_states)
        hidden_states = self.projection(norm_hidden_states)
        hidden_states = self.dropout(hidden_states)
        return hidden_states, norm_hidden_states


class Wav2Vec2Attention(nn.Layer):
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
        bias_attr = None if bias else False
        self.k_proj = nn.Linear(embed_dim, embed_dim, bias_attr=bias_attr)
        self.v_proj = nn.Linear(embed_dim, embed_dim, bias_attr=bias_attr)
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias_attr=bias_attr)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias_attr=bias_attr)

    def _shape(self, tensor, seq_len, bsz):
        return tensor.reshape([bsz, seq_len, self.num_heads, self.head_dim]).transpose([0, 2, 1, 3])

    def forward(self, hidden_states, attention_mask=None, output_attentions=False):
        bsz, tgt_len, _ = hidden_states.shape

        # get query proj
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

        # Use the `embed_dim` from the config (stored in the class) rather than `hidden_state` because `attn_output` can be
        # partitioned across GPUs when using tensor-parallelism.
        attn_output = attn_output.reshape([bsz, tgt_len, self.embed_dim])
        attn_output = self.out_proj(attn_output)
        return attn_output, (attn_weights if output_attentions else None), None


class Wav2Vec2FeedForward(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.intermediate_dropout = nn.Dropout(config.activation_dropout)
        self.intermediate_dense = nn.Linear(config.hidden_size, config.intermediate_size)
        self.intermediate_act_fn = nn.GELU()
        self.output_dense = nn.Linear(config.intermediate_size, config.hidden_size)
        self.output_dropout = nn.Dropout(config.hidden_dropout)

    def forward(self, hidden_states):
        hidden_states = self.intermediate_dense(hidden_states)
        hidden_states = self.intermediate_act_fn(hidden_states)
        hidden_states = self.intermediate_dropout(hidden_states)
        hidden_states = self.output_dense(hidden_states)
        return self.output_dropout(hidden_states)


class Wav2Vec2EncoderLayer(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.attention = Wav2Vec2Attention(
            embed_dim=config.hidden_size,
            num_heads=config.num_attention_heads,
            dropout=config.attention_dropout,
            is_decoder=False,
        )
        self.dropout = nn.Dropout(config.hidden_dropout)
        self.layer_norm = nn.LayerNorm(config.hidden_size, epsilon=config.layer_norm_eps)
        self.feed_forward = Wav2Vec2FeedForward(config)
        self.final_layer_norm = nn.LayerNorm(config.hidden_size, epsilon=config.layer_norm_eps)

    def forward(self, hidden_states, attention_mask=None, output_attentions=False):
        attn_residual = hidden_states
        hidden_states, attn_weights, _ = self.attention(
            hidden_states, attention_mask=attention_mask, output_attentions=output_attentions
        )
        hidden_states = self.dropout(hidden_states)
        hidden_states = attn_residual + hidden_states

        hidden_states = self.layer_norm(hidden_states)
        hidden_states = hidden_states + self.feed_forward(hidden_states)
        hidden_states = self.final_layer_norm(hidden_states)

        outputs = (hidden_states,)
        if output_attentions:
            outputs += (attn_weights,)
        return outputs


class Wav2Vec2Encoder(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.pos_conv_embed = Wav2Vec2PositionalConvEmbedding(config)
        self.layer_norm = nn.LayerNorm(config.hidden_size, epsilon=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout)
        self.layers = nn.LayerList([Wav2Vec2EncoderLayer(config) for _ in range(config.num_hidden_layers)])

    def forward(self, hidden_states, attention_mask=None):
        if attention_mask is not None:
            # make sure padded tokens output 0
            expand_attention_mask = attention_mask.unsqueeze(-1).tile([1, 1, hidden_states.shape[2]])
            hidden_states = paddle.where(expand_attention_mask, hidden_states, paddle.zeros_like(hidden_states))
            # extend attention_mask
            attention_mask = 1.0 - attention_mask[:, None, None, :].astype(hidden_states.dtype)
            attention_mask = attention_mask * paddle.finfo(hidden_states.dtype).min
            attention_mask = attention_mask.expand(
                [attention_mask.shape[0], 1, attention_mask.shape[-1], attention_mask.shape[-1]]
            )

        position_embeddings = self.pos_conv_embed(hidden_states)
        hidden_states = hidden_states + position_embeddings
        hidden_states = self.layer_norm(hidden_states)
        hidden_states = self.dropout(hidden_states)

        for layer in self.layers:
            # add LayerDrop (see https://arxiv.org/abs/1909.11556 for description)
            skip_the_layer = False
            if self.training:
                dropout_probability = paddle.rand([])
                skip_the_layer = bool(dropout_probability < self.config.layerdrop)
            if not skip_the_layer:
                layer_outputs = layer(hidden_states, attention_mask=attention_mask)
                hidden_states = layer_outputs[0]
        return hidden_states


class Wav2Vec2Model(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.feature_extractor = Wav2Vec2FeatureEncoder(config)
        self.feature_projection = Wav2Vec2FeatureProjection(config)
        self.encoder = Wav2Vec2Encoder(config)

    def _mask_hidden_states(self, hidden_states):
        """SpecAugment along time and feature axes; off (``apply_spec_augment=False``) for this port."""
        if not getattr(self.config, "apply_spec_augment", True):
            return hidden_states
        raise NotImplementedError("SpecAugment's numpy masks are not ported")

    def forward(self, input_values, attention_mask=None):
        extract_features = self.feature_extractor(input_values)
        extract_features = extract_features.transpose([0, 2, 1])
        hidden_states, extract_features = self.feature_projection(extract_features)
        hidden_states = self._mask_hidden_states(hidden_states)
        return self.encoder(hidden_states, attention_mask=attention_mask)


class Wav2Vec2ForCTC(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.wav2vec2 = Wav2Vec2Model(config)
        self.dropout = nn.Dropout(config.final_dropout)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size)

    def _get_feat_extract_output_lengths(self, input_lengths):
        """Computes the output length of the convolutional layers"""
        for kernel_size, stride in zip(self.config.conv_kernel, self.config.conv_stride):
            input_lengths = paddle.floor_divide(input_lengths - kernel_size, paddle.to_tensor(stride, "int64")) + 1
        return input_lengths

    def forward(self, input_values, attention_mask=None, labels=None):
        if labels is not None and labels.max() >= self.config.vocab_size:
            raise ValueError(f"Label values must be <= vocab_size: {self.config.vocab_size}")

        hidden_states = self.wav2vec2(input_values, attention_mask=attention_mask)
        hidden_states = self.dropout(hidden_states)
        logits = self.lm_head(hidden_states)
        if labels is None:
            return logits

        # retrieve loss input_lengths from attention_mask
        attention_mask = attention_mask if attention_mask is not None else paddle.ones_like(input_values, "int64")
        input_lengths = self._get_feat_extract_output_lengths(attention_mask.sum(-1))
        # assuming that padded tokens are filled with -100 when not being attended to
        labels_mask = labels >= 0
        target_lengths = labels_mask.astype("int64").sum(-1)
        log_probs = F.log_softmax(logits, axis=-1, dtype="float32").transpose([1, 0, 2])
        loss = F.ctc_loss(
            log_probs,
            labels.astype("int32"),
            input_lengths,
            target_lengths,
            blank=self.config.pad_token_id,
            reduction=self.config.ctc_loss_reduction,
        )
        return loss, logits


def build_model():
    return Wav2Vec2ForCTC(Wav2Vec2Config())


def input_spec():
    return [paddle.static.InputSpec([3, SAMPLES], "float32", "input_values")]


#: The harness draws token ids below VOCAB; loss() turns them into audio and CTC targets.
TARGET_LENGTH = 5


def loss(model, tokens, labels):
    """Audio: each token id held for SAMPLES / sequence samples (a fixed function of the ids); the
    CTC targets: the first labels moved off the blank."""
    audio = (tokens.astype("float32") / VOCAB - 0.5).repeat_interleave(SAMPLES // tokens.shape[1], axis=1)
    targets = labels[:, :TARGET_LENGTH] % (VOCAB - 1) + 1
    return model(audio, labels=targets)[0]
