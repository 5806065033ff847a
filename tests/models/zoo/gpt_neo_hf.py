"""HF GPT-Neo (EleutherAI/gpt-neo), ported to Paddle as its modeling_gpt_neo.py writes it:
``GPTNeoSelfAttention`` with separate q/k/v projections without bias, ``_split_heads`` /
``_merge_heads`` helper methods, scores computed in float32 and **not** scaled by
``sqrt(head_dim)``, a registered boolean ``bias`` buffer (the causal band, narrowed to a window for
``attention_type == "local"`` layers), masked with ``paddle.where`` and the dtype's minimum;
layers alternating global and local attention (``attention_types``); learned position
embeddings, ``c_fc``/``c_proj`` GELU MLP, a final LayerNorm and an LM head tied to ``wte``.
Sizes: no two of batch 2, sequence 12, heads 4, head dim 10, hidden 40, inner 72, window 5,
vocabulary 96 coincide.

    >>> list(build_model()(paddle.randint(0, VOCAB, [2, SEQ])).shape)
    [2, 12, 96]
"""

from __future__ import annotations

import paddle
import paddle.nn as nn
import paddle.nn.functional as F

VOCAB, SEQ = 96, 12


class GPTNeoConfig:
    vocab_size = VOCAB
    max_position_embeddings = 64
    hidden_size = 40
    num_layers = 2
    num_heads = 4
    intermediate_size = 72
    window_size = 5
    attention_types = [[["global", "local"], 1]]
    layer_norm_epsilon = 1e-5

    @property
    def attention_layers(self):
        attentions = []
        for item in self.attention_types:
            for _ in range(item[1]):
                attentions.extend(item[0])
        return attentions


class GPTNeoSelfAttention(nn.Layer):
    def __init__(self, config, attention_type):
        super().__init__()
        max_positions = config.max_position_embeddings
        bias = paddle.tril(paddle.ones([max_positions, max_positions], dtype="int32")).astype("bool")
        # local causal self attention is a sliding window where each token can only attend to the
        # previous window_size tokens
        if attention_type == "local":
            bias = paddle.logical_xor(bias, paddle.tril(bias.astype("int32"), -config.window_size).astype("bool"))
        self.register_buffer("bias", bias.reshape([1, 1, max_positions, max_positions]), persistable=False)

        self.embed_dim = config.hidden_size
        self.num_heads = config.num_heads
        self.head_dim = self.embed_dim // self.num_heads
        if self.head_dim * self.num_heads != self.embed_dim:
            raise ValueError("embed_dim must be divisible by num_heads")

        self.k_proj = nn.Linear(self.embed_dim, self.embed_dim, bias_attr=False)
        self.v_proj = nn.Linear(self.embed_dim, self.embed_dim, bias_attr=False)
        self.q_proj = nn.Linear(self.embed_dim, self.embed_dim, bias_attr=False)
        self.out_proj = nn.Linear(self.embed_dim, self.embed_dim)

    def _split_heads(self, tensor, num_heads, attn_head_size):
        """Splits hidden_size dim into attn_head_size and num_heads"""
        new_shape = tensor.shape[:-1] + [num_heads, attn_head_size]
        tensor = tensor.reshape(new_shape)
        return tensor.transpose([0, 2, 1, 3])  # (batch, head, seq_length, head_features)

    def _merge_heads(self, tensor, num_heads, attn_head_size):
        """Merges attn_head_size dim and num_attn_heads dim into hidden_size"""
        tensor = tensor.transpose([0, 2, 1, 3])
        new_shape = tensor.shape[:-2] + [num_heads * attn_head_size]
        return tensor.reshape(new_shape)

    def _attn(self, query, key, value, attention_mask=None):
        # Keep the attention weights computation in fp32 to avoid overflow issues
        query = query.astype("float32")
        key = key.astype("float32")

        attn_weights = paddle.matmul(query, key, transpose_y=True)

        query_length, key_length = query.shape[-2], key.shape[-2]
        causal_mask = self.bias[:, :, key_length - query_length : key_length, :key_length]
        mask_value = paddle.finfo(attn_weights.dtype).min
        mask_value = paddle.full([], mask_value, dtype=attn_weights.dtype)
        attn_weights = paddle.where(causal_mask, attn_weights, mask_value)

        if attention_mask is not None:  # no matter the length, we just slice it
            attn_weights = attn_weights + attention_mask

        attn_weights = F.softmax(attn_weights, axis=-1)
        attn_weights = attn_weights.astype(value.dtype)
        attn_output = paddle.matmul(attn_weights, value)
        return attn_output, attn_weights

    def forward(self, hidden_states, attention_mask=None):
        query = self.q_proj(hidden_states)
        key = self.k_proj(hidden_states)
        value = self.v_proj(hidden_states)

        query = self._split_heads(query, self.num_heads, self.head_dim)
        key = self._split_heads(key, self.num_heads, self.head_dim)
        value = self._split_heads(value, self.num_heads, self.head_dim)

        attn_output, attn_weights = self._attn(query, key, value, attention_mask)

        attn_output = self._merge_heads(attn_output, self.num_heads, self.head_dim)
        attn_output = self.out_proj(attn_output)
        return attn_output, attn_weights


class GPTNeoAttention(nn.Layer):
    def __init__(self, config, layer_id=0):
        super().__init__()
        self.attention_layers = config.attention_layers
        self.attention_type = self.attention_layers[layer_id]
        self.attention = GPTNeoSelfAttention(config, self.attention_type)

    def forward(self, hidden_states, attention_mask=None):
        return self.attention(hidden_states, attention_mask=attention_mask)


class GPTNeoMLP(nn.Layer):
    def __init__(self, intermediate_size, config):  # in MLP: intermediate_size= 4 * hidden_size
        super().__init__()
        embed_dim = config.hidden_size
        self.c_fc = nn.Linear(embed_dim, intermediate_size)
        self.c_proj = nn.Linear(intermediate_size, embed_dim)

    def forward(self, hidden_states):
        hidden_states = self.c_fc(hidden_states)
        hidden_states = F.gelu(hidden_states, approximate=True)  # "gelu_new"
        return self.c_proj(hidden_states)


class GPTNeoBlock(nn.Layer):
    def __init__(self, config, layer_id):
        super().__init__()
        hidden_size = config.hidden_size
        inner_dim = config.intermediate_size if config.intermediate_size is not None else 4 * hidden_size
        self.ln_1 = nn.LayerNorm(hidden_size, epsilon=config.layer_norm_epsilon)
        self.attn = GPTNeoAttention(config, layer_id)
        self.ln_2 = nn.LayerNorm(hidden_size, epsilon=config.layer_norm_epsilon)
        self.mlp = GPTNeoMLP(inner_dim, config)

    def forward(self, hidden_states, attention_mask=None):
        residual = hidden_states
        hidden_states = self.ln_1(hidden_states)
        attn_output, _ = self.attn(hidden_states, attention_mask=attention_mask)
        # residual connection
        hidden_states = attn_output + residual

        residual = hidden_states
        hidden_states = self.ln_2(hidden_states)
        feed_forward_hidden_states = self.mlp(hidden_states)
        # residual connection
        return residual + feed_forward_hidden_states


class GPTNeoModel(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.embed_dim = config.hidden_size
        self.wte = nn.Embedding(config.vocab_size, self.embed_dim)
        self.wpe = nn.Embedding(config.max_position_embeddings, self.embed_dim)
        self.h = nn.LayerList([GPTNeoBlock(config, layer_id=i) for i in range(config.num_layers)])
        self.ln_f = nn.LayerNorm(self.embed_dim, epsilon=config.layer_norm_epsilon)

    def forward(self, input_ids):
        input_shape = input_ids.shape
        position_ids = paddle.arange(0, input_shape[-1], dtype="int64").unsqueeze(0)
        inputs_embeds = self.wte(input_ids)
        position_embeds = self.wpe(position_ids)
        hidden_states = inputs_embeds + position_embeds
        for block in self.h:
            hidden_states = block(hidden_states)
        return self.ln_f(hidden_states)


class GPTNeoForCausalLM(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.transformer = GPTNeoModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias_attr=False)
        self.lm_head.weight = self.transformer.wte.weight  # tied, [vocab, hidden] as Paddle's Embedding holds it

    def forward(self, input_ids):
        hidden_states = self.transformer(input_ids)
        return paddle.matmul(hidden_states, self.lm_head.weight, transpose_y=True)


def build_model():
    return GPTNeoForCausalLM(GPTNeoConfig())


def input_spec():
    return [paddle.static.InputSpec([2, SEQ], "int64", "input_ids")]


def loss(model, tokens, labels):
    return F.cross_entropy(model(tokens).reshape([-1, VOCAB]), labels.reshape([-1]))
