"""A GShard mixture of experts as fairscale writes it (fairscale/nn/moe/top2gate.py and
moe_layer.py, the code fairseq's modules/moe mirrors), in a fairseq ``transformer_lm`` decoder
(fairseq/modules/transformer_layer.py, multihead_attention.py), ported line by line to Paddle.

- ``Top2Gate``: a ``wg`` linear; ``top2gating`` picks each token's first expert by ``argmax``,
  its second by ``argmax`` over Gumbel-noised logits with the first masked out, drops tokens past
  each expert's capacity (2S/E), and returns the auxiliary loss, combine weights ``[S, E, C]``
  and the dispatch mask. No ``topk`` anywhere.
- ``MOELayer``: ``einsum("sec,sm->ecm")`` dispatches tokens into per-expert capacity slots, each
  expert of the ``LayerList`` runs on its chunk, ``einsum("sec,ecm->sm")`` combines them. Built
  with no process group, as in a single process: all experts are local and the all-to-all is the
  identity (fairseq's mirror skips it likewise when torch.distributed is not initialised).
- The decoder layer is fairseq's: pre-norm (``decoder_normalize_before``), time-major ``[T, B, C]``
  activations, ``MultiheadAttention`` with q scaled before ``bmm`` over ``[B * heads, T, d]``, an
  MoE feed-forward every other layer (``moe_freq=2``: layer 1; layer 0 has ``fc1``/``fc2``),
  sinusoidal positions and output logits tied to the token embedding.

fairscale asserts the batch is a multiple of the local experts: batches of 4 here.
The loss adds the gates' auxiliary loss as fairseq's MoE criterion does (weight 0.01).

    >>> model = build_model()
    >>> list(model(paddle.randint(0, VOCAB, [4, 8])).shape)
    [4, 8, 64]
"""

import math

import paddle
import paddle.nn as nn
import paddle.nn.functional as F

VOCAB, EMBED, FFN, LAYERS, HEADS, EXPERTS, MOE_FREQ = 64, 32, 64, 2, 4, 4, 2
GATE_LOSS_WEIGHT = 0.01

# -- fairscale/nn/moe/top2gate.py ------------------------------------------------------------------


def gumbel_rsample(shape):
    # fairscale caches one sampler per torch device in a module-level dict; Paddle samples on the
    # current place, and dy2static reads a module dict assigned under an `if` as an undefined
    # local (docs/paddle-notes.md, "Tracing"), so the sampler is built on each call.
    one = paddle.to_tensor(1.0)
    zero = paddle.to_tensor(0.0)
    gumbel = paddle.distribution.Gumbel(zero, one).rsample
    return gumbel(shape)


def one_hot(tensor, num_classes):
    """Workaround for https://github.com/pytorch/pytorch/issues/55579"""
    assert num_classes > 0, "num_classes must be a positive integer"
    ret = paddle.zeros([*tensor.shape, num_classes], dtype=tensor.dtype)
    ret.put_along_axis_(tensor.unsqueeze(-1), 1, -1)
    return ret


def top2gating(logits):
    """Implements Top2Gating on logits."""
    # NOTE(msb) softmax requires FP32: https://docs.nvidia.com/deeplearning/performance/mixed-precision-training/
    gates = F.softmax(logits, axis=1, dtype="float32")

    # gates has shape of SE
    num_tokens = gates.shape[0]
    num_experts = gates.shape[1]
    # capacity = 2S/E
    capacity = 2 * num_tokens // num_experts
    assert num_tokens % num_experts == 0

    # Create a mask for 1st's expert per token
    indices1_s = paddle.argmax(gates, axis=1)
    mask1 = one_hot(indices1_s, num_classes=num_experts)

    # Create a mask for 2nd's expert per token using Gumbel-max trick
    # https://timvieira.github.io/blog/post/2014/07/31/gumbel-max-trick/
    logits_w_noise = logits + gumbel_rsample(logits.shape)
    # Replace top-expert with min value
    logits_except1 = logits_w_noise.masked_fill(mask1.astype("bool"), float("-inf"))
    indices2_s = paddle.argmax(logits_except1, axis=1)
    mask2 = one_hot(indices2_s, num_classes=num_experts)

    # Compute locations in capacity buffer
    locations1 = paddle.cumsum(mask1, axis=0) - 1
    locations2 = paddle.cumsum(mask2, axis=0) - 1
    # Update 2nd's location by accounting for locations of 1st
    locations2 += paddle.sum(mask1, axis=0, keepdim=True)

    # Compute l_aux
    me = paddle.mean(gates, axis=0)
    ce = paddle.mean(mask1.astype("float32"), axis=0)
    l_aux = paddle.mean(me * ce)

    # Remove locations outside capacity from mask
    mask1 *= paddle.less_than(locations1, paddle.to_tensor(capacity, dtype=locations1.dtype)).astype(mask1.dtype)
    mask2 *= paddle.less_than(locations2, paddle.to_tensor(capacity, dtype=locations2.dtype)).astype(mask2.dtype)

    # Store the capacity location for each token
    locations1_s = paddle.sum(locations1 * mask1, axis=1)
    locations2_s = paddle.sum(locations2 * mask2, axis=1)

    # Normalize gate probabilities
    gates1_s = (gates * mask1.astype(gates.dtype)).sum(axis=1)  # einsum("se,se->s")
    gates2_s = (gates * mask2.astype(gates.dtype)).sum(axis=1)  # einsum("se,se->s")
    denom_s = gates1_s + gates2_s
    # Avoid divide-by-zero
    denom_s = paddle.clip(denom_s, min=paddle.finfo(denom_s.dtype).eps)
    gates1_s /= denom_s
    gates2_s /= denom_s

    # Calculate combine_weights and dispatch_mask
    gates1 = gates1_s.unsqueeze(-1) * mask1.astype(gates1_s.dtype)  # einsum("s,se->se")
    gates2 = gates2_s.unsqueeze(-1) * mask2.astype(gates2_s.dtype)  # einsum("s,se->se")
    locations1_sc = one_hot(locations1_s, num_classes=capacity)
    locations2_sc = one_hot(locations2_s, num_classes=capacity)
    combine1_sec = gates1.unsqueeze(2) * locations1_sc.astype(gates1.dtype).unsqueeze(1)  # einsum("se,sc->sec")
    combine2_sec = gates2.unsqueeze(2) * locations2_sc.astype(gates2.dtype).unsqueeze(1)  # einsum("se,sc->sec")
    combine_weights = combine1_sec + combine2_sec
    dispatch_mask = combine_weights.astype("bool")

    return l_aux.astype(logits.dtype), combine_weights.astype(logits.dtype), dispatch_mask


class Top2Gate(nn.Layer):
    """Gate module which implements Top2Gating as described in Gshard_.
    ::

        gate = Top2Gate(model_dim, num_experts)
        l_aux, combine_weights, dispatch_mask = gate(input)

    .. Gshard_: https://arxiv.org/pdf/2006.16668.pdf
    """

    def __init__(self, model_dim, num_experts):
        super().__init__()
        self.wg = nn.Linear(model_dim, num_experts, bias_attr=False)

    def forward(self, input):
        logits = self.wg(input)
        return top2gating(logits)


# -- fairscale/nn/moe/moe_layer.py -----------------------------------------------------------------

# einsum dimensions: (g)roup, (s)equence, (e)xpert, (m)odel, (c)apacity
# See https://arxiv.org/pdf/2006.16668.pdf for details.


def _all_to_all(group, input):
    """fairscale's ``_AllToAll``; with no process group (one process) the identity."""
    if group is None:
        return input
    output = paddle.empty_like(input)
    paddle.distributed.alltoall_single(input, output, group=group)
    return output


class MOELayer(nn.Layer):
    """MOELayer module which implements MixtureOfExperts as described in Gshard_.
    ::

        gate = Top2Gate(model_dim, num_experts)
        moe = MOELayer(gate, expert)
        output = moe(input)
        l_aux = moe.l_aux

    .. _Gshard: https://arxiv.org/pdf/2006.16668.pdf
    """

    def __init__(self, gate, experts, group=None):
        super().__init__()
        self.gate = gate
        if type(experts) is nn.LayerList:
            self.experts = experts
        else:
            self.experts = nn.LayerList([experts])
        self.group = group
        for expert in self.experts:
            for p in experts.parameters():
                p.expert = True
        self.world_size = 1 if group is None else group.nranks
        self.num_local_experts = len(self.experts)

    def forward(self, *input):
        assert len(input) == 1, "only single input Tensor supported"
        assert len(input[0].shape) == 3, "input Tensor must have dimensions: (s)equence, (t)oken, (m)odel"
        assert input[0].shape[0] % len(self.experts) == 0, "num tokens must be order of number of local experts"

        # Implement Algorithm 2 from GShard paper.
        d_model = input[0].shape[2]
        # Reshape into S tokens by dropping sequence dimension.
        reshaped_input = input[0].reshape([-1, d_model])
        self.l_aux, combine_weights, dispatch_mask = self.gate(reshaped_input)
        dispatched_input = paddle.einsum("sec,sm->ecm", dispatch_mask.astype("float32"), reshaped_input)
        dispatched_input = _all_to_all(self.group, dispatched_input)
        # Re-shape after all-to-all: ecm -> gecm
        dispatched_input = dispatched_input.reshape([self.world_size, self.num_local_experts, -1, d_model])
        chunks = dispatched_input.chunk(self.num_local_experts, axis=1)
        expert_outputs = []
        for chunk, expert in zip(chunks, self.experts):
            expert_outputs += [expert(chunk)]
        expert_output = paddle.concat(expert_outputs, axis=1)
        expert_output = _all_to_all(self.group, expert_output)
        # Re-shape back: gecm -> ecm
        expert_output = expert_output.reshape([self.world_size * self.num_local_experts, -1, d_model])
        combined_output = paddle.einsum("sec,ecm->sm", combine_weights, expert_output)
        return combined_output.reshape(input[0].shape)


# -- fairseq/modules/multihead_attention.py, transformer_layer.py ----------------------------------


class MultiheadAttention(nn.Layer):
    """Multi-headed attention. See "Attention Is All You Need" for more details."""

    def __init__(self, embed_dim, num_heads, dropout=0.0, bias=True):
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.dropout_module = nn.Dropout(dropout)
        self.head_dim = embed_dim // num_heads
        assert self.head_dim * num_heads == self.embed_dim, "embed_dim must be divisible by num_heads"
        self.scaling = self.head_dim**-0.5
        bias_attr = None if bias else False
        self.k_proj = nn.Linear(embed_dim, embed_dim, bias_attr=bias_attr)
        self.v_proj = nn.Linear(embed_dim, embed_dim, bias_attr=bias_attr)
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias_attr=bias_attr)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias_attr=bias_attr)

    def forward(self, query, key, value, attn_mask=None):
        """Input shape: Time x Batch x Channel (self-attention: key and value are the query)."""
        tgt_len, bsz, embed_dim = query.shape
        q = self.q_proj(query)
        k = self.k_proj(query)
        v = self.v_proj(query)
        q *= self.scaling

        q = q.reshape([tgt_len, bsz * self.num_heads, self.head_dim]).transpose([1, 0, 2])
        k = k.reshape([-1, bsz * self.num_heads, self.head_dim]).transpose([1, 0, 2])
        v = v.reshape([-1, bsz * self.num_heads, self.head_dim]).transpose([1, 0, 2])

        attn_weights = paddle.bmm(q, k.transpose([0, 2, 1]))
        if attn_mask is not None:
            attn_mask = attn_mask.unsqueeze(0)
            attn_weights += attn_mask

        attn_weights_float = F.softmax(attn_weights, axis=-1, dtype="float32")
        attn_weights = attn_weights_float.astype(attn_weights.dtype)
        attn_probs = self.dropout_module(attn_weights)
        attn = paddle.bmm(attn_probs, v)
        attn = attn.transpose([1, 0, 2]).reshape([tgt_len, bsz, embed_dim])
        attn = self.out_proj(attn)
        return attn, None


def _ffn(x, fc1, activation_fn, activation_dropout_module, fc2, dropout_module):
    x_shape = x.shape
    x = x.reshape([-1, x.shape[-1]])
    x = fc1(x)
    x = activation_fn(x)
    x = activation_dropout_module(x)
    x = fc2(x)
    x = x.reshape(x_shape)
    x = dropout_module(x)
    return x


class FeedForwardNetwork(nn.Layer):
    """Feed Forward Network layer in the Transformer model"""

    def __init__(self, embed_dim, ffn_dim, dropout=0.0):
        super().__init__()
        self.embed_dim = embed_dim
        self.activation_fn = F.relu
        self.activation_dropout_module = nn.Dropout(0.0)
        self.fc1 = nn.Linear(self.embed_dim, ffn_dim)
        self.fc2 = nn.Linear(ffn_dim, self.embed_dim)
        self.dropout_module = nn.Dropout(dropout)

    def forward(self, x):
        return _ffn(x, self.fc1, self.activation_fn, self.activation_dropout_module, self.fc2, self.dropout_module)


def make_experts(embed_dim, expert_ffn_dim, num_experts, dropout):
    return nn.LayerList([FeedForwardNetwork(embed_dim, expert_ffn_dim, dropout) for _ in range(num_experts)])


class TransformerDecoderLayer(nn.Layer):
    """Decoder layer block (no encoder attention: a language model), pre-norm."""

    def __init__(self, embed_dim, ffn_dim, heads, is_moe_layer, dropout=0.1, normalize_before=True):
        super().__init__()
        self.embed_dim = embed_dim
        self.dropout_module = nn.Dropout(dropout)
        self.self_attn = MultiheadAttention(embed_dim, heads, dropout=dropout)
        self.activation_fn = F.relu
        self.activation_dropout_module = nn.Dropout(0.0)
        self.normalize_before = normalize_before
        self.self_attn_layer_norm = nn.LayerNorm(self.embed_dim)
        self.is_moe_layer = is_moe_layer
        if not self.is_moe_layer:
            self.fc1 = nn.Linear(self.embed_dim, ffn_dim)
            self.fc2 = nn.Linear(ffn_dim, self.embed_dim)
        else:
            gate = Top2Gate(self.embed_dim, EXPERTS)
            experts = make_experts(self.embed_dim, ffn_dim, EXPERTS, dropout)
            self.moe_layer = MOELayer(gate, experts)
        self.final_layer_norm = nn.LayerNorm(self.embed_dim)

    def residual_connection(self, x, residual):
        return residual + x

    def forward(self, x, self_attn_mask=None):
        residual = x
        if self.normalize_before:
            x = self.self_attn_layer_norm(x)
        x, attn = self.self_attn(query=x, key=x, value=x, attn_mask=self_attn_mask)
        x = self.dropout_module(x)
        x = self.residual_connection(x, residual)
        if not self.normalize_before:
            x = self.self_attn_layer_norm(x)

        residual = x
        if self.normalize_before:
            x = self.final_layer_norm(x)
        if not self.is_moe_layer:
            x = _ffn(x, self.fc1, self.activation_fn, self.activation_dropout_module, self.fc2, self.dropout_module)
            l_aux = None
        else:
            # x - seq_len, batch_size, model_dim
            x = x.transpose([1, 0, 2])  # batch_size, seq_len, model_dim
            x = self.moe_layer(x)
            l_aux = self.moe_layer.l_aux
            x = x.transpose([1, 0, 2])  # seq_len, batch_size, model_dim
        x = self.residual_connection(x, residual)
        if not self.normalize_before:
            x = self.final_layer_norm(x)
        return x, attn, l_aux


# -- fairseq/modules/sinusoidal_positional_embedding.py, models/transformer/transformer_decoder.py ---


def sinusoidal_embedding(num_embeddings, embedding_dim):
    """fairseq's ``SinusoidalPositionalEmbedding.get_embedding`` (no padding row)."""
    half_dim = embedding_dim // 2
    emb = math.log(10000) / (half_dim - 1)
    emb = paddle.exp(paddle.arange(half_dim, dtype="float32") * -emb)
    emb = paddle.arange(num_embeddings, dtype="float32").unsqueeze(1) * emb.unsqueeze(0)
    return paddle.concat([paddle.sin(emb), paddle.cos(emb)], axis=1).reshape([num_embeddings, -1])


def fill_with_neg_inf(t):
    """FP16-compatible function that fills a tensor with -inf."""
    return paddle.full_like(t, float("-inf"))


class TransformerDecoder(nn.Layer):
    def __init__(self):
        super().__init__()
        self.dropout_module = nn.Dropout(0.1)
        self.embed_dim = EMBED
        self.embed_scale = math.sqrt(EMBED)
        self.embed_tokens = nn.Embedding(VOCAB, EMBED)
        self.layers = nn.LayerList(
            [
                TransformerDecoderLayer(EMBED, FFN, HEADS, is_moe_layer=MOE_FREQ != 0 and (i + 1) % MOE_FREQ == 0)
                for i in range(LAYERS)
            ]
        )
        self.layer_norm = nn.LayerNorm(EMBED)  # decoder_normalize_before: a final norm

    def buffered_future_mask(self, tensor):
        dim = tensor.shape[0]
        return paddle.triu(fill_with_neg_inf(paddle.zeros([dim, dim])), 1)

    def forward(self, prev_output_tokens):
        positions = sinusoidal_embedding(prev_output_tokens.shape[1], self.embed_dim)
        x = self.embed_scale * self.embed_tokens(prev_output_tokens)
        x += positions.unsqueeze(0)
        x = self.dropout_module(x)
        # B x T x C -> T x B x C
        x = x.transpose([1, 0, 2])
        l_aux = []
        for layer in self.layers:
            self_attn_mask = self.buffered_future_mask(x)
            x, layer_attn, l_aux_i = layer(x, self_attn_mask=self_attn_mask)
            l_aux.append(l_aux_i)
        x = self.layer_norm(x)
        # T x B x C -> B x T x C
        x = x.transpose([1, 0, 2])
        # share_decoder_input_output_embed: logits from the token embedding
        return paddle.matmul(x, self.embed_tokens.weight, transpose_y=True), {"l_aux": l_aux}


class TransformerLanguageModel(nn.Layer):
    def __init__(self):
        super().__init__()
        self.decoder = TransformerDecoder()

    def forward(self, src_tokens):
        logits, _ = self.decoder(src_tokens)
        return logits


def build_model():
    return TransformerLanguageModel()


def input_spec():
    return [paddle.static.InputSpec([4, 8], "int64", "src_tokens")]


def loss(model, tokens, labels):
    """Token cross-entropy plus 0.01 x the MoE layers' mean gate loss (fairseq's moe_cross_entropy)."""
    logits, extra = model.decoder(tokens)
    gate_losses = [l_aux for l_aux in extra["l_aux"] if l_aux is not None]
    gate_loss = paddle.add_n(gate_losses) / len(gate_losses)
    return F.cross_entropy(logits.reshape([-1, VOCAB]), labels.reshape([-1])) + GATE_LOSS_WEIGHT * gate_loss
