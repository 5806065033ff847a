"""PaddleOCR's SVTR text recogniser (ppocr/modeling/backbones/rec_svtrnet.py, Apache-2.0), as
PaddleOCR writes it, at a small config, with PaddleOCR's CTC head on top.

A ``pope`` patch embedding (two ConvBNLayer, stride 2 each), a learned ``pos_embed``, three
stages of mixing blocks joined by ``SubSample`` convolutions (``patch_merging="Conv"``), post-norm
blocks (``prenorm=True``: ``norm1(x + mixer(x))``). The mixer is SVTR's ``Attention``: one fused
``qkv`` Linear reshaped with ``0`` for the batch (``reshape((0, -1, 3, heads, head_dim))``),
``q, k, v = qkv[0] * self.scale, qkv[1], qkv[2]``, scores by ``q.matmul(k.transpose(...))``; a
``Local`` mixer adds ``self.mask``, a ``[1, 1, HW, HW]`` tensor of 0 inside each token's
``local_k`` window and ``-inf`` outside, built in ``__init__`` by Python loops (a plain tensor
attribute, not a buffer); a ``Global`` one does not. The last stage pools to ``out_char_num``
columns, a 1x1 ``last_conv``, hardswish; ``Im2Seq`` and ``CTCHead`` (one Linear) score each
column. Drop path is 0 here (its ``drop_path`` draws random numbers in training).

    >>> model = build_model()
    >>> list(model(paddle.rand([3, 3, 32, 40])).shape)
    [3, 5, 37]
"""

import numpy as np
import paddle
import paddle.nn as nn
import paddle.nn.functional as F
from paddle import ParamAttr
from paddle.nn.initializer import Constant, KaimingNormal, TruncatedNormal

IMG, CHANS, OUT_CHANNELS, OUT_CHAR_NUM, CLASSES = [32, 40], 3, 24, 5, 37
VOCAB = 64  # the harness draws token ids below this; loss() turns them into pixels

trunc_normal_ = TruncatedNormal(std=0.02)
zeros_ = Constant(value=0.0)
ones_ = Constant(value=1.0)


def drop_path(x, drop_prob=0.0, training=False):
    if drop_prob == 0.0 or not training:
        return x
    keep_prob = paddle.to_tensor(1 - drop_prob, dtype=x.dtype)
    shape = (x.shape[0],) + (1,) * (x.ndim - 1)
    random_tensor = keep_prob + paddle.rand(shape, dtype=x.dtype)
    random_tensor = paddle.floor(random_tensor)  # binarize
    output = x.divide(keep_prob) * random_tensor
    return output


class ConvBNLayer(nn.Layer):
    def __init__(
        self, in_channels, out_channels, kernel_size=3, stride=1, padding=0, bias_attr=False, groups=1, act=nn.GELU
    ):
        super().__init__()
        self.conv = nn.Conv2D(
            in_channels=in_channels,
            out_channels=out_channels,
            kernel_size=kernel_size,
            stride=stride,
            padding=padding,
            groups=groups,
            weight_attr=paddle.ParamAttr(initializer=nn.initializer.KaimingUniform()),
            bias_attr=bias_attr,
        )
        self.norm = nn.BatchNorm2D(out_channels)
        self.act = act()

    def forward(self, inputs):
        out = self.conv(inputs)
        out = self.norm(out)
        out = self.act(out)
        return out


class DropPath(nn.Layer):
    def __init__(self, drop_prob=None):
        super(DropPath, self).__init__()
        self.drop_prob = drop_prob

    def forward(self, x):
        return drop_path(x, self.drop_prob, self.training)


class Identity(nn.Layer):
    def __init__(self):
        super(Identity, self).__init__()

    def forward(self, input):
        return input


class Mlp(nn.Layer):
    def __init__(self, in_features, hidden_features=None, out_features=None, act_layer=nn.GELU, drop=0.0):
        super().__init__()
        out_features = out_features or in_features
        hidden_features = hidden_features or in_features
        self.fc1 = nn.Linear(in_features, hidden_features)
        self.act = act_layer()
        self.fc2 = nn.Linear(hidden_features, out_features)
        self.drop = nn.Dropout(drop)

    def forward(self, x):
        x = self.fc1(x)
        x = self.act(x)
        x = self.drop(x)
        x = self.fc2(x)
        x = self.drop(x)
        return x


class Attention(nn.Layer):
    def __init__(
        self,
        dim,
        num_heads=8,
        mixer="Global",
        HW=None,
        local_k=[7, 11],
        qkv_bias=False,
        qk_scale=None,
        attn_drop=0.0,
        proj_drop=0.0,
    ):
        super().__init__()
        self.num_heads = num_heads
        self.dim = dim
        self.head_dim = dim // num_heads
        self.scale = qk_scale or self.head_dim**-0.5

        self.qkv = nn.Linear(dim, dim * 3, bias_attr=qkv_bias)
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)
        self.HW = HW
        if HW is not None:
            H = HW[0]
            W = HW[1]
            self.N = H * W
            self.C = dim
        if mixer == "Local" and HW is not None:
            hk = local_k[0]
            wk = local_k[1]
            mask = paddle.ones([H * W, H + hk - 1, W + wk - 1], dtype="float32")
            for h in range(0, H):
                for w in range(0, W):
                    mask[h * W + w, h : h + hk, w : w + wk] = 0.0
            mask_paddle = mask[:, hk // 2 : H + hk // 2, wk // 2 : W + wk // 2].flatten(1)
            mask_inf = paddle.full([H * W, H * W], "-inf", dtype="float32")
            mask = paddle.where(mask_paddle < 1, mask_paddle, mask_inf)
            self.mask = mask.unsqueeze([0, 1])
        self.mixer = mixer

    def forward(self, x):
        qkv = self.qkv(x).reshape((0, -1, 3, self.num_heads, self.head_dim)).transpose((2, 0, 3, 1, 4))
        q, k, v = qkv[0] * self.scale, qkv[1], qkv[2]

        attn = q.matmul(k.transpose((0, 1, 3, 2)))
        if self.mixer == "Local":
            attn += self.mask
        attn = nn.functional.softmax(attn, axis=-1)
        attn = self.attn_drop(attn)

        x = (attn.matmul(v)).transpose((0, 2, 1, 3)).reshape((0, -1, self.dim))
        x = self.proj(x)
        x = self.proj_drop(x)
        return x


class Block(nn.Layer):
    def __init__(
        self,
        dim,
        num_heads,
        mixer="Global",
        local_mixer=[7, 11],
        HW=None,
        mlp_ratio=4.0,
        qkv_bias=False,
        qk_scale=None,
        drop=0.0,
        attn_drop=0.0,
        drop_path=0.0,
        act_layer=nn.GELU,
        norm_layer="nn.LayerNorm",
        epsilon=1e-6,
        prenorm=True,
    ):
        super().__init__()
        if isinstance(norm_layer, str):
            self.norm1 = eval(norm_layer)(dim, epsilon=epsilon)
        else:
            self.norm1 = norm_layer(dim)
        if mixer == "Global" or mixer == "Local":
            self.mixer = Attention(
                dim,
                num_heads=num_heads,
                mixer=mixer,
                HW=HW,
                local_k=local_mixer,
                qkv_bias=qkv_bias,
                qk_scale=qk_scale,
                attn_drop=attn_drop,
                proj_drop=drop,
            )
        else:
            raise TypeError("The mixer must be one of [Global, Local]")

        self.drop_path = DropPath(drop_path) if drop_path > 0.0 else Identity()
        if isinstance(norm_layer, str):
            self.norm2 = eval(norm_layer)(dim, epsilon=epsilon)
        else:
            self.norm2 = norm_layer(dim)
        mlp_hidden_dim = int(dim * mlp_ratio)
        self.mlp_ratio = mlp_ratio
        self.mlp = Mlp(in_features=dim, hidden_features=mlp_hidden_dim, act_layer=act_layer, drop=drop)
        self.prenorm = prenorm

    def forward(self, x):
        if self.prenorm:
            x = self.norm1(x + self.drop_path(self.mixer(x)))
            x = self.norm2(x + self.drop_path(self.mlp(x)))
        else:
            x = x + self.drop_path(self.mixer(self.norm1(x)))
            x = x + self.drop_path(self.mlp(self.norm2(x)))
        return x


class PatchEmbed(nn.Layer):
    """Image to Patch Embedding (PaddleOCR's ``pope`` mode with ``sub_num=2``)"""

    def __init__(self, img_size=[32, 100], in_channels=3, embed_dim=768, sub_num=2):
        super().__init__()
        num_patches = (img_size[1] // (2**sub_num)) * (img_size[0] // (2**sub_num))
        self.img_size = img_size
        self.num_patches = num_patches
        self.embed_dim = embed_dim
        self.norm = None
        self.proj = nn.Sequential(
            ConvBNLayer(in_channels, embed_dim // 2, kernel_size=3, stride=2, padding=1, act=nn.GELU, bias_attr=None),
            ConvBNLayer(embed_dim // 2, embed_dim, kernel_size=3, stride=2, padding=1, act=nn.GELU, bias_attr=None),
        )

    def forward(self, x):
        B, C, H, W = x.shape
        assert H == self.img_size[0] and W == self.img_size[1], (
            f"Input image size ({H}*{W}) doesn't match model ({self.img_size[0]}*{self.img_size[1]})."
        )
        x = self.proj(x).flatten(2).transpose((0, 2, 1))
        return x


class SubSample(nn.Layer):
    def __init__(self, in_channels, out_channels, types="Conv", stride=[2, 1], sub_norm="nn.LayerNorm", act=None):
        super().__init__()
        self.types = types
        self.conv = nn.Conv2D(
            in_channels,
            out_channels,
            kernel_size=3,
            stride=stride,
            padding=1,
            weight_attr=ParamAttr(initializer=KaimingNormal()),
        )
        self.norm = eval(sub_norm)(out_channels)
        self.act = act() if act is not None else None

    def forward(self, x):
        x = self.conv(x)
        out = x.flatten(2).transpose((0, 2, 1))
        out = self.norm(out)
        if self.act is not None:
            out = self.act(out)
        return out


class SVTRNet(nn.Layer):
    def __init__(
        self,
        img_size=[32, 100],
        in_channels=3,
        embed_dim=[64, 128, 256],
        depth=[3, 6, 3],
        num_heads=[2, 4, 8],
        mixer=["Local"] * 6 + ["Global"] * 6,  # Local atten, Global atten
        local_mixer=[[7, 11], [7, 11], [7, 11]],
        mlp_ratio=4,
        qkv_bias=True,
        qk_scale=None,
        drop_rate=0.0,
        last_drop=0.1,
        attn_drop_rate=0.0,
        drop_path_rate=0.1,
        norm_layer="nn.LayerNorm",
        sub_norm="nn.LayerNorm",
        epsilon=1e-6,
        out_channels=192,
        out_char_num=25,
        act="nn.GELU",
        sub_num=2,
        prenorm=True,
    ):
        super().__init__()
        self.img_size = img_size
        self.embed_dim = embed_dim
        self.out_channels = out_channels
        self.prenorm = prenorm
        self.patch_embed = PatchEmbed(
            img_size=img_size, in_channels=in_channels, embed_dim=embed_dim[0], sub_num=sub_num
        )
        num_patches = self.patch_embed.num_patches
        self.HW = [img_size[0] // (2**sub_num), img_size[1] // (2**sub_num)]
        self.pos_embed = self.create_parameter(shape=[1, num_patches, embed_dim[0]], default_initializer=zeros_)
        self.add_parameter("pos_embed", self.pos_embed)
        self.pos_drop = nn.Dropout(p=drop_rate)

        dpr = np.linspace(0, drop_path_rate, sum(depth))
        stage_hw = [self.HW, [self.HW[0] // 2, self.HW[1]], [self.HW[0] // 4, self.HW[1]]]
        firsts = np.cumsum([0] + depth)
        stages = []
        for s in range(3):
            first, last = firsts[s], firsts[s + 1]
            stages.append(
                nn.LayerList(
                    [
                        Block(
                            dim=embed_dim[s],
                            num_heads=num_heads[s],
                            mixer=mixer[first:last][i],
                            HW=stage_hw[s],
                            local_mixer=local_mixer[s],
                            mlp_ratio=mlp_ratio,
                            qkv_bias=qkv_bias,
                            qk_scale=qk_scale,
                            drop=drop_rate,
                            act_layer=eval(act),
                            attn_drop=attn_drop_rate,
                            drop_path=dpr[first:last][i],
                            norm_layer=norm_layer,
                            epsilon=epsilon,
                            prenorm=prenorm,
                        )
                        for i in range(depth[s])
                    ]
                )
            )
        self.blocks1, self.blocks2, self.blocks3 = stages
        self.sub_sample1 = SubSample(embed_dim[0], embed_dim[1], sub_norm=sub_norm, stride=[2, 1])
        self.sub_sample2 = SubSample(embed_dim[1], embed_dim[2], sub_norm=sub_norm, stride=[2, 1])
        self.avg_pool = nn.AdaptiveAvgPool2D([1, out_char_num])
        self.last_conv = nn.Conv2D(
            in_channels=embed_dim[2],
            out_channels=self.out_channels,
            kernel_size=1,
            stride=1,
            padding=0,
            bias_attr=False,
        )
        self.hardswish = nn.Hardswish()
        self.dropout = nn.Dropout(p=last_drop, mode="downscale_in_infer")
        if not prenorm:
            self.norm = eval(norm_layer)(embed_dim[-1], epsilon=epsilon)

        trunc_normal_(self.pos_embed)
        self.apply(self._init_weights)

    def _init_weights(self, m):
        if isinstance(m, nn.Linear):
            trunc_normal_(m.weight)
            if isinstance(m, nn.Linear) and m.bias is not None:
                zeros_(m.bias)
        elif isinstance(m, nn.LayerNorm):
            zeros_(m.bias)
            ones_(m.weight)

    def forward_features(self, x):
        x = self.patch_embed(x)
        x = x + self.pos_embed
        x = self.pos_drop(x)
        for blk in self.blocks1:
            x = blk(x)
        x = self.sub_sample1(x.transpose([0, 2, 1]).reshape([0, self.embed_dim[0], self.HW[0], self.HW[1]]))
        for blk in self.blocks2:
            x = blk(x)
        x = self.sub_sample2(x.transpose([0, 2, 1]).reshape([0, self.embed_dim[1], self.HW[0] // 2, self.HW[1]]))
        for blk in self.blocks3:
            x = blk(x)
        if not self.prenorm:
            x = self.norm(x)
        return x

    def forward(self, x):
        x = self.forward_features(x)
        h = self.HW[0] // 4
        x = self.avg_pool(x.transpose([0, 2, 1]).reshape([0, self.embed_dim[2], h, self.HW[1]]))
        x = self.last_conv(x)
        x = self.hardswish(x)
        x = self.dropout(x)
        return x


class Im2Seq(nn.Layer):
    def __init__(self, in_channels, **kwargs):
        super().__init__()
        self.out_channels = in_channels

    def forward(self, x):
        B, C, H, W = x.shape
        assert H == 1
        x = x.squeeze(axis=2)
        x = x.transpose([0, 2, 1])  # (NTC)(batch, width, channels)
        return x


class CTCHead(nn.Layer):
    def __init__(self, in_channels, out_channels):
        super().__init__()
        self.fc = nn.Linear(in_channels, out_channels)

    def forward(self, x):
        return self.fc(x)


class SVTRRecognizer(nn.Layer):
    """PaddleOCR's BaseModel for rec: backbone, neck (``SequenceEncoder`` ``reshape``), head."""

    def __init__(self):
        super().__init__()
        self.backbone = SVTRNet(
            img_size=IMG,
            embed_dim=[32, 48, 64],
            depth=[1, 1, 1],
            num_heads=[4, 4, 4],
            mixer=["Local", "Global", "Global"],
            local_mixer=[[3, 5], [3, 5], [3, 5]],
            drop_path_rate=0.0,
            out_channels=OUT_CHANNELS,
            out_char_num=OUT_CHAR_NUM,
        )
        self.neck = Im2Seq(OUT_CHANNELS)
        self.head = CTCHead(OUT_CHANNELS, CLASSES)

    def forward(self, x):
        return self.head(self.neck(self.backbone(x)))


def build_model():
    return SVTRRecognizer()


def input_spec():
    return [paddle.static.InputSpec([3, CHANS, *IMG], "float32", "pixels")]


def loss(model, tokens, labels):
    """Pixels from the harness's token ids (a fixed function of them), a class per output column."""
    pixels = (tokens.astype("float32") / VOCAB).reshape([tokens.shape[0], 1, 1, -1])
    pixels = paddle.tile(pixels, [1, CHANS, IMG[0], IMG[1] // pixels.shape[-1]])
    logits = model(pixels)
    return F.cross_entropy(logits.reshape([-1, CLASSES]), labels[:, :OUT_CHAR_NUM].reshape([-1]) % CLASSES)
