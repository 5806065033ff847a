"""Switch Transformers as HuggingFace transformers writes it (src/transformers/models/
switch_transformers/modeling_switch_transformers.py, commit 00dcc6d), ported to Paddle at a
small config: a T5 encoder-decoder (relative position buckets, RMS ``LayerNorm``, no attention
scaling) whose feed-forward is sparse every other layer (``sparse_step=2``: layer 1).

The sparse layer is ported line by line: ``SwitchTransformersTop1Router`` picks each token's
expert by ``argmax`` (top-1, no ``topk``), masks tokens past ``expert_capacity`` per sequence
by a cumulative sum, and scales by the top probability; ``SwitchTransformersSparseMLP`` keeps
its experts in a ``LayerDict`` (``experts.expert_0``, ...), takes ``argmax`` of the router mask
again for the returned expert index, lists the experts that got tokens with
``nonzero(...)[0].tolist()`` and runs each on its tokens by boolean-mask indexing. The loss is
HF's: cross-entropy plus the router z-loss and load-balancing loss (``output_router_logits``
is True by default in ``SwitchTransformersForConditionalGeneration``).

The attention, blocks and stacks are T5's, written as tests/models/zoo/t5.py condenses them.
``router_jitter_noise`` is 0 here (HF's default 0.01 multiplies the router input by uniform
noise in training), so a distributed run draws nothing a single device does not.

    >>> model = build_model()
    >>> loss, logits = model(paddle.randint(0, VOCAB, [2, 8]), labels=paddle.randint(0, VOCAB, [2, 8]))
    >>> list(logits.shape), list(loss.shape)
    ([2, 8, 64], [])
"""

import math

import paddle
import paddle.nn as nn
import paddle.nn.functional as F

VOCAB, D_MODEL, D_KV, D_FF, HEADS, LAYERS, BUCKETS, MAX_DISTANCE = 64, 32, 8, 64, 4, 2, 8, 16


class SwitchTransformersConfig:
    vocab_size = VOCAB
    d_model = D_MODEL
    d_ff = D_FF
    num_layers = LAYERS
    num_decoder_layers = LAYERS
    num_heads = HEADS
    num_experts = 4
    expert_capacity = 4
    encoder_sparse_step = 2
    decoder_sparse_step = 2
    router_bias = False
    router_jitter_noise = 0.0
    router_dtype = "float32"
    router_z_loss_coef = 0.001
    router_aux_loss_coef = 0.001
    dropout_rate = 0.1
    layer_norm_epsilon = 1e-6
    dense_act_fn = "relu"
    decoder_start_token_id = 0
    pad_token_id = 0
    tie_word_embeddings = True


ACT2FN = {"relu": F.relu}


def router_z_loss_func(router_logits):
    num_groups, tokens_per_group, _ = router_logits.shape
    log_z = paddle.logsumexp(router_logits, axis=-1)
    z_loss = log_z**2
    return paddle.sum(z_loss) / (num_groups * tokens_per_group)


def load_balancing_loss_func(router_probs, expert_indices):
    num_experts = router_probs.shape[-1]

    # cast the expert indices to int64, otherwise one-hot encoding will fail
    if expert_indices.dtype != paddle.int64:
        expert_indices = expert_indices.astype("int64")

    if len(expert_indices.shape) == 2:
        expert_indices = expert_indices.unsqueeze(2)

    expert_mask = F.one_hot(expert_indices, num_experts)

    # For a given token, determine if it was routed to a given expert.
    expert_mask = paddle.max(expert_mask, axis=-2)

    # cast to float32 otherwise mean will fail
    expert_mask = expert_mask.astype("float32")
    tokens_per_group_and_expert = paddle.mean(expert_mask, axis=-2)

    router_prob_per_group_and_expert = paddle.mean(router_probs, axis=-2)
    return paddle.mean(tokens_per_group_and_expert * router_prob_per_group_and_expert) * (num_experts**2)


class SwitchTransformersTop1Router(nn.Layer):
    """Router using tokens choose top-1 experts assignment."""

    def __init__(self, config):
        super().__init__()
        self.num_experts = config.num_experts
        self.expert_capacity = config.expert_capacity
        self.classifier = nn.Linear(config.d_model, self.num_experts, bias_attr=None if config.router_bias else False)
        self.jitter_noise = config.router_jitter_noise
        self.dtype = config.router_dtype

    def _compute_router_probabilities(self, hidden_states):
        # float32 is used to ensure stability. See the discussion of "selective precision" in
        # https://huggingface.co/papers/2101.03961.
        self.input_dtype = hidden_states.dtype
        hidden_states = hidden_states.astype(self.dtype)

        if self.training and self.jitter_noise > 0:
            # Multiply the token inputs by the uniform distribution - adding some noise
            hidden_states *= paddle.uniform(
                hidden_states.shape, min=1.0 - self.jitter_noise, max=1.0 + self.jitter_noise
            )

        # Shape: [num_groups, tokens_per_group, num_experts]
        router_logits = self.classifier(hidden_states)

        # Apply Softmax and cast back to the original `dtype`
        router_probabilities = F.softmax(router_logits, axis=-1, dtype=self.dtype).astype(self.input_dtype)
        return router_probabilities, router_logits

    def forward(self, hidden_states):
        router_probs, router_logits = self._compute_router_probabilities(hidden_states)

        expert_index = paddle.argmax(router_probs, axis=-1)
        expert_index = F.one_hot(expert_index, num_classes=self.num_experts)

        # Mask tokens outside expert capacity. Sum over each sequence
        token_priority = paddle.cumsum(expert_index, axis=-2)
        # mask if the token routed to to the expert will overflow
        expert_capacity_mask = token_priority <= self.expert_capacity
        expert_index = expert_index * expert_capacity_mask.astype(expert_index.dtype)

        router_probs = paddle.max(router_probs, axis=-1).unsqueeze(-1)
        return expert_index, router_probs, router_logits


class SwitchTransformersLayerNorm(nn.Layer):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = self.create_parameter([hidden_size], default_initializer=nn.initializer.Constant(1.0))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.astype("float32").pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * paddle.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states


class SwitchTransformersDenseActDense(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.wi = nn.Linear(config.d_model, config.d_ff, bias_attr=False)
        self.wo = nn.Linear(config.d_ff, config.d_model, bias_attr=False)
        self.dropout = nn.Dropout(config.dropout_rate)
        self.act = ACT2FN[config.dense_act_fn]

    def forward(self, hidden_states):
        hidden_states = self.wi(hidden_states)
        hidden_states = self.act(hidden_states)
        hidden_states = self.dropout(hidden_states)
        hidden_states = self.wo(hidden_states)
        return hidden_states


class SwitchTransformersSparseMLP(nn.Layer):
    """Implementation of the Switch Transformers Sparse MLP module."""

    def __init__(self, config, expert_class=SwitchTransformersDenseActDense):
        super().__init__()
        # Step 1: Get the correct router according to its class
        self.router = SwitchTransformersTop1Router(config)

        # Step 2: Get the experts
        self.experts = nn.LayerDict()
        for idx in range(config.num_experts):
            self.experts[f"expert_{idx}"] = expert_class(config)

    def forward(self, hidden_states):
        # Step 1: Get the router_mask from the router as well as the probabilities
        router_mask, router_probs, router_logits = self.router(hidden_states)
        expert_index = paddle.argmax(router_mask, axis=-1)

        # If a token gets dropped, we just set it to zero such that it does not get updated.
        next_states = paddle.zeros(hidden_states.shape, dtype=hidden_states.dtype)

        router_mask = router_mask.astype("bool")
        batch_size, seq_len, num_experts = router_mask.shape
        idx_mask = router_mask.reshape([batch_size * seq_len, num_experts]).astype("int64").sum(axis=0)
        idx_mask = paddle.nonzero(idx_mask, as_tuple=True)[
            0
        ].tolist()  # length: number of "activated" expert / value: index
        for idx in idx_mask:
            next_states[router_mask[:, :, idx]] = getattr(self.experts, f"expert_{idx}")(
                hidden_states[router_mask[:, :, idx]]
            )

        hidden_states = router_probs * next_states
        return hidden_states, (router_logits, expert_index)


class SwitchTransformersLayerFF(nn.Layer):
    def __init__(self, config, is_sparse=False):
        super().__init__()
        self.is_sparse = is_sparse

        # Check if it is a sparse layer, if not then it is a dense layer
        if not self.is_sparse:
            self.mlp = SwitchTransformersDenseActDense(config)
        else:
            self.mlp = SwitchTransformersSparseMLP(config)

        self.layer_norm = SwitchTransformersLayerNorm(config.d_model, eps=config.layer_norm_epsilon)
        self.dropout = nn.Dropout(config.dropout_rate)

    def forward(self, hidden_states, output_router_logits):
        forwarded_states = self.layer_norm(hidden_states)
        forwarded_states = self.mlp(forwarded_states)

        if isinstance(forwarded_states, tuple):
            forwarded_states, router_tuple = forwarded_states
        else:
            router_tuple = None

        output = hidden_states + self.dropout(forwarded_states)

        if output_router_logits and router_tuple is not None:
            output = (output, router_tuple)

        return output


class SwitchTransformersAttention(nn.Layer):
    def __init__(self, is_decoder, has_relative_attention_bias):
        super().__init__()
        self.is_decoder = is_decoder
        self.has_relative_attention_bias = has_relative_attention_bias
        self.q = nn.Linear(D_MODEL, HEADS * D_KV, bias_attr=False)
        self.k = nn.Linear(D_MODEL, HEADS * D_KV, bias_attr=False)
        self.v = nn.Linear(D_MODEL, HEADS * D_KV, bias_attr=False)
        self.o = nn.Linear(HEADS * D_KV, D_MODEL, bias_attr=False)
        if has_relative_attention_bias:
            self.relative_attention_bias = nn.Embedding(BUCKETS, HEADS)
        self.dropout = nn.Dropout(0.1)

    @staticmethod
    def _relative_position_bucket(relative_position, bidirectional, num_buckets, max_distance):
        relative_buckets = 0
        if bidirectional:
            num_buckets //= 2
            relative_buckets += (relative_position > 0).astype("int64") * num_buckets
            relative_position = paddle.abs(relative_position)
        else:
            relative_position = -paddle.minimum(relative_position, paddle.zeros_like(relative_position))
        max_exact = num_buckets // 2
        is_small = relative_position < max_exact
        large = max_exact + (
            paddle.log(relative_position.astype("float32") / max_exact)
            / math.log(max_distance / max_exact)
            * (num_buckets - max_exact)
        ).astype("int64")
        large = paddle.minimum(large, paddle.full_like(large, num_buckets - 1))
        return relative_buckets + paddle.where(is_small, relative_position, large)

    def compute_bias(self, query_length, key_length):
        context_position = paddle.arange(query_length, dtype="int64")[:, None]
        memory_position = paddle.arange(key_length, dtype="int64")[None, :]
        buckets = self._relative_position_bucket(
            memory_position - context_position, not self.is_decoder, BUCKETS, MAX_DISTANCE
        )
        return self.relative_attention_bias(buckets).transpose([2, 0, 1]).unsqueeze(0)  # 1, heads, q, k

    def forward(self, hidden_states, key_value_states=None, position_bias=None, mask=None):
        b, q_len = hidden_states.shape[:2]
        kv = hidden_states if key_value_states is None else key_value_states

        def shape(states):
            return states.reshape([b, -1, HEADS, D_KV]).transpose([0, 2, 1, 3])

        q, k, v = shape(self.q(hidden_states)), shape(self.k(kv)), shape(self.v(kv))
        scores = paddle.matmul(q, k, transpose_y=True)
        if position_bias is None:
            if self.has_relative_attention_bias:
                position_bias = self.compute_bias(q_len, k.shape[2])
            else:
                position_bias = paddle.zeros([1, HEADS, q_len, k.shape[2]], dtype=scores.dtype)
            if mask is not None:
                position_bias = position_bias + mask
        attn_weights = self.dropout(F.softmax(scores + position_bias, axis=-1))
        out = paddle.matmul(attn_weights, v).transpose([0, 2, 1, 3]).reshape([b, -1, HEADS * D_KV])
        return self.o(out), position_bias


class SwitchTransformersLayerSelfAttention(nn.Layer):
    def __init__(self, is_decoder, has_relative_attention_bias):
        super().__init__()
        self.SelfAttention = SwitchTransformersAttention(is_decoder, has_relative_attention_bias)
        self.layer_norm = SwitchTransformersLayerNorm(D_MODEL)
        self.dropout = nn.Dropout(0.1)

    def forward(self, hidden_states, position_bias=None, mask=None):
        out, position_bias = self.SelfAttention(self.layer_norm(hidden_states), position_bias=position_bias, mask=mask)
        return hidden_states + self.dropout(out), position_bias


class SwitchTransformersLayerCrossAttention(nn.Layer):
    def __init__(self):
        super().__init__()
        self.EncDecAttention = SwitchTransformersAttention(True, False)
        self.layer_norm = SwitchTransformersLayerNorm(D_MODEL)
        self.dropout = nn.Dropout(0.1)

    def forward(self, hidden_states, key_value_states):
        out, _ = self.EncDecAttention(self.layer_norm(hidden_states), key_value_states=key_value_states)
        return hidden_states + self.dropout(out)


class SwitchTransformersBlock(nn.Layer):
    def __init__(self, config, is_decoder, has_relative_attention_bias=False, is_sparse=False):
        super().__init__()
        self.is_decoder = is_decoder
        self.is_sparse = is_sparse
        self.layer = nn.LayerList([SwitchTransformersLayerSelfAttention(is_decoder, has_relative_attention_bias)])
        if self.is_decoder:
            self.layer.append(SwitchTransformersLayerCrossAttention())
        self.layer.append(SwitchTransformersLayerFF(config, is_sparse=self.is_sparse))

    def forward(
        self, hidden_states, position_bias=None, mask=None, encoder_hidden_states=None, output_router_logits=True
    ):
        hidden_states, position_bias = self.layer[0](hidden_states, position_bias=position_bias, mask=mask)
        if self.is_decoder:
            hidden_states = self.layer[1](hidden_states, encoder_hidden_states)

        # Apply Feed Forward layer
        hidden_states = self.layer[-1](hidden_states, output_router_logits)

        if isinstance(hidden_states, tuple):
            hidden_states, router_tuple = hidden_states
        else:
            router_tuple = (paddle.zeros((1,), dtype="int64"),)

        return hidden_states, position_bias, router_tuple


class SwitchTransformersStack(nn.Layer):
    def __init__(self, config, embed_tokens, is_decoder):
        super().__init__()
        self.embed_tokens = embed_tokens
        self.is_decoder = is_decoder

        sparse_step = config.decoder_sparse_step if self.is_decoder else config.encoder_sparse_step
        num_layers = config.num_decoder_layers if self.is_decoder else config.num_layers
        self.block = nn.LayerList()
        for i in range(num_layers):
            is_sparse = (i % sparse_step == 1 or sparse_step == 1) if sparse_step > 0 else False
            self.block.append(
                SwitchTransformersBlock(
                    config, is_decoder, has_relative_attention_bias=bool(i == 0), is_sparse=is_sparse
                )
            )

        self.final_layer_norm = SwitchTransformersLayerNorm(config.d_model, eps=config.layer_norm_epsilon)
        self.dropout = nn.Dropout(config.dropout_rate)

    def forward(self, input_ids, encoder_hidden_states=None, output_router_logits=True):
        hidden_states = self.dropout(self.embed_tokens(input_ids))
        mask = None
        if self.is_decoder:
            s = input_ids.shape[1]
            mask = paddle.triu(paddle.full([s, s], -1e9), diagonal=1)[None, None]
        position_bias = None
        all_router_probs = ()
        for layer_module in self.block:
            hidden_states, position_bias, router_probs = layer_module(
                hidden_states, position_bias, mask, encoder_hidden_states, output_router_logits
            )
            if output_router_logits:
                all_router_probs = all_router_probs + (router_probs,)
        return self.dropout(self.final_layer_norm(hidden_states)), all_router_probs


class SwitchTransformersForConditionalGeneration(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model_dim = config.d_model
        self.shared = nn.Embedding(config.vocab_size, config.d_model)
        self.encoder = SwitchTransformersStack(config, self.shared, is_decoder=False)
        self.decoder = SwitchTransformersStack(config, self.shared, is_decoder=True)
        self.router_z_loss_coef = config.router_z_loss_coef
        self.router_aux_loss_coef = config.router_aux_loss_coef

    def _shift_right(self, input_ids):
        shifted_input_ids = paddle.zeros_like(input_ids)
        shifted_input_ids[..., 1:] = input_ids[..., :-1].clone()
        shifted_input_ids[..., 0] = self.config.decoder_start_token_id
        return shifted_input_ids

    def _unpack_router_logits(self, router_outputs):
        total_router_logits = []
        total_expert_indexes = []
        for router_output in router_outputs:
            if len(router_output[0].shape) > 1:
                router_logits, expert_indexes = router_output
                total_router_logits.append(router_logits)
                total_expert_indexes.append(expert_indexes)
        return paddle.concat(total_router_logits, axis=1), paddle.concat(total_expert_indexes, axis=1)

    def forward(self, input_ids, decoder_input_ids=None, labels=None, output_router_logits=True):
        if labels is not None and decoder_input_ids is None:
            # get decoder inputs from shifting lm labels to the right
            decoder_input_ids = self._shift_right(labels)
        hidden_states, encoder_router_probs = self.encoder(input_ids, output_router_logits=output_router_logits)
        sequence_output, decoder_router_probs = self.decoder(
            decoder_input_ids, encoder_hidden_states=hidden_states, output_router_logits=output_router_logits
        )

        if self.config.tie_word_embeddings:
            # Rescale output before projecting on vocab
            sequence_output = sequence_output * (self.model_dim**-0.5)
        lm_logits = paddle.matmul(sequence_output, self.shared.weight, transpose_y=True)
        if labels is None:
            return lm_logits

        encoder_z_loss = encoder_aux_loss = decoder_z_loss = decoder_aux_loss = 0
        if output_router_logits:
            # Compute the router loss (z_loss + auxiliary loss) for each router in the encoder and decoder
            if self.config.encoder_sparse_step > 1:
                encoder_router_logits, encoder_expert_indexes = self._unpack_router_logits(encoder_router_probs)
                encoder_z_loss = router_z_loss_func(encoder_router_logits)
                encoder_router_probs = F.softmax(encoder_router_logits, axis=-1)
                encoder_aux_loss = load_balancing_loss_func(encoder_router_probs, encoder_expert_indexes)
            if self.config.decoder_sparse_step > 1:
                decoder_router_logits, decoder_expert_indexes = self._unpack_router_logits(decoder_router_probs)
                decoder_z_loss = router_z_loss_func(decoder_router_logits)
                decoder_router_probs = F.softmax(decoder_router_logits, axis=-1)
                decoder_aux_loss = load_balancing_loss_func(decoder_router_probs, decoder_expert_indexes)

        loss = F.cross_entropy(lm_logits.reshape([-1, lm_logits.shape[-1]]), labels.reshape([-1]), ignore_index=-100)
        if output_router_logits:
            z_loss = self.router_z_loss_coef * (encoder_z_loss + decoder_z_loss)
            aux_loss = self.router_aux_loss_coef * (encoder_aux_loss + decoder_aux_loss)
            loss = loss + z_loss + aux_loss
        return loss, lm_logits


def build_model():
    return SwitchTransformersForConditionalGeneration(SwitchTransformersConfig())


def input_spec():
    return [
        paddle.static.InputSpec([2, 8], "int64", "input_ids"),
        paddle.static.InputSpec([2, 8], "int64", "decoder_input_ids"),
    ]


def loss(model, tokens, labels):
    """HF's loss: ``model(input_ids, labels=labels)`` decodes the labels shifted right."""
    return model(tokens, labels=labels)[0]
