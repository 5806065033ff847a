"""HF SegFormer (transformers/models/segformer/modeling_segformer.py, Apache-2.0), ported to Paddle
the way a Paddle user ports it, at a small config: ``SegformerForImageClassification`` (MiT
encoder, mean over tokens, one classifier Linear).

Hierarchical stages of different widths (``hidden_sizes``), each an overlapping patch embedding
(a Conv2D with ``padding=patch_size // 2``, then LayerNorm), blocks and a LayerNorm, the tokens
reshaped back into an image between stages. ``SegformerEfficientSelfAttention``: queries from the
tokens, keys and values from a sequence-reduction Conv2D (``sr``, kernel and stride
``sr_ratio``) over the tokens reshaped into ``[batch, channels, height, width]``, then
LayerNorm; scores divided by ``math.sqrt(head_size)``; the context reshaped with
``all_head_size``. ``SegformerMixFFN``: dense1, a depthwise 3x3 ``SegformerDWConv`` on the
reshaped tokens, GELU, dense2. Drop path is 0 here.

    >>> model = build_model()
    >>> list(model(paddle.rand([3, 3, *IMG])).shape)
    [3, 10]
"""

import math
from dataclasses import dataclass, field

import paddle
import paddle.nn as nn
import paddle.nn.functional as F

IMG, CHANS, CLASSES = [24, 40], 3, 10
VOCAB = 64  # the harness draws token ids below this; loss() turns them into pixels


@dataclass
class SegformerConfig:
    num_channels: int = 3
    num_encoder_blocks: int = 2
    depths: list = field(default_factory=lambda: [1, 1])
    sr_ratios: list = field(default_factory=lambda: [2, 1])
    hidden_sizes: list = field(default_factory=lambda: [32, 48])
    patch_sizes: list = field(default_factory=lambda: [7, 3])
    strides: list = field(default_factory=lambda: [4, 2])
    num_attention_heads: list = field(default_factory=lambda: [4, 4])
    mlp_ratios: list = field(default_factory=lambda: [4, 4])
    hidden_act: str = "gelu"
    hidden_dropout_prob: float = 0.0
    attention_probs_dropout_prob: float = 0.0
    classifier_dropout_prob: float = 0.1
    drop_path_rate: float = 0.0
    layer_norm_eps: float = 1e-6
    reshape_last_stage: bool = True
    num_labels: int = CLASSES


class SegformerDropPath(nn.Layer):
    def __init__(self, drop_prob=None):
        super().__init__()
        self.drop_prob = drop_prob

    def forward(self, hidden_states):
        if self.drop_prob == 0.0 or not self.training:
            return hidden_states
        keep_prob = 1 - self.drop_prob
        shape = (hidden_states.shape[0],) + (1,) * (hidden_states.ndim - 1)
        random_tensor = keep_prob + paddle.rand(shape, dtype=hidden_states.dtype)
        random_tensor = random_tensor.floor()
        return hidden_states / keep_prob * random_tensor


class SegformerOverlapPatchEmbeddings(nn.Layer):
    """Construct the overlapping patch embeddings."""

    def __init__(self, patch_size, stride, num_channels, hidden_size):
        super().__init__()
        self.proj = nn.Conv2D(num_channels, hidden_size, kernel_size=patch_size, stride=stride, padding=patch_size // 2)
        self.layer_norm = nn.LayerNorm(hidden_size)

    def forward(self, pixel_values):
        embeddings = self.proj(pixel_values)
        _, _, height, width = embeddings.shape
        # (batch_size, num_channels, height, width) -> (batch_size, num_channels, height*width)
        # -> (batch_size, height*width, num_channels)
        # this can be fed to a Transformer layer
        embeddings = embeddings.flatten(2).transpose([0, 2, 1])
        embeddings = self.layer_norm(embeddings)
        return embeddings, height, width


class SegformerEfficientSelfAttention(nn.Layer):
    """SegFormer's efficient self-attention mechanism. Employs the sequence reduction process
    introduced in the [PvT paper](https://huggingface.co/papers/2102.12122)."""

    def __init__(self, config, hidden_size, num_attention_heads, sequence_reduction_ratio):
        super().__init__()
        self.hidden_size = hidden_size
        self.num_attention_heads = num_attention_heads

        if self.hidden_size % self.num_attention_heads != 0:
            raise ValueError(
                f"The hidden size ({self.hidden_size}) is not a multiple of the number of attention "
                f"heads ({self.num_attention_heads})"
            )

        self.attention_head_size = int(self.hidden_size / self.num_attention_heads)
        self.all_head_size = self.num_attention_heads * self.attention_head_size

        self.query = nn.Linear(self.hidden_size, self.all_head_size)
        self.key = nn.Linear(self.hidden_size, self.all_head_size)
        self.value = nn.Linear(self.hidden_size, self.all_head_size)

        self.dropout = nn.Dropout(config.attention_probs_dropout_prob)

        self.sr_ratio = sequence_reduction_ratio
        if sequence_reduction_ratio > 1:
            self.sr = nn.Conv2D(
                hidden_size, hidden_size, kernel_size=sequence_reduction_ratio, stride=sequence_reduction_ratio
            )
            self.layer_norm = nn.LayerNorm(hidden_size)

    def forward(self, hidden_states, height, width, output_attentions=False):
        batch_size, seq_length, _ = hidden_states.shape
        query_layer = (
            self.query(hidden_states)
            .reshape([batch_size, -1, self.num_attention_heads, self.attention_head_size])
            .transpose([0, 2, 1, 3])
        )

        if self.sr_ratio > 1:
            batch_size, seq_len, num_channels = hidden_states.shape
            # Reshape to (batch_size, num_channels, height, width)
            hidden_states = hidden_states.transpose([0, 2, 1]).reshape([batch_size, num_channels, height, width])
            # Apply sequence reduction
            hidden_states = self.sr(hidden_states)
            # Reshape back to (batch_size, seq_len, num_channels)
            hidden_states = hidden_states.reshape([batch_size, num_channels, -1]).transpose([0, 2, 1])
            hidden_states = self.layer_norm(hidden_states)

        key_layer = (
            self.key(hidden_states)
            .reshape([batch_size, -1, self.num_attention_heads, self.attention_head_size])
            .transpose([0, 2, 1, 3])
        )
        value_layer = (
            self.value(hidden_states)
            .reshape([batch_size, -1, self.num_attention_heads, self.attention_head_size])
            .transpose([0, 2, 1, 3])
        )

        # Take the dot product between "query" and "key" to get the raw attention scores.
        attention_scores = paddle.matmul(query_layer, key_layer.transpose([0, 1, 3, 2]))

        attention_scores = attention_scores / math.sqrt(self.attention_head_size)

        # Normalize the attention scores to probabilities.
        attention_probs = F.softmax(attention_scores, axis=-1)

        # This is actually dropping out entire tokens to attend to, which might
        # seem a bit unusual, but is taken from the original Transformer paper.
        attention_probs = self.dropout(attention_probs)

        context_layer = paddle.matmul(attention_probs, value_layer)

        context_layer = context_layer.transpose([0, 2, 1, 3])
        new_context_layer_shape = context_layer.shape[:-2] + [self.all_head_size]
        context_layer = context_layer.reshape(new_context_layer_shape)

        outputs = (context_layer, attention_probs) if output_attentions else (context_layer,)

        return outputs


class SegformerSelfOutput(nn.Layer):
    def __init__(self, config, hidden_size):
        super().__init__()
        self.dense = nn.Linear(hidden_size, hidden_size)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, hidden_states, input_tensor):
        hidden_states = self.dense(hidden_states)
        hidden_states = self.dropout(hidden_states)
        return hidden_states


class SegformerAttention(nn.Layer):
    def __init__(self, config, hidden_size, num_attention_heads, sequence_reduction_ratio):
        super().__init__()
        self.self = SegformerEfficientSelfAttention(
            config=config,
            hidden_size=hidden_size,
            num_attention_heads=num_attention_heads,
            sequence_reduction_ratio=sequence_reduction_ratio,
        )
        self.output = SegformerSelfOutput(config, hidden_size=hidden_size)

    def forward(self, hidden_states, height, width, output_attentions=False):
        self_outputs = self.self(hidden_states, height, width, output_attentions)

        attention_output = self.output(self_outputs[0], hidden_states)
        outputs = (attention_output,) + self_outputs[1:]  # add attentions if we output them
        return outputs


class SegformerDWConv(nn.Layer):
    def __init__(self, dim=768):
        super().__init__()
        self.dwconv = nn.Conv2D(dim, dim, 3, 1, 1, bias_attr=True, groups=dim)

    def forward(self, hidden_states, height, width):
        batch_size, seq_len, num_channels = hidden_states.shape
        hidden_states = hidden_states.transpose([0, 2, 1]).reshape([batch_size, num_channels, height, width])
        hidden_states = self.dwconv(hidden_states)
        hidden_states = hidden_states.flatten(2).transpose([0, 2, 1])

        return hidden_states


class SegformerMixFFN(nn.Layer):
    def __init__(self, config, in_features, hidden_features=None, out_features=None):
        super().__init__()
        out_features = out_features or in_features
        self.dense1 = nn.Linear(in_features, hidden_features)
        self.dwconv = SegformerDWConv(hidden_features)
        self.intermediate_act_fn = nn.GELU()
        self.dense2 = nn.Linear(hidden_features, out_features)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, hidden_states, height, width):
        hidden_states = self.dense1(hidden_states)
        hidden_states = self.dwconv(hidden_states, height, width)
        hidden_states = self.intermediate_act_fn(hidden_states)
        hidden_states = self.dropout(hidden_states)
        hidden_states = self.dense2(hidden_states)
        hidden_states = self.dropout(hidden_states)
        return hidden_states


class SegformerLayer(nn.Layer):
    """This corresponds to the Block class in the original implementation."""

    def __init__(self, config, hidden_size, num_attention_heads, drop_path, sequence_reduction_ratio, mlp_ratio):
        super().__init__()
        self.layer_norm_1 = nn.LayerNorm(hidden_size)
        self.attention = SegformerAttention(
            config,
            hidden_size=hidden_size,
            num_attention_heads=num_attention_heads,
            sequence_reduction_ratio=sequence_reduction_ratio,
        )
        self.drop_path = SegformerDropPath(drop_path) if drop_path > 0.0 else nn.Identity()
        self.layer_norm_2 = nn.LayerNorm(hidden_size)
        mlp_hidden_size = int(hidden_size * mlp_ratio)
        self.mlp = SegformerMixFFN(config, in_features=hidden_size, hidden_features=mlp_hidden_size)

    def forward(self, hidden_states, height, width, output_attentions=False):
        self_attention_outputs = self.attention(
            self.layer_norm_1(hidden_states),  # in Segformer, layernorm is applied before self-attention
            height,
            width,
            output_attentions=output_attentions,
        )

        attention_output = self_attention_outputs[0]
        outputs = self_attention_outputs[1:]  # add self attentions if we output attention weights

        # first residual connection (with stochastic depth)
        attention_output = self.drop_path(attention_output)
        hidden_states = attention_output + hidden_states

        mlp_output = self.mlp(self.layer_norm_2(hidden_states), height, width)

        # second residual connection (with stochastic depth)
        mlp_output = self.drop_path(mlp_output)
        layer_output = mlp_output + hidden_states

        outputs = (layer_output,) + outputs

        return outputs


class SegformerEncoder(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.config = config

        # stochastic depth decay rule
        drop_path_decays = [x.item() for x in paddle.linspace(0, config.drop_path_rate, sum(config.depths))]

        # patch embeddings
        embeddings = []
        for i in range(config.num_encoder_blocks):
            embeddings.append(
                SegformerOverlapPatchEmbeddings(
                    patch_size=config.patch_sizes[i],
                    stride=config.strides[i],
                    num_channels=config.num_channels if i == 0 else config.hidden_sizes[i - 1],
                    hidden_size=config.hidden_sizes[i],
                )
            )
        self.patch_embeddings = nn.LayerList(embeddings)

        # Transformer blocks
        blocks = []
        cur = 0
        for i in range(config.num_encoder_blocks):
            # each block consists of layers
            layers = []
            if i != 0:
                cur += config.depths[i - 1]
            for j in range(config.depths[i]):
                layers.append(
                    SegformerLayer(
                        config,
                        hidden_size=config.hidden_sizes[i],
                        num_attention_heads=config.num_attention_heads[i],
                        drop_path=drop_path_decays[cur + j],
                        sequence_reduction_ratio=config.sr_ratios[i],
                        mlp_ratio=config.mlp_ratios[i],
                    )
                )
            blocks.append(nn.LayerList(layers))

        self.block = nn.LayerList(blocks)

        # Layer norms
        self.layer_norm = nn.LayerList([nn.LayerNorm(config.hidden_sizes[i]) for i in range(config.num_encoder_blocks)])

    def forward(self, pixel_values):
        batch_size = pixel_values.shape[0]

        hidden_states = pixel_values
        for idx, x in enumerate(zip(self.patch_embeddings, self.block, self.layer_norm)):
            embedding_layer, block_layer, norm_layer = x
            # first, obtain patch embeddings
            hidden_states, height, width = embedding_layer(hidden_states)
            # second, send embeddings through blocks
            for i, blk in enumerate(block_layer):
                layer_outputs = blk(hidden_states, height, width)
                hidden_states = layer_outputs[0]
            # third, apply layer norm
            hidden_states = norm_layer(hidden_states)
            # fourth, optionally reshape back to (batch_size, num_channels, height, width)
            if idx != len(self.patch_embeddings) - 1 or (
                idx == len(self.patch_embeddings) - 1 and self.config.reshape_last_stage
            ):
                hidden_states = hidden_states.reshape([batch_size, height, width, -1]).transpose([0, 3, 1, 2])

        return (hidden_states,)


class SegformerModel(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.config = config
        # hierarchical Transformer encoder
        self.encoder = SegformerEncoder(config)

    def forward(self, pixel_values):
        encoder_outputs = self.encoder(pixel_values)
        sequence_output = encoder_outputs[0]
        return (sequence_output,) + encoder_outputs[1:]


class SegformerForImageClassification(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.num_labels = config.num_labels
        self.config = config
        self.segformer = SegformerModel(config)

        # Classifier head
        self.classifier = nn.Linear(config.hidden_sizes[-1], config.num_labels)

    def forward(self, pixel_values):
        outputs = self.segformer(pixel_values)

        sequence_output = outputs[0]

        # convert last hidden states to (batch_size, height*width, hidden_size)
        batch_size = sequence_output.shape[0]
        if self.config.reshape_last_stage:
            # (batch_size, num_channels, height, width) -> (batch_size, height, width, num_channels)
            sequence_output = sequence_output.transpose([0, 2, 3, 1])
        sequence_output = sequence_output.reshape([batch_size, -1, self.config.hidden_sizes[-1]])

        # global average pooling
        sequence_output = sequence_output.mean(axis=1)

        logits = self.classifier(sequence_output)
        return logits


def build_model():
    return SegformerForImageClassification(SegformerConfig())


def input_spec():
    return [paddle.static.InputSpec([3, CHANS, *IMG], "float32", "pixel_values")]


def loss(model, tokens, labels):
    """Pixels from the harness's token ids (a fixed function of them), a class per sample."""
    pixels = (tokens.astype("float32") / VOCAB).reshape([tokens.shape[0], 1, 1, -1])
    pixels = paddle.tile(pixels, [1, CHANS, IMG[0], IMG[1] // pixels.shape[-1]])
    return F.cross_entropy(model(pixels), labels[:, 0] % CLASSES)
