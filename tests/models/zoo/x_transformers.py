"""A decoder as lucidrains' x-transformers writes it (``x_transformers.py``, the default path of
``TransformerWrapper(num_tokens, max_seq_len, attn_layers=Decoder(dim, depth, heads))``): an
``Attention`` whose ``Attend`` scores and mixes by ``einsum`` and masks causally by
``masked_fill``, returning ``(out, Intermediates)``; ``FeedForward`` as ``Sequential(Sequential(
Linear, GELU), Dropout, Linear)``; the layers a ``LayerList`` of ``[norms, block, residual]``
``LayerList``s alternating ``'a'`` and ``'f'``, pre-norm (the norms a ``LayerList`` with ``None``
for the norms not used). ``einops.rearrange`` is spelled with ``reshape``/``transpose`` (no einops
for Paddle here); the options left at their defaults are left out.

    >>> model = build_model()
    >>> list(model(paddle.randint(0, VOCAB, [2, 16])).shape)
    [2, 16, 64]
"""

from dataclasses import dataclass

import paddle
import paddle.nn as nn
import paddle.nn.functional as F

DEFAULT_DIM_HEAD = 64


def exists(val):
    return val is not None


def default(val, d):
    if exists(val):
        return val
    return d() if callable(d) else d


def max_neg_value(tensor):
    return -paddle.finfo(tensor.dtype).max


@dataclass
class Intermediates:
    qk_similarities: paddle.Tensor | None = None
    pre_softmax_attn: paddle.Tensor | None = None
    post_softmax_attn: paddle.Tensor | None = None


class Attend(nn.Layer):
    def __init__(self, *, dropout=0.0, causal=False, heads=None, scale=None):
        super().__init__()
        self.scale = scale
        self.causal = causal
        self.attn_fn = F.softmax
        self.dropout = dropout
        self.attn_dropout = nn.Dropout(dropout)

    def create_causal_mask(self, i, j):
        return paddle.triu(paddle.ones((i, j), dtype="int64"), j - i + 1).astype("bool")

    def forward(self, q, k, v, mask=None):
        """
        einstein notation
        b - batch
        h - heads
        n, i, j - sequence length (base sequence length, source, target)
        d - feature dimension
        """
        scale = default(self.scale, q.shape[-1] ** -0.5)

        kv_einsum_eq = "bjd" if k.ndim == 3 else "bhjd"

        dots = paddle.einsum(f"bhid,{kv_einsum_eq}->bhij", q, k) * scale
        qk_similarities = dots.clone()

        mask_value = max_neg_value(dots)

        if exists(mask):
            dots = dots.masked_fill(~mask, mask_value)

        if self.causal:
            i, j = dots.shape[-2:]
            causal_mask = self.create_causal_mask(i, j)
            dots = dots.masked_fill(causal_mask, mask_value)

        pre_softmax_attn = dots.clone()

        attn = self.attn_fn(dots, axis=-1)
        post_softmax_attn = attn.clone()

        attn = self.attn_dropout(attn)

        out = paddle.einsum(f"bhij,{kv_einsum_eq}->bhid", attn, v)

        intermediates = Intermediates(
            qk_similarities=qk_similarities,
            pre_softmax_attn=pre_softmax_attn,
            post_softmax_attn=post_softmax_attn,
        )

        return out, intermediates


class Attention(nn.Layer):
    def __init__(self, dim, dim_head=DEFAULT_DIM_HEAD, heads=8, causal=False, dropout=0.0):
        super().__init__()
        self.scale = dim_head**-0.5
        self.heads = heads
        self.causal = causal

        q_dim = k_dim = v_dim = out_dim = dim_head * heads

        self.to_q = nn.Linear(dim, q_dim, bias_attr=False)
        self.to_k = nn.Linear(dim, k_dim, bias_attr=False)
        self.to_v = nn.Linear(dim, v_dim, bias_attr=False)

        self.attend = Attend(heads=heads, causal=causal, dropout=dropout)

        self.to_out = nn.Linear(out_dim, dim, bias_attr=False)

    def forward(self, x, context=None, mask=None, return_intermediates=False):
        b, n, h = x.shape[0], x.shape[1], self.heads
        kv_input = default(context, x)

        q = self.to_q(x)
        k = self.to_k(kv_input)
        v = self.to_v(kv_input)

        # rearrange(t, 'b n (h d) -> b h n d', h = h)
        q, k, v = (t.reshape([b, t.shape[1], h, -1]).transpose([0, 2, 1, 3]) for t in (q, k, v))

        out, intermediates = self.attend(q, k, v, mask=mask)

        # rearrange(out, 'b h n d -> b n (h d)')
        out = out.transpose([0, 2, 1, 3]).reshape([b, n, -1])

        out = self.to_out(out)

        if not return_intermediates:
            return out

        return out, intermediates


class FeedForward(nn.Layer):
    def __init__(self, dim, dim_out=None, mult=4, dropout=0.0):
        super().__init__()
        inner_dim = int(dim * mult)
        dim_out = default(dim_out, dim)
        project_in = nn.Sequential(nn.Linear(dim, inner_dim), nn.GELU())
        self.ff = nn.Sequential(project_in, nn.Dropout(dropout), nn.Linear(inner_dim, dim_out))

    def forward(self, x):
        return self.ff(x)


class Residual(nn.Layer):
    def __init__(self, dim, scale_residual=False, scale_residual_constant=1.0):
        super().__init__()
        self.residual_scale = (
            self.create_parameter([dim], default_initializer=nn.initializer.Constant(1.0)) if scale_residual else None
        )
        self.scale_residual_constant = scale_residual_constant

    def forward(self, x, residual):
        if exists(self.residual_scale):
            residual = residual * self.residual_scale

        if self.scale_residual_constant != 1:
            residual = residual * self.scale_residual_constant

        return x + residual


class AttentionLayers(nn.Layer):
    def __init__(self, dim, depth, heads=8, causal=False, pre_norm=True, attn_dim_head=DEFAULT_DIM_HEAD):
        super().__init__()
        self.dim = dim
        self.depth = depth
        self.causal = causal
        self.layers = nn.LayerList([])

        default_block = ("a", "f")
        layer_types = default_block * depth
        self.layer_types = layer_types
        self.num_attn_layers = len(list(filter(lambda t: t == "a", layer_types)))

        self.final_norm = nn.LayerNorm(dim) if pre_norm else None

        for layer_type in self.layer_types:
            if layer_type == "a":
                layer = Attention(dim, dim_head=attn_dim_head, heads=heads, causal=causal)
            elif layer_type == "f":
                layer = FeedForward(dim)
            else:
                raise Exception(f"invalid layer type {layer_type}")

            residual = Residual(dim)

            pre_branch_norm = nn.LayerNorm(dim) if pre_norm else None
            post_branch_norm = None
            post_main_norm = nn.LayerNorm(dim) if not pre_norm else None

            norms = nn.LayerList([pre_branch_norm, post_branch_norm, post_main_norm])

            self.layers.append(nn.LayerList([norms, layer, residual]))

    def forward(self, x, mask=None, return_hiddens=False):
        hiddens = []
        intermediates = []

        for layer_type, (norm, block, residual_fn) in zip(self.layer_types, self.layers):
            if layer_type == "a":
                hiddens.append(x)

            residual = x

            pre_norm, post_branch_norm, post_main_norm = norm

            if exists(pre_norm):
                x = pre_norm(x)

            if layer_type == "a":
                out, inter = block(x, mask=mask, return_intermediates=True)
            elif layer_type == "f":
                out = block(x)

            if exists(post_branch_norm):
                out = post_branch_norm(out)

            x = residual_fn(out, residual)

            if layer_type == "a":
                intermediates.append(inter)

            if exists(post_main_norm):
                x = post_main_norm(x)

        if exists(self.final_norm):
            x = self.final_norm(x)

        if return_hiddens:
            return x, (hiddens, intermediates)

        return x


class Decoder(AttentionLayers):
    def __init__(self, **kwargs):
        assert "causal" not in kwargs, "cannot set causality on decoder"
        super().__init__(causal=True, **kwargs)


class TokenEmbedding(nn.Layer):
    def __init__(self, dim, num_tokens):
        super().__init__()
        self.emb = nn.Embedding(num_tokens, dim)

    def forward(self, x):
        return self.emb(x)


class AbsolutePositionalEmbedding(nn.Layer):
    def __init__(self, dim, max_seq_len):
        super().__init__()
        self.scale = dim**-0.5
        self.max_seq_len = max_seq_len
        self.emb = nn.Embedding(max_seq_len, dim)

    def forward(self, x, pos=None):
        seq_len = x.shape[1]
        assert seq_len <= self.max_seq_len, (
            f"you are passing in a sequence length of {seq_len} but your absolute positional embedding has a max "
            f"sequence length of {self.max_seq_len}"
        )

        if not exists(pos):
            pos = paddle.arange(seq_len)

        pos_emb = self.emb(pos)
        pos_emb = pos_emb * self.scale
        return pos_emb


class TransformerWrapper(nn.Layer):
    def __init__(self, *, num_tokens, max_seq_len, attn_layers, emb_dropout=0.0):
        super().__init__()
        dim = attn_layers.dim
        self.max_seq_len = max_seq_len
        self.token_emb = TokenEmbedding(dim, num_tokens)
        self.pos_emb = AbsolutePositionalEmbedding(dim, max_seq_len)
        self.emb_dropout = nn.Dropout(emb_dropout)
        self.attn_layers = attn_layers
        self.to_logits = nn.Linear(dim, num_tokens, bias_attr=False)

    def forward(self, x, mask=None):
        x = self.token_emb(x) + self.pos_emb(x)
        x = self.emb_dropout(x)
        x = self.attn_layers(x, mask=mask)
        return self.to_logits(x)


VOCAB = 64  # for the test harness


def build_model():
    return TransformerWrapper(
        num_tokens=VOCAB, max_seq_len=32, attn_layers=Decoder(dim=32, depth=2, heads=4, attn_dim_head=8)
    )


def input_spec():
    return [paddle.static.InputSpec([2, 16], "int64", "input_ids")]


def loss(model, tokens, labels):
    return F.cross_entropy(model(tokens).reshape([-1, VOCAB]), labels.reshape([-1]))
