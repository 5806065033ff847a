"""Mixtral as Mistral AI's reference ``one_file_ref.py`` writes it (mistral-src), ported to Paddle
for training (no KV cache): ``wq``/``wk``/``wv``/``wo``, rotary by complex multiplication
(``view_as_complex`` of interleaved pairs times ``freqs_cis`` from ``polar``), ``repeat_kv`` by
``repeat_interleave``, an additive mask, and a ``MoeLayer`` that is handed its experts and its
gate: top-2 of the gate logits, softmax over the two, and for each expert
``batch_idx, nth_expert = where(selected_experts == i)``,
``results[batch_idx] += weights[batch_idx, nth_expert, None] * expert(inputs[batch_idx])``.

    >>> model = build_model()
    >>> list(model(paddle.randint(0, 64, [2, 8])).shape)
    [2, 8, 64]
"""

import dataclasses

import paddle
import paddle.nn as nn
import paddle.nn.functional as F


@dataclasses.dataclass
class MoeArgs:
    num_experts: int
    num_experts_per_tok: int


@dataclasses.dataclass
class ModelArgs:
    dim: int = 32
    n_layers: int = 2
    head_dim: int = 8
    hidden_dim: int = 64
    n_heads: int = 4
    n_kv_heads: int = 2
    norm_eps: float = 1e-5
    vocab_size: int = 64
    max_seq_len: int = 16
    moe: MoeArgs = dataclasses.field(default_factory=lambda: MoeArgs(num_experts=4, num_experts_per_tok=2))


def repeat_kv(keys, values, repeats: int):
    keys = paddle.repeat_interleave(keys, repeats=repeats, axis=2)
    values = paddle.repeat_interleave(values, repeats=repeats, axis=2)
    return keys, values


def _reshape_for_broadcast(freqs_cis, x):
    """freqs_cis: complex (seq_len, head_dim / 2); x: complex (bsz, seq_len, heads, head_dim / 2)."""
    ndim = x.ndim
    assert 1 < ndim
    assert tuple(freqs_cis.shape) == (x.shape[1], x.shape[-1]), (freqs_cis.shape, (x.shape[1], x.shape[-1]))
    shape = [d if i == 1 or i == ndim - 1 else 1 for i, d in enumerate(x.shape)]
    return freqs_cis.reshape(shape)


def apply_rotary_emb(xq, xk, freqs_cis):
    xq_ = paddle.as_complex(xq.astype("float32").reshape([*xq.shape[:-1], -1, 2]))
    xk_ = paddle.as_complex(xk.astype("float32").reshape([*xk.shape[:-1], -1, 2]))
    freqs_cis = _reshape_for_broadcast(freqs_cis, xq_)
    xq_out = paddle.as_real(xq_ * freqs_cis).flatten(3)
    xk_out = paddle.as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.astype(xq.dtype), xk_out.astype(xk.dtype)


class Attention(nn.Layer):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.n_heads: int = args.n_heads
        self.n_kv_heads: int = args.n_kv_heads
        self.repeats = self.n_heads // self.n_kv_heads
        self.scale = self.args.head_dim**-0.5
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias_attr=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias_attr=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias_attr=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias_attr=False)

    def forward(self, x, freqs_cis, mask):
        bsz, seqlen, _ = x.shape
        xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)
        xq = xq.reshape([bsz, seqlen, self.n_heads, self.args.head_dim])
        xk = xk.reshape([bsz, seqlen, self.n_kv_heads, self.args.head_dim])
        xv = xv.reshape([bsz, seqlen, self.n_kv_heads, self.args.head_dim])
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis=freqs_cis)
        key, value = repeat_kv(xk, xv, self.repeats)
        query = xq.transpose([0, 2, 1, 3])
        key = key.transpose([0, 2, 1, 3])
        value = value.transpose([0, 2, 1, 3])
        # scores : [bsz, n_heads, seqlen, seqlen]
        scores = paddle.matmul(query, key.transpose([0, 1, 3, 2])) * self.scale
        if mask is not None:
            scores += mask[None, None, ...]
        scores = scores.astype("float32")
        scores = F.softmax(scores, axis=-1).astype(query.dtype)
        output = paddle.matmul(scores, value)  # (bs, n_local_heads, slen, head_dim)
        output = output.transpose([0, 2, 1, 3]).reshape([bsz, seqlen, -1])
        return self.wo(output)


class FeedForward(nn.Layer):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.hidden_dim, bias_attr=False)
        self.w2 = nn.Linear(args.hidden_dim, args.dim, bias_attr=False)
        self.w3 = nn.Linear(args.dim, args.hidden_dim, bias_attr=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class RMSNorm(nn.Layer):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = self.create_parameter([dim], default_initializer=nn.initializer.Constant(1.0))

    def _norm(self, x):
        return x * paddle.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        output = self._norm(x.astype("float32")).astype(x.dtype)
        return output * self.weight


class MoeLayer(nn.Layer):
    def __init__(self, experts: list, gate: nn.Layer, moe_args: MoeArgs):
        super().__init__()
        assert len(experts) > 0
        self.experts = nn.LayerList(experts)
        self.gate = gate
        self.args = moe_args

    def forward(self, inputs):
        org_input_shape = inputs.shape
        inputs = inputs.reshape([-1, inputs.shape[-1]])
        gate_logits = self.gate(inputs)
        weights, selected_experts = paddle.topk(gate_logits, self.args.num_experts_per_tok)
        weights = F.softmax(weights, axis=-1, dtype="float32").astype(inputs.dtype)
        results = paddle.zeros_like(inputs)
        for i, expert in enumerate(self.experts):
            batch_idx, nth_expert = paddle.where(selected_experts == i)
            results[batch_idx] += weights[batch_idx, nth_expert, None] * expert(inputs[batch_idx])
        return results.reshape(org_input_shape)


class TransformerBlock(nn.Layer):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads = args.n_heads
        self.dim = args.dim
        self.attention = Attention(args)
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.args = args
        if args.moe is not None:
            self.feed_forward = MoeLayer(
                experts=[FeedForward(args=args) for _ in range(args.moe.num_experts)],
                gate=nn.Linear(args.dim, args.moe.num_experts, bias_attr=False),
                moe_args=args.moe,
            )
        else:
            self.feed_forward = FeedForward(args=args)

    def forward(self, x, freqs_cis, mask):
        r = self.attention.forward(self.attention_norm(x), freqs_cis, mask)
        h = x + r
        r = self.feed_forward.forward(self.ffn_norm(h))
        out = h + r
        return out


def precompute_freqs_cis(dim: int, end: int, theta: float = 1000000.0):
    freqs = 1.0 / (theta ** (paddle.arange(0, dim, 2)[: (dim // 2)].astype("float32") / dim))
    t = paddle.arange(end).astype("float32")
    freqs = paddle.outer(t, freqs).astype("float32")
    return paddle.polar(paddle.ones_like(freqs), freqs)  # complex64


class Transformer(nn.Layer):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.vocab_size = args.vocab_size
        self.n_layers = args.n_layers
        assert self.vocab_size > 0
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.LayerList([TransformerBlock(args=args) for _ in range(args.n_layers)])
        self.norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias_attr=False)
        self.freqs_cis = precompute_freqs_cis(self.args.head_dim, args.max_seq_len * 2)

    def forward(self, input_ids):
        seqlen = input_ids.shape[1]
        h = self.tok_embeddings(input_ids)
        positions = paddle.arange(seqlen)
        freqs_cis = self.freqs_cis[positions]
        mask = paddle.triu(paddle.full([seqlen, seqlen], float("-inf")), diagonal=1)
        for layer in self.layers:
            h = layer(h, freqs_cis, mask)
        return self.output(self.norm(h)).astype("float32")


VOCAB = ModelArgs().vocab_size  # for the test harness


def build_model():
    return Transformer(ModelArgs())


def input_spec():
    return [paddle.static.InputSpec([2, 8], "int64", "input_ids")]


def loss(model, tokens, labels):
    return F.cross_entropy(model(tokens).reshape([-1, VOCAB]), labels.reshape([-1]))
