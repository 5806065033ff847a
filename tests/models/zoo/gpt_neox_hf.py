"""GPT-NeoX (Pythia) as HF transformers' ``modeling_gpt_neox.py`` (v4.35) writes it: one fused
``query_key_value`` projection laid out per head as ``[heads, 3 * head_size]`` (q, k, v
interleaved head by head, not q|k|v blocks), partial rotary embeddings (``rotary_pct``: only the
first quarter of each head's dims rotate) from ``cos_cached``/``sin_cached`` buffers indexed by
``position_ids``, scores by ``baddbmm`` over merged ``[batch * heads, seq, head_size]`` tensors, a
causal mask applied with ``where`` from a boolean ``bias`` buffer, the parallel residual
(``use_parallel_residual``: attention and MLP read the same input, each under its own
LayerNorm), ``dense_h_to_4h``/``dense_4h_to_h``, and an untied ``embed_out`` head.

Ported to Paddle as a Paddle user would: ``reshape`` where HF writes ``view`` (Paddle's
``Tensor.view`` does not trace), ``transpose`` for ``permute``.

    >>> model = build_model()
    >>> list(model(paddle.randint(0, VOCAB, [2, 8])).shape)
    [2, 8, 64]
"""

import paddle
import paddle.nn as nn
import paddle.nn.functional as F

VOCAB, HIDDEN, LAYERS, HEADS, MAX_POSITIONS = 64, 32, 2, 4, 32
ROTARY_PCT, ROTARY_BASE = 0.25, 10000


class GPTNeoXRotaryEmbedding(nn.Layer):
    def __init__(self, dim, max_position_embeddings, base=10000):
        super().__init__()
        inv_freq = 1.0 / (base ** (paddle.arange(0, dim, 2, dtype="float32") / dim))
        self.register_buffer("inv_freq", inv_freq, persistable=False)
        self._set_cos_sin_cache(seq_len=max_position_embeddings)

    def _set_cos_sin_cache(self, seq_len):
        self.max_seq_len_cached = seq_len
        t = paddle.arange(seq_len, dtype=self.inv_freq.dtype)
        freqs = paddle.outer(t, self.inv_freq)
        emb = paddle.concat((freqs, freqs), axis=-1)
        self.register_buffer("cos_cached", emb.cos(), persistable=False)
        self.register_buffer("sin_cached", emb.sin(), persistable=False)

    def forward(self, x, seq_len):
        return self.cos_cached[:seq_len], self.sin_cached[:seq_len]


def rotate_half(x):
    """Rotates half the hidden dims of the input."""
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return paddle.concat((-x2, x1), axis=-1)


def apply_rotary_pos_emb(q, k, cos, sin, position_ids):
    cos = cos[position_ids].unsqueeze(1)  # [bs, 1, seq_len, dim]
    sin = sin[position_ids].unsqueeze(1)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed


class GPTNeoXAttention(nn.Layer):
    def __init__(self):
        super().__init__()
        self.num_attention_heads = HEADS
        self.hidden_size = HIDDEN
        self.head_size = self.hidden_size // self.num_attention_heads
        self.rotary_ndims = int(self.head_size * ROTARY_PCT)
        self.register_buffer(
            "bias",
            paddle.tril(paddle.ones((MAX_POSITIONS, MAX_POSITIONS), dtype="bool")).reshape(
                [1, 1, MAX_POSITIONS, MAX_POSITIONS]
            ),
            persistable=False,
        )
        self.rotary_emb = GPTNeoXRotaryEmbedding(self.rotary_ndims, MAX_POSITIONS, base=ROTARY_BASE)
        self.norm_factor = self.head_size**-0.5
        self.query_key_value = nn.Linear(HIDDEN, 3 * HIDDEN)
        self.dense = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, hidden_states, position_ids):
        # Compute QKV
        # Attention heads [batch, seq_len, hidden_size]
        #   --> [batch, seq_len, (np * 3 * head_size)]
        qkv = self.query_key_value(hidden_states)

        # [batch, seq_len, (num_heads * 3 * head_size)]
        #   --> [batch, seq_len, num_heads, 3 * head_size]
        new_qkv_shape = qkv.shape[:-1] + [self.num_attention_heads, 3 * self.head_size]
        qkv = qkv.reshape(new_qkv_shape)

        # [batch, seq_len, num_attention_heads, 3 * head_size] --> 3 [batch, num_attention_heads, seq_len, head_size]
        query = qkv[..., : self.head_size].transpose([0, 2, 1, 3])
        key = qkv[..., self.head_size : 2 * self.head_size].transpose([0, 2, 1, 3])
        value = qkv[..., 2 * self.head_size :].transpose([0, 2, 1, 3])

        # Compute rotary embeddings on rotary_ndims
        query_rot = query[..., : self.rotary_ndims]
        query_pass = query[..., self.rotary_ndims :]
        key_rot = key[..., : self.rotary_ndims]
        key_pass = key[..., self.rotary_ndims :]

        seq_len = key.shape[-2]
        cos, sin = self.rotary_emb(value, seq_len=seq_len)
        query, key = apply_rotary_pos_emb(query_rot, key_rot, cos, sin, position_ids)
        query = paddle.concat((query, query_pass), axis=-1)
        key = paddle.concat((key, key_pass), axis=-1)

        # Compute attention
        attn_output, attn_weights = self._attn(query, key, value)

        # Reshape outputs
        attn_output = self._merge_heads(attn_output, self.num_attention_heads, self.head_size)
        attn_output = self.dense(attn_output)
        return attn_output, attn_weights

    @classmethod
    def _merge_heads(cls, tensor, num_attention_heads, attn_head_size):
        """Merges attn_head_size dim and num_attn_heads dim into hidden dim"""
        # tensor [bs, num_attention_heads, seq_len, attn_head_size]
        tensor = tensor.transpose([0, 2, 1, 3])
        # -> [bs, seq_len, num_attention_heads, attn_head_size]
        tensor = tensor.reshape([tensor.shape[0], tensor.shape[1], num_attention_heads * attn_head_size])
        # -> [bs, seq_len, hidden_size]
        return tensor

    def _attn(self, query, key, value):
        # q, k, v: [bs, num_attention_heads, seq_len, attn_head_size]
        # compute causal mask from causal mask buffer
        batch_size, num_attention_heads, query_length, attn_head_size = query.shape
        key_length = key.shape[-2]

        causal_mask = self.bias[:, :, key_length - query_length : key_length, :key_length]

        query = query.reshape([batch_size * num_attention_heads, query_length, attn_head_size])
        key = key.reshape([batch_size * num_attention_heads, key_length, attn_head_size])
        attn_scores = paddle.zeros([batch_size * num_attention_heads, query_length, key_length], dtype=query.dtype)
        attn_scores = paddle.baddbmm(attn_scores, query, key.transpose([0, 2, 1]), beta=1.0, alpha=self.norm_factor)
        attn_scores = attn_scores.reshape([batch_size, num_attention_heads, query_length, key_length])

        mask_value = paddle.finfo(attn_scores.dtype).min
        mask_value = paddle.full([], mask_value, dtype=attn_scores.dtype)
        attn_scores = paddle.where(causal_mask, attn_scores, mask_value)

        attn_weights = F.softmax(attn_scores, axis=-1)
        attn_output = paddle.matmul(attn_weights, value)
        return attn_output, attn_weights


class GPTNeoXMLP(nn.Layer):
    def __init__(self):
        super().__init__()
        self.dense_h_to_4h = nn.Linear(HIDDEN, 4 * HIDDEN)
        self.dense_4h_to_h = nn.Linear(4 * HIDDEN, HIDDEN)
        self.act = nn.GELU()

    def forward(self, hidden_states):
        hidden_states = self.dense_h_to_4h(hidden_states)
        hidden_states = self.act(hidden_states)
        hidden_states = self.dense_4h_to_h(hidden_states)
        return hidden_states


class GPTNeoXLayer(nn.Layer):
    def __init__(self):
        super().__init__()
        self.use_parallel_residual = True
        self.input_layernorm = nn.LayerNorm(HIDDEN, epsilon=1e-5)
        self.post_attention_layernorm = nn.LayerNorm(HIDDEN, epsilon=1e-5)
        self.post_attention_dropout = nn.Dropout(0.0)
        self.post_mlp_dropout = nn.Dropout(0.0)
        self.attention = GPTNeoXAttention()
        self.mlp = GPTNeoXMLP()

    def forward(self, hidden_states, position_ids):
        attention_layer_outputs = self.attention(self.input_layernorm(hidden_states), position_ids)
        attn_output = attention_layer_outputs[0]  # output_attn: attn_output, present, (attn_weights)
        attn_output = self.post_attention_dropout(attn_output)

        if self.use_parallel_residual:
            # pseudocode:
            # x = x + attn(ln1(x)) + mlp(ln2(x))
            mlp_output = self.mlp(self.post_attention_layernorm(hidden_states))
            mlp_output = self.post_mlp_dropout(mlp_output)
            hidden_states = mlp_output + attn_output + hidden_states
        else:
            # pseudocode:
            # x = x + attn(ln1(x))
            # x = x + mlp(ln2(x))
            attn_output = attn_output + hidden_states
            mlp_output = self.mlp(self.post_attention_layernorm(attn_output))
            mlp_output = self.post_mlp_dropout(mlp_output)
            hidden_states = mlp_output + attn_output
        return hidden_states


class GPTNeoXModel(nn.Layer):
    def __init__(self):
        super().__init__()
        self.embed_in = nn.Embedding(VOCAB, HIDDEN)
        self.emb_dropout = nn.Dropout(0.0)
        self.layers = nn.LayerList([GPTNeoXLayer() for _ in range(LAYERS)])
        self.final_layer_norm = nn.LayerNorm(HIDDEN, epsilon=1e-5)

    def forward(self, input_ids):
        seq_length = input_ids.shape[1]
        position_ids = paddle.arange(0, seq_length, dtype="int64").unsqueeze(0)
        hidden_states = self.emb_dropout(self.embed_in(input_ids))
        for layer in self.layers:
            hidden_states = layer(hidden_states, position_ids)
        return self.final_layer_norm(hidden_states)


class GPTNeoXForCausalLM(nn.Layer):
    def __init__(self):
        super().__init__()
        self.gpt_neox = GPTNeoXModel()
        self.embed_out = nn.Linear(HIDDEN, VOCAB, bias_attr=False)

    def forward(self, input_ids):
        return self.embed_out(self.gpt_neox(input_ids))


def build_model():
    return GPTNeoXForCausalLM()


def input_spec():
    return [paddle.static.InputSpec([2, 8], "int64", "input_ids")]


def loss(model, tokens, labels):
    return F.cross_entropy(model(tokens).reshape([-1, VOCAB]), labels.reshape([-1]))
