"""PaddleDetection's DETR (ppdet/modeling/transformers/detr_transformer.py, ppdet/modeling/layers.py,
position_encoding.py and heads/detr_head.py; Apache-2.0), as PaddleDetection writes it, at a
small config, with a two-conv stem in place of the ResNet backbone.

``DETRTransformer``: a 1x1 ``input_proj``, a sine ``PositionEmbedding`` of a mask of ones, post-norm
encoder and decoder layers whose ``MultiHeadAttention`` takes q, k and v apart (``q = k =
with_pos_embed(src, pos_embed)``, ``value=src``: the position embedding is added to queries and
keys only), each projected by ``F.linear`` of a column slice of one ``in_proj_weight`` parameter
``[embed_dim, 3 * embed_dim]`` (``compute_qkv``), reshaped with ``0`` for batch and sequence;
training adds ``(mask - 1.0) * 1e9`` to the scores; learned ``query_pos_embed`` (an
``nn.Embedding`` read by ``.weight``), zero targets, a ``return_intermediate`` decoder stacking
every layer's normed output. ``DETRHead``: a score Linear and a 3-layer box MLP on every level.

    >>> model = build_model()
    >>> logits, boxes = model(paddle.rand([3, 3, *IMG]))
    >>> list(logits.shape), list(boxes.shape)
    ([2, 3, 7, 6], [2, 3, 7, 4])
"""

import copy
import math

import paddle
import paddle.nn as nn
import paddle.nn.functional as F
from paddle.nn.initializer import Constant, Normal, XavierUniform
from paddle.nn.layer.transformer import _convert_attention_mask

IMG, CHANS, BACKBONE_CHANNELS, HIDDEN, HEADS, FFN, QUERIES, CLASSES = [20, 32], 3, 24, 48, 4, 80, 7, 5
VOCAB = 64  # the harness draws token ids below this; loss() turns them into pixels

xavier_uniform_ = XavierUniform()
constant_ = Constant(0.0)
normal_ = Normal()


def linear_init_(module):
    bound = 1 / math.sqrt(module.weight.shape[0])
    nn.initializer.Uniform(-bound, bound)(module.weight)
    nn.initializer.Uniform(-bound, bound)(module.bias)


def conv_init_(module):
    bound = 1 / math.sqrt(math.prod(module.weight.shape[1:]))
    nn.initializer.Uniform(-bound, bound)(module.weight)
    if module.bias is not None:
        nn.initializer.Uniform(-bound, bound)(module.bias)


def _get_clones(module, N):
    return nn.LayerList([copy.deepcopy(module) for _ in range(N)])


class MultiHeadAttention(nn.Layer):
    """ppdet.modeling.layers.MultiHeadAttention (paddle.nn.MultiHeadAttention with a fused in_proj)."""

    def __init__(self, embed_dim, num_heads, dropout=0.0, kdim=None, vdim=None, need_weights=False):
        super(MultiHeadAttention, self).__init__()
        self.embed_dim = embed_dim
        self.kdim = kdim if kdim is not None else embed_dim
        self.vdim = vdim if vdim is not None else embed_dim
        self._qkv_same_embed_dim = self.kdim == embed_dim and self.vdim == embed_dim

        self.num_heads = num_heads
        self.dropout = dropout
        self.need_weights = need_weights

        self.head_dim = embed_dim // num_heads
        assert self.head_dim * num_heads == self.embed_dim, "embed_dim must be divisible by num_heads"

        if self._qkv_same_embed_dim:
            self.in_proj_weight = self.create_parameter(
                shape=[embed_dim, 3 * embed_dim], attr=None, dtype=self._dtype, is_bias=False
            )
            self.in_proj_bias = self.create_parameter(shape=[3 * embed_dim], attr=None, dtype=self._dtype, is_bias=True)
        else:
            self.q_proj = nn.Linear(embed_dim, embed_dim)
            self.k_proj = nn.Linear(self.kdim, embed_dim)
            self.v_proj = nn.Linear(self.vdim, embed_dim)

        self.out_proj = nn.Linear(embed_dim, embed_dim)
        self._type_list = ("q_proj", "k_proj", "v_proj")

        self._reset_parameters()

    def _reset_parameters(self):
        for p in self.parameters():
            if p.dim() > 1:
                xavier_uniform_(p)
            else:
                constant_(p)

    def compute_qkv(self, tensor, index):
        if self._qkv_same_embed_dim:
            tensor = F.linear(
                x=tensor,
                weight=self.in_proj_weight[:, index * self.embed_dim : (index + 1) * self.embed_dim],
                bias=self.in_proj_bias[index * self.embed_dim : (index + 1) * self.embed_dim]
                if self.in_proj_bias is not None
                else None,
            )
        else:
            tensor = getattr(self, self._type_list[index])(tensor)
        tensor = tensor.reshape([0, 0, self.num_heads, self.head_dim]).transpose([0, 2, 1, 3])
        return tensor

    def forward(self, query, key=None, value=None, attn_mask=None):
        key = query if key is None else key
        value = query if value is None else value
        # compute q ,k ,v
        q, k, v = (self.compute_qkv(t, i) for i, t in enumerate([query, key, value]))

        # scale dot product attention
        product = paddle.matmul(x=q, y=k, transpose_y=True)
        scaling = float(self.head_dim) ** -0.5
        product = product * scaling

        if attn_mask is not None:
            # Support bool or int mask
            attn_mask = _convert_attention_mask(attn_mask, product.dtype)
            product = product + attn_mask
        weights = F.softmax(product)
        if self.dropout:
            weights = F.dropout(weights, self.dropout, training=self.training, mode="upscale_in_train")
        out = paddle.matmul(weights, v)

        # combine heads
        out = paddle.transpose(out, perm=[0, 2, 1, 3])
        out = paddle.reshape(x=out, shape=[0, 0, out.shape[2] * out.shape[3]])

        # project to output
        out = self.out_proj(out)

        outs = [out]
        if self.need_weights:
            outs.append(weights)
        return out if len(outs) == 1 else tuple(outs)


class PositionEmbedding(nn.Layer):
    def __init__(self, num_pos_feats=128, temperature=10000, normalize=True, scale=2 * math.pi, offset=0.0, eps=1e-6):
        super(PositionEmbedding, self).__init__()
        self.num_pos_feats = num_pos_feats
        self.temperature = temperature
        self.normalize = normalize
        self.scale = scale
        self.offset = offset
        self.eps = eps

    def forward(self, mask):
        """mask (Tensor): [B, H, W]; returns pos (Tensor): [B, H, W, C]"""
        y_embed = mask.cumsum(1)
        x_embed = mask.cumsum(2)
        if self.normalize:
            y_embed = (y_embed + self.offset) / (y_embed[:, -1:, :] + self.eps) * self.scale
            x_embed = (x_embed + self.offset) / (x_embed[:, :, -1:] + self.eps) * self.scale

        dim_t = 2 * (paddle.arange(self.num_pos_feats) // 2).astype("float32")
        dim_t = self.temperature ** (dim_t / self.num_pos_feats)

        pos_x = x_embed.unsqueeze(-1) / dim_t
        pos_y = y_embed.unsqueeze(-1) / dim_t
        pos_x = paddle.stack((pos_x[:, :, :, 0::2].sin(), pos_x[:, :, :, 1::2].cos()), axis=4).flatten(3)
        pos_y = paddle.stack((pos_y[:, :, :, 0::2].sin(), pos_y[:, :, :, 1::2].cos()), axis=4).flatten(3)
        return paddle.concat((pos_y, pos_x), axis=3)


class TransformerEncoderLayer(nn.Layer):
    def __init__(
        self,
        d_model,
        nhead,
        dim_feedforward=2048,
        dropout=0.1,
        activation="relu",
        attn_dropout=None,
        act_dropout=None,
        normalize_before=False,
    ):
        super(TransformerEncoderLayer, self).__init__()
        attn_dropout = dropout if attn_dropout is None else attn_dropout
        act_dropout = dropout if act_dropout is None else act_dropout
        self.normalize_before = normalize_before

        self.self_attn = MultiHeadAttention(d_model, nhead, attn_dropout)
        # Implementation of Feedforward model
        self.linear1 = nn.Linear(d_model, dim_feedforward)
        self.dropout = nn.Dropout(act_dropout, mode="upscale_in_train")
        self.linear2 = nn.Linear(dim_feedforward, d_model)

        self.norm1 = nn.LayerNorm(d_model)
        self.norm2 = nn.LayerNorm(d_model)
        self.dropout1 = nn.Dropout(dropout, mode="upscale_in_train")
        self.dropout2 = nn.Dropout(dropout, mode="upscale_in_train")
        self.activation = getattr(F, activation)
        self._reset_parameters()

    def _reset_parameters(self):
        linear_init_(self.linear1)
        linear_init_(self.linear2)

    @staticmethod
    def with_pos_embed(tensor, pos_embed):
        return tensor if pos_embed is None else tensor + pos_embed

    def forward(self, src, src_mask=None, pos_embed=None):
        residual = src
        if self.normalize_before:
            src = self.norm1(src)
        q = k = self.with_pos_embed(src, pos_embed)
        src = self.self_attn(q, k, value=src, attn_mask=src_mask)

        src = residual + self.dropout1(src)
        if not self.normalize_before:
            src = self.norm1(src)

        residual = src
        if self.normalize_before:
            src = self.norm2(src)
        src = self.linear2(self.dropout(self.activation(self.linear1(src))))
        src = residual + self.dropout2(src)
        if not self.normalize_before:
            src = self.norm2(src)
        return src


class TransformerEncoder(nn.Layer):
    def __init__(self, encoder_layer, num_layers, norm=None):
        super(TransformerEncoder, self).__init__()
        self.layers = _get_clones(encoder_layer, num_layers)
        self.num_layers = num_layers
        self.norm = norm

    def forward(self, src, src_mask=None, pos_embed=None):
        output = src
        for layer in self.layers:
            output = layer(output, src_mask=src_mask, pos_embed=pos_embed)

        if self.norm is not None:
            output = self.norm(output)

        return output


class TransformerDecoderLayer(nn.Layer):
    def __init__(
        self,
        d_model,
        nhead,
        dim_feedforward=2048,
        dropout=0.1,
        activation="relu",
        attn_dropout=None,
        act_dropout=None,
        normalize_before=False,
    ):
        super(TransformerDecoderLayer, self).__init__()
        attn_dropout = dropout if attn_dropout is None else attn_dropout
        act_dropout = dropout if act_dropout is None else act_dropout
        self.normalize_before = normalize_before

        self.self_attn = MultiHeadAttention(d_model, nhead, attn_dropout)
        self.cross_attn = MultiHeadAttention(d_model, nhead, attn_dropout)
        # Implementation of Feedforward model
        self.linear1 = nn.Linear(d_model, dim_feedforward)
        self.dropout = nn.Dropout(act_dropout, mode="upscale_in_train")
        self.linear2 = nn.Linear(dim_feedforward, d_model)

        self.norm1 = nn.LayerNorm(d_model)
        self.norm2 = nn.LayerNorm(d_model)
        self.norm3 = nn.LayerNorm(d_model)
        self.dropout1 = nn.Dropout(dropout, mode="upscale_in_train")
        self.dropout2 = nn.Dropout(dropout, mode="upscale_in_train")
        self.dropout3 = nn.Dropout(dropout, mode="upscale_in_train")
        self.activation = getattr(F, activation)
        self._reset_parameters()

    def _reset_parameters(self):
        linear_init_(self.linear1)
        linear_init_(self.linear2)

    @staticmethod
    def with_pos_embed(tensor, pos_embed):
        return tensor if pos_embed is None else tensor + pos_embed

    def forward(self, tgt, memory, tgt_mask=None, memory_mask=None, pos_embed=None, query_pos_embed=None):
        tgt_mask = _convert_attention_mask(tgt_mask, tgt.dtype)

        residual = tgt
        if self.normalize_before:
            tgt = self.norm1(tgt)
        q = k = self.with_pos_embed(tgt, query_pos_embed)
        tgt = self.self_attn(q, k, value=tgt, attn_mask=tgt_mask)
        tgt = residual + self.dropout1(tgt)
        if not self.normalize_before:
            tgt = self.norm1(tgt)

        residual = tgt
        if self.normalize_before:
            tgt = self.norm2(tgt)
        q = self.with_pos_embed(tgt, query_pos_embed)
        k = self.with_pos_embed(memory, pos_embed)
        tgt = self.cross_attn(q, k, value=memory, attn_mask=memory_mask)
        tgt = residual + self.dropout2(tgt)
        if not self.normalize_before:
            tgt = self.norm2(tgt)

        residual = tgt
        if self.normalize_before:
            tgt = self.norm3(tgt)
        tgt = self.linear2(self.dropout(self.activation(self.linear1(tgt))))
        tgt = residual + self.dropout3(tgt)
        if not self.normalize_before:
            tgt = self.norm3(tgt)
        return tgt


class TransformerDecoder(nn.Layer):
    def __init__(self, decoder_layer, num_layers, norm=None, return_intermediate=False):
        super(TransformerDecoder, self).__init__()
        self.layers = _get_clones(decoder_layer, num_layers)
        self.num_layers = num_layers
        self.norm = norm
        self.return_intermediate = return_intermediate

    def forward(self, tgt, memory, tgt_mask=None, memory_mask=None, pos_embed=None, query_pos_embed=None):
        tgt_mask = _convert_attention_mask(tgt_mask, tgt.dtype)

        output = tgt
        intermediate = []
        for layer in self.layers:
            output = layer(
                output,
                memory,
                tgt_mask=tgt_mask,
                memory_mask=memory_mask,
                pos_embed=pos_embed,
                query_pos_embed=query_pos_embed,
            )
            if self.return_intermediate:
                intermediate.append(self.norm(output))

        if self.norm is not None:
            output = self.norm(output)

        if self.return_intermediate:
            return paddle.stack(intermediate)

        return output.unsqueeze(0)


class DETRTransformer(nn.Layer):
    def __init__(
        self,
        num_queries=100,
        return_intermediate_dec=True,
        backbone_num_channels=2048,
        hidden_dim=256,
        nhead=8,
        num_encoder_layers=6,
        num_decoder_layers=6,
        dim_feedforward=2048,
        dropout=0.1,
        activation="relu",
        attn_dropout=None,
        act_dropout=None,
        normalize_before=False,
    ):
        super(DETRTransformer, self).__init__()
        self.hidden_dim = hidden_dim
        self.nhead = nhead

        encoder_layer = TransformerEncoderLayer(
            hidden_dim, nhead, dim_feedforward, dropout, activation, attn_dropout, act_dropout, normalize_before
        )
        encoder_norm = nn.LayerNorm(hidden_dim) if normalize_before else None
        self.encoder = TransformerEncoder(encoder_layer, num_encoder_layers, encoder_norm)

        decoder_layer = TransformerDecoderLayer(
            hidden_dim, nhead, dim_feedforward, dropout, activation, attn_dropout, act_dropout, normalize_before
        )
        decoder_norm = nn.LayerNorm(hidden_dim)
        self.decoder = TransformerDecoder(
            decoder_layer, num_decoder_layers, decoder_norm, return_intermediate=return_intermediate_dec
        )

        self.input_proj = nn.Conv2D(backbone_num_channels, hidden_dim, kernel_size=1)
        self.query_pos_embed = nn.Embedding(num_queries, hidden_dim)
        self.position_embedding = PositionEmbedding(hidden_dim // 2, normalize=True)

        self._reset_parameters()

    def _reset_parameters(self):
        for p in self.parameters():
            if p.dim() > 1:
                xavier_uniform_(p)
        conv_init_(self.input_proj)
        normal_(self.query_pos_embed.weight)

    def _convert_attention_mask(self, mask):
        return (mask - 1.0) * 1e9

    def forward(self, src, src_mask=None, *args, **kwargs):
        # use last level feature map
        src_proj = self.input_proj(src[-1])
        bs, c, h, w = paddle.shape(src_proj)
        # flatten [B, C, H, W] to [B, HxW, C]
        src_flatten = src_proj.flatten(2).transpose([0, 2, 1])
        if src_mask is not None:
            src_mask = F.interpolate(src_mask.unsqueeze(0), size=(h, w))[0]
        else:
            src_mask = paddle.ones([bs, h, w])
        pos_embed = self.position_embedding(src_mask).flatten(1, 2)

        if self.training:
            src_mask = self._convert_attention_mask(src_mask)
            src_mask = src_mask.reshape([bs, 1, 1, h * w])
        else:
            src_mask = None

        memory = self.encoder(src_flatten, src_mask=src_mask, pos_embed=pos_embed)

        query_pos_embed = self.query_pos_embed.weight.unsqueeze(0).tile([bs, 1, 1])
        tgt = paddle.zeros_like(query_pos_embed)
        output = self.decoder(tgt, memory, memory_mask=src_mask, pos_embed=pos_embed, query_pos_embed=query_pos_embed)

        if self.training:
            src_mask = src_mask.reshape([bs, 1, 1, h, w])
        else:
            src_mask = None

        return (output, memory.transpose([0, 2, 1]).reshape([bs, c, h, w]), src_proj, src_mask)


class MLP(nn.Layer):
    """This code is based on https://github.com/facebookresearch/detr/blob/main/models/detr.py"""

    def __init__(self, input_dim, hidden_dim, output_dim, num_layers):
        super().__init__()
        self.num_layers = num_layers
        h = [hidden_dim] * (num_layers - 1)
        self.layers = nn.LayerList(nn.Linear(n, k) for n, k in zip([input_dim] + h, h + [output_dim]))

        self._reset_parameters()

    def _reset_parameters(self):
        for layer in self.layers:
            linear_init_(layer)

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = F.relu(layer(x)) if i < self.num_layers - 1 else layer(x)
        return x


class DETRHead(nn.Layer):
    def __init__(self, num_classes=80, hidden_dim=256, num_mlp_layers=3):
        super(DETRHead, self).__init__()
        # add background class
        self.num_classes = num_classes
        self.hidden_dim = hidden_dim
        self.score_head = nn.Linear(hidden_dim, self.num_classes + 1)
        self.bbox_head = MLP(hidden_dim, hidden_dim, output_dim=4, num_layers=num_mlp_layers)
        linear_init_(self.score_head)

    def forward(self, out_transformer, body_feats, inputs=None):
        feats, memory, src_proj, src_mask = out_transformer
        outputs_logit = self.score_head(feats)
        outputs_bbox = F.sigmoid(self.bbox_head(feats))
        return outputs_logit, outputs_bbox


class ConvStem(nn.Layer):
    """The backbone's stand-in: two stride-2 conv, BN, ReLU stages, one feature map out."""

    def __init__(self, in_channels, out_channels):
        super().__init__()
        self.conv1 = nn.Conv2D(in_channels, out_channels // 2, 3, stride=2, padding=1, bias_attr=False)
        self.bn1 = nn.BatchNorm2D(out_channels // 2)
        self.conv2 = nn.Conv2D(out_channels // 2, out_channels, 3, stride=2, padding=1, bias_attr=False)
        self.bn2 = nn.BatchNorm2D(out_channels)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        return [F.relu(self.bn2(self.conv2(x)))]


class DETR(nn.Layer):
    """ppdet.modeling.architectures.DETR: backbone, transformer, head (the loss is the zoo's)."""

    def __init__(self):
        super().__init__()
        self.backbone = ConvStem(CHANS, BACKBONE_CHANNELS)
        self.transformer = DETRTransformer(
            num_queries=QUERIES,
            backbone_num_channels=BACKBONE_CHANNELS,
            hidden_dim=HIDDEN,
            nhead=HEADS,
            num_encoder_layers=2,
            num_decoder_layers=2,
            dim_feedforward=FFN,
            dropout=0.0,
        )
        self.detr_head = DETRHead(num_classes=CLASSES, hidden_dim=HIDDEN)

    def forward(self, image):
        body_feats = self.backbone(image)
        out_transformer = self.transformer(body_feats)
        return self.detr_head(out_transformer, body_feats)


def build_model():
    return DETR()


def input_spec():
    return [paddle.static.InputSpec([3, CHANS, *IMG], "float32", "image")]


def loss(model, tokens, labels):
    """Pixels from the harness's token ids (a fixed function of them); every decoder level's
    queries scored against classes and boxes read from the labels (DETR's auxiliary losses)."""
    pixels = (tokens.astype("float32") / VOCAB).reshape([tokens.shape[0], 1, 1, -1])
    pixels = paddle.tile(pixels, [1, CHANS, IMG[0], IMG[1] // pixels.shape[-1]])
    logits, boxes = model(pixels)
    classes = labels[:, :QUERIES] % (CLASSES + 1)
    target_boxes = (classes.astype("float32") / (CLASSES + 1)).unsqueeze(-1).tile([1, 1, 4])
    score = F.cross_entropy(logits.reshape([-1, CLASSES + 1]), classes.tile([logits.shape[0], 1]).reshape([-1]))
    return score + F.l1_loss(boxes, target_boxes.unsqueeze(0).expand_as(boxes))
