"""XLM as the HuggingFace port writes it (``modeling_xlm.py``), causal (XLM's CLM objective):
``MultiHeadAttention`` with ``q_lin``/``k_lin``/``v_lin``/``out_lin`` whose scores are masked by
``masked_fill`` (``scores.masked_fill_(mask, finfo.min)`` in HF) and which returns a tuple,
``TransformerFFN`` with ``lin1``/``lin2``, post-norm, and no block class: the layers are parallel
``LayerList``s (``attentions``, ``layer_norm1``, ``ffns``, ``layer_norm2``) indexed in one loop,
the masks built by ``get_masks``. The prediction layer is not tied to the embeddings (a Paddle
``Linear`` weight is ``[in, out]``, the table ``[vocab, dim]``).

Written in the round of local views for attentions Paddle's SPMD rules cannot keep split
(``masked_fill`` has no rule, issue 22).

    >>> model = build_model()
    >>> list(model(paddle.randint(0, VOCAB, [2, 16])).shape)
    [2, 16, 64]
"""

import dataclasses
import itertools
import math

import paddle
import paddle.nn as nn
import paddle.nn.functional as F


@dataclasses.dataclass
class XLMConfig:
    vocab_size: int = 64
    emb_dim: int = 32
    n_layers: int = 2
    n_heads: int = 4
    # XLM drops out by F.dropout, which the training comparisons cannot turn off as they do
    # nn.Dropout layers (tests/harness/workloads.py without_dropout): none in the tiny config
    dropout: float = 0.0
    attention_dropout: float = 0.0
    max_position_embeddings: int = 32
    layer_norm_eps: float = 1e-12
    gelu_activation: bool = True
    causal: bool = True


def get_masks(slen, lengths, causal, padding_mask=None):
    """Generate hidden states mask, and optionally an attention mask."""
    alen = paddle.arange(slen, dtype="int64")
    if padding_mask is not None:
        mask = padding_mask
    else:
        mask = alen < lengths[:, None]

    # attention mask is the same as mask, or triangular inferior attention (causal)
    bs = lengths.shape[0]
    if causal:
        attn_mask = alen[None, None, :].tile([bs, slen, 1]) <= alen[None, :, None]
    else:
        attn_mask = mask

    return mask, attn_mask


class MultiHeadAttention(nn.Layer):
    NEW_ID = itertools.count()

    def __init__(self, n_heads, dim, config):
        super().__init__()
        self.layer_id = next(MultiHeadAttention.NEW_ID)
        self.dim = dim
        self.n_heads = n_heads
        self.dropout = config.attention_dropout
        assert self.dim % self.n_heads == 0

        self.q_lin = nn.Linear(dim, dim)
        self.k_lin = nn.Linear(dim, dim)
        self.v_lin = nn.Linear(dim, dim)
        self.out_lin = nn.Linear(dim, dim)

    def forward(self, input, mask, kv=None, cache=None, head_mask=None, output_attentions=False):
        """Self-attention (if kv is None) or attention over source sentence (provided by kv)."""
        # Input is (bs, qlen, dim)
        # Mask is (bs, klen) (non-causal) or (bs, klen, klen)
        bs, qlen, dim = input.shape
        klen = qlen if kv is None else kv.shape[1]
        n_heads = self.n_heads
        dim_per_head = self.dim // n_heads
        mask_reshape = (bs, 1, qlen, klen) if mask.ndim == 3 else (bs, 1, 1, klen)

        def shape(x):
            """projection"""
            return x.reshape([bs, -1, self.n_heads, dim_per_head]).transpose([0, 2, 1, 3])

        def unshape(x):
            """compute context"""
            return x.transpose([0, 2, 1, 3]).reshape([bs, -1, self.n_heads * dim_per_head])

        q = shape(self.q_lin(input))  # (bs, n_heads, qlen, dim_per_head)
        if kv is None:
            k = shape(self.k_lin(input))  # (bs, n_heads, qlen, dim_per_head)
            v = shape(self.v_lin(input))  # (bs, n_heads, qlen, dim_per_head)
        else:
            k = shape(self.k_lin(kv))  # (bs, n_heads, qlen, dim_per_head)
            v = shape(self.v_lin(kv))  # (bs, n_heads, qlen, dim_per_head)

        q = q / math.sqrt(dim_per_head)  # (bs, n_heads, qlen, dim_per_head)
        scores = paddle.matmul(q, k, transpose_y=True)  # (bs, n_heads, qlen, klen)
        mask = (mask == 0).reshape(mask_reshape).expand_as(scores)  # (bs, n_heads, qlen, klen)
        scores = scores.masked_fill(mask, paddle.finfo(scores.dtype).min)  # (bs, n_heads, qlen, klen)

        weights = F.softmax(scores.astype("float32"), axis=-1).astype(scores.dtype)  # (bs, n_heads, qlen, klen)
        weights = F.dropout(weights, p=self.dropout, training=self.training)  # (bs, n_heads, qlen, klen)

        # Mask heads if we want to
        if head_mask is not None:
            weights = weights * head_mask

        context = paddle.matmul(weights, v)  # (bs, n_heads, qlen, dim_per_head)
        context = unshape(context)  # (bs, qlen, dim)

        outputs = (self.out_lin(context),)
        if output_attentions:
            outputs = outputs + (weights,)
        return outputs


class TransformerFFN(nn.Layer):
    def __init__(self, in_dim, dim_hidden, out_dim, config):
        super().__init__()
        self.dropout = config.dropout
        self.lin1 = nn.Linear(in_dim, dim_hidden)
        self.lin2 = nn.Linear(dim_hidden, out_dim)
        self.act = F.gelu if config.gelu_activation else F.relu

    def forward(self, input):
        x = self.lin1(input)
        x = self.act(x)
        x = self.lin2(x)
        x = F.dropout(x, p=self.dropout, training=self.training)
        return x


class XLMModel(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.causal = config.causal
        self.n_words = config.vocab_size
        self.dim = config.emb_dim  # 512 by default
        self.hidden_dim = self.dim * 4  # 2048 by default
        self.n_heads = config.n_heads  # 8 by default
        self.n_layers = config.n_layers
        self.dropout = config.dropout
        assert self.dim % self.n_heads == 0, "transformer dim must be a multiple of n_heads"

        # embeddings
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, self.dim)
        self.embeddings = nn.Embedding(self.n_words, self.dim)
        self.layer_norm_emb = nn.LayerNorm(self.dim, epsilon=config.layer_norm_eps)

        # transformer layers
        self.attentions = nn.LayerList()
        self.layer_norm1 = nn.LayerList()
        self.ffns = nn.LayerList()
        self.layer_norm2 = nn.LayerList()

        for _ in range(self.n_layers):
            self.attentions.append(MultiHeadAttention(self.n_heads, self.dim, config=config))
            self.layer_norm1.append(nn.LayerNorm(self.dim, epsilon=config.layer_norm_eps))
            self.ffns.append(TransformerFFN(self.dim, self.hidden_dim, self.dim, config=config))
            self.layer_norm2.append(nn.LayerNorm(self.dim, epsilon=config.layer_norm_eps))

    def forward(self, input_ids):
        bs, slen = input_ids.shape
        lengths = paddle.full([bs], slen, dtype="int64")

        # generate masks
        mask, attn_mask = get_masks(slen, lengths, self.causal)

        # positions
        position_ids = paddle.arange(slen, dtype="int64").unsqueeze(0).expand([bs, slen])

        # embeddings
        tensor = self.embeddings(input_ids)
        tensor = tensor + self.position_embeddings(position_ids).expand_as(tensor)
        tensor = self.layer_norm_emb(tensor)
        tensor = F.dropout(tensor, p=self.dropout, training=self.training)
        tensor = tensor * mask.unsqueeze(-1).astype(tensor.dtype)

        # transformer layers
        for i in range(self.n_layers):
            # self attention
            attn_outputs = self.attentions[i](tensor, attn_mask)
            attn = attn_outputs[0]
            attn = F.dropout(attn, p=self.dropout, training=self.training)
            tensor = tensor + attn
            tensor = self.layer_norm1[i](tensor)

            # FFN
            tensor = tensor + self.ffns[i](tensor)
            tensor = self.layer_norm2[i](tensor)
            tensor = tensor * mask.unsqueeze(-1).astype(tensor.dtype)

        return tensor


class XLMPredLayer(nn.Layer):
    """Prediction layer (cross_entropy or adaptive_softmax)."""

    def __init__(self, config):
        super().__init__()
        self.n_words = config.vocab_size
        self.proj = nn.Linear(config.emb_dim, config.vocab_size)

    def forward(self, x):
        return self.proj(x)


class XLMWithLMHeadModel(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.transformer = XLMModel(config)
        self.pred_layer = XLMPredLayer(config)

    def forward(self, input_ids):
        return self.pred_layer(self.transformer(input_ids))


VOCAB = XLMConfig().vocab_size  # for the test harness


def build_model():
    return XLMWithLMHeadModel(XLMConfig())


def input_spec():
    return [paddle.static.InputSpec([2, 16], "int64", "input_ids")]


def loss(model, tokens, labels):
    return F.cross_entropy(model(tokens).reshape([-1, VOCAB]), labels.reshape([-1]))
