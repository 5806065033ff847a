"""ChatGLM3 as THUDM writes it (``modeling_chatglm.py``, the remote code of THUDM/chatglm3-6b on
the HuggingFace hub), ported to Paddle at a small config.

Sequence first: activations are ``[seq, batch, hidden]`` from the embedding on. Attention
(``SelfAttention``): one fused ``query_key_value`` of q for every head, then k and v for the
``multi_query_group_num`` KV groups, cut by ``split``; rotary embedding on the first half of each
head's features from a ``[seq, 1, rot / 2, 2]`` cache the model computes once and passes in
(``apply_rotary_pos_emb``); K and V expanded to the heads; the scores, mask and context in a
child layer, ``CoreAttention``, which holds its own sizes (``hidden_size_per_partition``, named
for Megatron's tensor parallelism, the whole model's here) and, with
``apply_query_key_layer_scaling``, scales by its layer number (``coeff``). The core is the
eager branch the code runs before torch 2 (``baddbmm`` into a preallocated buffer, the causal
mask made by ``tril_`` when none is given, ``masked_fill`` with ``-inf``). MLP:
``dense_h_to_4h`` fused gate|up cut by ``chunk`` (``swiglu``), ``dense_4h_to_h``. RMSNorm before
each sub-layer, the output layer untied.

What differs from the torch code is spelling: ``reshape`` for ``view``, ``transpose`` with the
whole permutation, ``axis`` for ``dim``, ``paddle.tril`` for the in-place ``tril_``; the KV
cache, prefix tuning and the SDPA branch are left out (the model is called without a cache,
``use_cache`` False, as in training).

    >>> model = build_model()
    >>> list(model(paddle.randint(0, VOCAB, [2, SEQ])).shape)
    [2, 16, 256]
"""

import math

import paddle
import paddle.nn as nn
import paddle.nn.functional as F

VOCAB, HIDDEN, FFN, LAYERS, HEADS, GROUPS, SEQ = 256, 32, 64, 2, 4, 2, 16


class ChatGLMConfig:
    padded_vocab_size = VOCAB
    num_layers = LAYERS
    hidden_size = HIDDEN
    ffn_hidden_size = FFN
    kv_channels = HIDDEN // HEADS
    num_attention_heads = HEADS
    seq_length = 64
    hidden_dropout = 0.0
    attention_dropout = 0.0
    layernorm_epsilon = 1e-5
    rmsnorm = True
    apply_residual_connection_post_layernorm = False
    post_layer_norm = True
    add_bias_linear = False
    add_qkv_bias = True
    bias_dropout_fusion = True
    multi_query_attention = True
    multi_query_group_num = GROUPS
    apply_query_key_layer_scaling = True
    attention_softmax_in_fp32 = True
    fp32_residual_connection = False
    original_rope = True
    use_cache = False


class RotaryEmbedding(nn.Layer):
    def __init__(self, dim, original_impl=False):
        super().__init__()
        inv_freq = 1.0 / (10000 ** (paddle.arange(0, dim, 2).astype("float32") / dim))
        self.register_buffer("inv_freq", inv_freq)
        self.dim = dim
        self.original_impl = original_impl

    def forward_impl(self, seq_len, n_elem, dtype, base=10000):
        """Enhanced Transformer with Rotary Position Embedding.

        Derived from: https://github.com/labmlai/annotated_deep_learning_paper_implementations/blob/master/labml_nn/
        transformers/rope/__init__.py. MIT License:
        https://github.com/labmlai/annotated_deep_learning_paper_implementations/blob/master/license.
        """
        # $\Theta = {\theta_i = 10000^{\frac{2(i-1)}{d}}, i \in [1, 2, ..., \frac{d}{2}]}$
        theta = 1.0 / (base ** (paddle.arange(0, n_elem, 2, dtype="float32") / n_elem))

        # Create position indexes `[0, 1, ..., seq_len - 1]`
        seq_idx = paddle.arange(seq_len, dtype="float32")

        # Calculate the product of position index and $\theta_i$
        idx_theta = paddle.outer(seq_idx, theta).astype("float32")

        cache = paddle.stack([paddle.cos(idx_theta), paddle.sin(idx_theta)], axis=-1)
        return cache.astype(dtype)

    def forward(self, max_seq_len, offset=0):
        return self.forward_impl(max_seq_len, self.dim, dtype=self.inv_freq.dtype)


def apply_rotary_pos_emb(x, rope_cache):
    # x: [sq, b, np, hn]
    sq, np_ = x.shape[0], x.shape[2]  # (the code unpacks b and hn too, and reads neither)
    rot_dim = rope_cache.shape[-2] * 2
    x, x_pass = x[..., :rot_dim], x[..., rot_dim:]
    # truncate to support variable sizes
    rope_cache = rope_cache[:sq]
    xshaped = x.reshape([sq, -1, np_, rot_dim // 2, 2])
    rope_cache = rope_cache.reshape([sq, -1, 1, xshaped.shape[3], 2])
    x_out2 = paddle.stack(
        [
            xshaped[..., 0] * rope_cache[..., 0] - xshaped[..., 1] * rope_cache[..., 1],
            xshaped[..., 1] * rope_cache[..., 0] + xshaped[..., 0] * rope_cache[..., 1],
        ],
        -1,
    )
    x_out2 = x_out2.flatten(3)
    return paddle.concat((x_out2, x_pass), axis=-1)


class RMSNorm(nn.Layer):
    def __init__(self, normalized_shape, eps=1e-5):
        super().__init__()
        self.weight = self.create_parameter([normalized_shape], default_initializer=nn.initializer.Constant(1.0))
        self.eps = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        variance = hidden_states.astype("float32").pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * paddle.rsqrt(variance + self.eps)
        return (self.weight * hidden_states).astype(input_dtype)


class CoreAttention(nn.Layer):
    def __init__(self, config, layer_number):
        super().__init__()

        self.apply_query_key_layer_scaling = config.apply_query_key_layer_scaling
        self.attention_softmax_in_fp32 = config.attention_softmax_in_fp32
        if self.apply_query_key_layer_scaling:
            self.attention_softmax_in_fp32 = True
        self.layer_number = max(1, layer_number)

        projection_size = config.kv_channels * config.num_attention_heads

        # Per attention head and per partition values.
        self.hidden_size_per_partition = projection_size
        self.hidden_size_per_attention_head = projection_size // config.num_attention_heads
        self.num_attention_heads_per_partition = config.num_attention_heads

        coeff = None
        self.norm_factor = math.sqrt(self.hidden_size_per_attention_head)
        if self.apply_query_key_layer_scaling:
            coeff = self.layer_number
            self.norm_factor *= coeff
        self.coeff = coeff

        self.attention_dropout = nn.Dropout(config.attention_dropout)

    def forward(self, query_layer, key_layer, value_layer, attention_mask):
        # Raw attention scores

        # [b, np, sq, sk]
        output_size = (query_layer.shape[1], query_layer.shape[2], query_layer.shape[0], key_layer.shape[0])

        # [sq, b, np, hn] -> [sq, b * np, hn]
        query_layer = query_layer.reshape([output_size[2], output_size[0] * output_size[1], -1])
        # [sk, b, np, hn] -> [sk, b * np, hn]
        key_layer = key_layer.reshape([output_size[3], output_size[0] * output_size[1], -1])

        # preallocting input tensor: [b * np, sq, sk]
        matmul_input_buffer = paddle.empty(
            [output_size[0] * output_size[1], output_size[2], output_size[3]], dtype=query_layer.dtype
        )

        # Raw attention scores. [b * np, sq, sk]
        matmul_result = paddle.baddbmm(
            matmul_input_buffer,
            query_layer.transpose([1, 0, 2]),  # [b * np, sq, hn]
            key_layer.transpose([1, 0, 2]).transpose([0, 2, 1]),  # [b * np, hn, sk]
            beta=0.0,
            alpha=(1.0 / self.norm_factor),
        )

        # change view to [b, np, sq, sk]
        attention_scores = matmul_result.reshape(list(output_size))

        # ===========================
        # Attention probs and dropout
        # ===========================

        # attention scores and attention mask [b, np, sq, sk]
        if self.attention_softmax_in_fp32:
            attention_scores = attention_scores.astype("float32")
        if self.coeff is not None:
            attention_scores = attention_scores * self.coeff
        if attention_mask is None and attention_scores.shape[2] == attention_scores.shape[3]:
            attention_mask = paddle.ones([output_size[0], 1, output_size[2], output_size[3]], dtype="bool")
            attention_mask = paddle.tril(attention_mask.astype("int32")).astype("bool")
            attention_mask = ~attention_mask
        if attention_mask is not None:
            attention_scores = paddle.masked_fill(attention_scores, attention_mask, float("-inf"))
        attention_probs = F.softmax(attention_scores, axis=-1)
        attention_probs = attention_probs.astype(value_layer.dtype)

        # This is actually dropping out entire tokens to attend to, which might
        # seem a bit unusual, but is taken from the original Transformer paper.
        attention_probs = self.attention_dropout(attention_probs)
        # =========================
        # Context layer. [sq, b, hp]
        # =========================

        # value_layer -> context layer.
        # [sk, b, np, hn] --> [b, np, sq, hn]

        # context layer shape: [b, np, sq, hn]
        output_size = (value_layer.shape[1], value_layer.shape[2], query_layer.shape[0], value_layer.shape[3])
        # change view [sk, b * np, hn]
        value_layer = value_layer.reshape([value_layer.shape[0], output_size[0] * output_size[1], -1])
        # change view [b * np, sq, sk]
        attention_probs = attention_probs.reshape([output_size[0] * output_size[1], output_size[2], -1])
        # matmul: [b * np, sq, hn]
        context_layer = paddle.bmm(attention_probs, value_layer.transpose([1, 0, 2]))
        # change view [b, np, sq, hn]
        context_layer = context_layer.reshape(list(output_size))
        # [b, np, sq, hn] --> [sq, b, np, hn]
        context_layer = context_layer.transpose([2, 0, 1, 3])
        # [sq, b, np, hn] --> [sq, b, hp]
        new_context_layer_shape = context_layer.shape[:-2] + [self.hidden_size_per_partition]
        context_layer = context_layer.reshape(new_context_layer_shape)

        return context_layer


class SelfAttention(nn.Layer):
    """Parallel self-attention layer abstract class.

    Self-attention layer takes input with size [s, b, h]
    and returns output of the same size.
    """

    def __init__(self, config, layer_number):
        super().__init__()
        self.layer_number = max(1, layer_number)

        self.projection_size = config.kv_channels * config.num_attention_heads

        # Per attention head and per partition values.
        self.hidden_size_per_attention_head = self.projection_size // config.num_attention_heads
        self.num_attention_heads_per_partition = config.num_attention_heads

        self.multi_query_attention = config.multi_query_attention
        self.qkv_hidden_size = 3 * self.projection_size
        if self.multi_query_attention:
            self.num_multi_query_groups_per_partition = config.multi_query_group_num
            self.qkv_hidden_size = (
                self.projection_size + 2 * self.hidden_size_per_attention_head * config.multi_query_group_num
            )
        self.query_key_value = nn.Linear(
            config.hidden_size,
            self.qkv_hidden_size,
            bias_attr=config.add_bias_linear or config.add_qkv_bias,
        )

        self.core_attention = CoreAttention(config, self.layer_number)

        # Output.
        self.dense = nn.Linear(self.projection_size, config.hidden_size, bias_attr=config.add_bias_linear)

    def forward(self, hidden_states, attention_mask, rotary_pos_emb, kv_cache=None, use_cache=True):
        # hidden_states: [sq, b, h]

        # =====================
        # Query, Key, and Value
        # =====================

        # Attention heads [sq, b, h] --> [sq, b, (np * 3 * hn)]
        mixed_x_layer = self.query_key_value(hidden_states)

        if self.multi_query_attention:
            (query_layer, key_layer, value_layer) = mixed_x_layer.split(
                [
                    self.num_attention_heads_per_partition * self.hidden_size_per_attention_head,
                    self.num_multi_query_groups_per_partition * self.hidden_size_per_attention_head,
                    self.num_multi_query_groups_per_partition * self.hidden_size_per_attention_head,
                ],
                axis=-1,
            )
            query_layer = query_layer.reshape(
                query_layer.shape[:-1] + [self.num_attention_heads_per_partition, self.hidden_size_per_attention_head]
            )
            key_layer = key_layer.reshape(
                key_layer.shape[:-1] + [self.num_multi_query_groups_per_partition, self.hidden_size_per_attention_head]
            )
            value_layer = value_layer.reshape(
                value_layer.shape[:-1]
                + [self.num_multi_query_groups_per_partition, self.hidden_size_per_attention_head]
            )
        else:
            new_tensor_shape = mixed_x_layer.shape[:-1] + [
                self.num_attention_heads_per_partition,
                3 * self.hidden_size_per_attention_head,
            ]
            mixed_x_layer = mixed_x_layer.reshape(new_tensor_shape)

            # [sq, b, np, 3 * hn] --> 3 [sq, b, np, hn]
            (query_layer, key_layer, value_layer) = mixed_x_layer.chunk(3, axis=-1)

        # apply relative positional encoding (rotary embedding)
        if rotary_pos_emb is not None:
            query_layer = apply_rotary_pos_emb(query_layer, rotary_pos_emb)
            key_layer = apply_rotary_pos_emb(key_layer, rotary_pos_emb)

        # adjust key and value for inference
        if kv_cache is not None:
            cache_k, cache_v = kv_cache
            key_layer = paddle.concat((cache_k, key_layer), axis=0)
            value_layer = paddle.concat((cache_v, value_layer), axis=0)
        if use_cache:
            kv_cache = (key_layer, value_layer)
        else:
            kv_cache = None

        if self.multi_query_attention:
            key_layer = key_layer.unsqueeze(-2)
            key_layer = key_layer.expand(
                [
                    -1,
                    -1,
                    -1,
                    self.num_attention_heads_per_partition // self.num_multi_query_groups_per_partition,
                    -1,
                ]
            )
            key_layer = key_layer.reshape(
                key_layer.shape[:2] + [self.num_attention_heads_per_partition, self.hidden_size_per_attention_head]
            )
            value_layer = value_layer.unsqueeze(-2)
            value_layer = value_layer.expand(
                [
                    -1,
                    -1,
                    -1,
                    self.num_attention_heads_per_partition // self.num_multi_query_groups_per_partition,
                    -1,
                ]
            )
            value_layer = value_layer.reshape(
                value_layer.shape[:2] + [self.num_attention_heads_per_partition, self.hidden_size_per_attention_head]
            )

        # ==================================
        # core attention computation
        # ==================================

        context_layer = self.core_attention(query_layer, key_layer, value_layer, attention_mask)

        # =================
        # Output. [sq, b, h]
        # =================

        output = self.dense(context_layer)

        return output, kv_cache


class MLP(nn.Layer):
    """MLP.

    MLP will take the input with h hidden state, project it to 4*h
    hidden dimension, perform nonlinear transformation, and project the
    state back into h hidden dimension.
    """

    def __init__(self, config):
        super().__init__()

        self.add_bias = config.add_bias_linear

        # Project to 4h. If using swiglu double the output width, see https://arxiv.org/pdf/2002.05202.pdf
        self.dense_h_to_4h = nn.Linear(config.hidden_size, config.ffn_hidden_size * 2, bias_attr=self.add_bias)

        def swiglu(x):
            x = paddle.chunk(x, 2, axis=-1)
            return F.silu(x[0]) * x[1]

        self.activation_func = swiglu

        # Project to h.
        self.dense_4h_to_h = nn.Linear(config.ffn_hidden_size, config.hidden_size, bias_attr=self.add_bias)

    def forward(self, hidden_states):
        # [s, b, 4hp]
        intermediate_parallel = self.dense_h_to_4h(hidden_states)
        intermediate_parallel = self.activation_func(intermediate_parallel)
        # [s, b, h]
        output = self.dense_4h_to_h(intermediate_parallel)
        return output


class GLMBlock(nn.Layer):
    """A single transformer layer.

    Transformer layer takes input with size [s, b, h] and returns an
    output of the same size.
    """

    def __init__(self, config, layer_number):
        super().__init__()
        self.layer_number = layer_number

        self.apply_residual_connection_post_layernorm = config.apply_residual_connection_post_layernorm

        self.fp32_residual_connection = config.fp32_residual_connection

        # Layernorm on the input data.
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.layernorm_epsilon)

        # Self attention.
        self.self_attention = SelfAttention(config, layer_number)
        self.hidden_dropout = config.hidden_dropout

        # Layernorm on the attention output
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.layernorm_epsilon)

        # MLP
        self.mlp = MLP(config)

    def forward(self, hidden_states, attention_mask, rotary_pos_emb, kv_cache=None, use_cache=True):
        # hidden_states: [s, b, h]

        # Layer norm at the beginning of the transformer layer.
        layernorm_output = self.input_layernorm(hidden_states)
        # Self attention.
        attention_output, kv_cache = self.self_attention(
            layernorm_output, attention_mask, rotary_pos_emb, kv_cache=kv_cache, use_cache=use_cache
        )

        # Residual connection.
        if self.apply_residual_connection_post_layernorm:
            residual = layernorm_output
        else:
            residual = hidden_states

        layernorm_input = F.dropout(attention_output, p=self.hidden_dropout, training=self.training)
        layernorm_input = residual + layernorm_input

        # Layer norm post the self attention.
        layernorm_output = self.post_attention_layernorm(layernorm_input)

        # MLP.
        mlp_output = self.mlp(layernorm_output)

        # Second residual connection.
        if self.apply_residual_connection_post_layernorm:
            residual = layernorm_output
        else:
            residual = layernorm_input

        output = F.dropout(mlp_output, p=self.hidden_dropout, training=self.training)
        output = residual + output

        return output, kv_cache


class GLMTransformer(nn.Layer):
    """Transformer class."""

    def __init__(self, config):
        super().__init__()

        self.fp32_residual_connection = config.fp32_residual_connection
        self.post_layer_norm = config.post_layer_norm

        # Number of layers.
        self.num_layers = config.num_layers

        # Transformer layers.
        self.layers = nn.LayerList([GLMBlock(config, i + 1) for i in range(self.num_layers)])

        if self.post_layer_norm:
            # Final layer norm before output.
            self.final_layernorm = RMSNorm(config.hidden_size, eps=config.layernorm_epsilon)

    def _get_layer(self, layer_number):
        return self.layers[layer_number]

    def forward(self, hidden_states, attention_mask, rotary_pos_emb, kv_caches=None, use_cache=True):
        if not kv_caches:
            kv_caches = [None for _ in range(self.num_layers)]
        for index in range(self.num_layers):
            layer = self._get_layer(index)
            hidden_states, kv_cache = layer(
                hidden_states, attention_mask, rotary_pos_emb, kv_cache=kv_caches[index], use_cache=use_cache
            )

        # Final layer norm.
        if self.post_layer_norm:
            hidden_states = self.final_layernorm(hidden_states)

        return hidden_states


class Embedding(nn.Layer):
    """Language model embeddings."""

    def __init__(self, config):
        super().__init__()
        self.hidden_size = config.hidden_size
        # Word embeddings (parallel).
        self.word_embeddings = nn.Embedding(config.padded_vocab_size, self.hidden_size)
        self.fp32_residual_connection = config.fp32_residual_connection

    def forward(self, input_ids):
        # Embeddings.
        words_embeddings = self.word_embeddings(input_ids)
        embeddings = words_embeddings
        # Data format change to avoid explicit tranposes : [b s h] --> [s b h].
        embeddings = embeddings.transpose([1, 0, 2])
        return embeddings


class ChatGLMModel(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.embedding = Embedding(config)
        self.num_layers = config.num_layers
        self.multi_query_group_num = config.multi_query_group_num
        self.kv_channels = config.kv_channels
        self.config = config

        # Rotary positional embeddings
        self.seq_length = config.seq_length
        rotary_dim = (
            config.hidden_size // config.num_attention_heads if config.kv_channels is None else config.kv_channels
        )

        self.rotary_pos_emb = RotaryEmbedding(rotary_dim // 2, original_impl=config.original_rope)
        self.encoder = GLMTransformer(config)
        self.output_layer = nn.Linear(config.hidden_size, config.padded_vocab_size, bias_attr=False)

    def forward(self, input_ids, position_ids=None, attention_mask=None, full_attention_mask=None):
        batch_size, seq_length = input_ids.shape

        inputs_embeds = self.embedding(input_ids)

        # Rotary positional embeddings
        rotary_pos_emb = self.rotary_pos_emb(self.seq_length)
        if position_ids is not None:
            rotary_pos_emb = rotary_pos_emb[position_ids]
        else:
            rotary_pos_emb = rotary_pos_emb[None, :seq_length]
        rotary_pos_emb = rotary_pos_emb.transpose([1, 0, 2, 3])

        # Run encoder.
        hidden_states = self.encoder(
            inputs_embeds, full_attention_mask, rotary_pos_emb=rotary_pos_emb, use_cache=self.config.use_cache
        )
        return hidden_states


class ChatGLMForConditionalGeneration(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.max_sequence_length = config.seq_length
        self.transformer = ChatGLMModel(config)
        self.config = config

    def forward(self, input_ids):
        hidden_states = self.transformer(input_ids=input_ids)
        lm_logits = self.transformer.output_layer(hidden_states)
        return lm_logits.transpose([1, 0, 2])


def build_model():
    return ChatGLMForConditionalGeneration(ChatGLMConfig())


def input_spec():
    return [paddle.static.InputSpec([2, SEQ], "int64", "input_ids")]


def loss(model, tokens, labels):
    return F.cross_entropy(model(tokens).reshape([-1, VOCAB]), labels.reshape([-1]))
