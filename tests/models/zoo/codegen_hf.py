"""CodeGen as HF's modeling_codegen writes it, ported to Paddle at a small config.

q|v|k fused in ``qkv_proj`` and cut TPU-style: reshaped into ``mp_num = 4`` blocks, each split into
query, value and key of ``num_heads // mp_num`` heads (``_split_heads``); rotary on the first
``rotary_dim`` features by ``rotate_every_two`` (interleaved pairs) with a sin|cos table gathered
at ``position_ids``; a boolean causal buffer applied by ``where``; GPT-J's parallel block (one
``ln_1`` feeding attention and MLP); ``fc_in`` -> gelu_new -> ``fc_out``; a biased LM head.

What differs from the torch code is spelling (``reshape`` for ``view``, ``transpose`` with the
whole permutation, ``axis`` for ``dim``, ``paddle.outer`` for the ``einsum`` of the sinusoid
table); the cache is left out. Planned blind at mp2 (``--input-spec input_ids:int64:4x16`` and
``6x12``): its attention a local view, each rank holding, of every one of the 4 groups, its heads'
query, value and key, and the rows of ``out_proj`` for those heads.

    >>> model = build_model()
    >>> list(model(paddle.randint(0, VOCAB, [2, SEQ])).shape)
    [2, 16, 256]
"""

import math

import paddle
import paddle.nn as nn
import paddle.nn.functional as F

VOCAB, HIDDEN, LAYERS, HEADS, ROTARY, SEQ = 256, 64, 2, 8, 4, 16


class CodeGenConfig:
    vocab_size = VOCAB
    n_positions = 64
    n_ctx = 64
    n_embd = HIDDEN
    n_layer = LAYERS
    n_head = HEADS
    rotary_dim = ROTARY
    n_inner = None
    activation_function = "gelu_new"
    resid_pdrop = 0.0
    embd_pdrop = 0.0
    attn_pdrop = 0.0
    layer_norm_epsilon = 1e-5
    max_position_embeddings = 64
    hidden_size = HIDDEN
    num_attention_heads = HEADS


def create_sinusoidal_positions(num_pos, dim):
    inv_freq = 1.0 / (10000 ** (paddle.arange(0, dim, 2, dtype="float32") / dim))
    sinusoid_inp = paddle.outer(paddle.arange(num_pos, dtype="float32"), inv_freq)
    return paddle.concat((paddle.sin(sinusoid_inp), paddle.cos(sinusoid_inp)), axis=1)


def rotate_every_two(x):
    x1 = x[:, :, :, ::2]
    x2 = x[:, :, :, 1::2]
    x = paddle.stack((-x2, x1), axis=-1)
    return x.flatten(-2)  # in einsum notation: rearrange(x, '... d j -> ... (d j)')


def apply_rotary_pos_emb(tensor, sin, cos):
    sin = paddle.repeat_interleave(sin[:, :, None, :], 2, 3)
    cos = paddle.repeat_interleave(cos[:, :, None, :], 2, 3)
    return (tensor * cos) + (rotate_every_two(tensor) * sin)


def gelu_new(x):
    return 0.5 * x * (1.0 + paddle.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * paddle.pow(x, 3.0))))


class CodeGenAttention(nn.Layer):
    def __init__(self, config, layer_idx=None):
        super().__init__()
        max_positions = config.max_position_embeddings
        self.register_buffer(
            "causal_mask",
            paddle.tril(paddle.ones((max_positions, max_positions), dtype="bool")).reshape(
                [1, 1, max_positions, max_positions]
            ),
            persistable=False,
        )
        self.attn_dropout = nn.Dropout(config.attn_pdrop)
        self.resid_dropout = nn.Dropout(config.resid_pdrop)
        self.layer_idx = layer_idx

        self.embed_dim = config.hidden_size
        self.num_attention_heads = config.num_attention_heads
        self.head_dim = self.embed_dim // self.num_attention_heads
        if self.head_dim * self.num_attention_heads != self.embed_dim:
            raise ValueError("embed_dim must be divisible by num_attention_heads")
        self.scale_attn = math.sqrt(self.head_dim)
        self.qkv_proj = nn.Linear(self.embed_dim, self.embed_dim * 3, bias_attr=False)

        self.out_proj = nn.Linear(self.embed_dim, self.embed_dim, bias_attr=False)
        self.rotary_dim = config.rotary_dim
        pos_embd_dim = self.rotary_dim or self.embed_dim
        self.embed_positions = create_sinusoidal_positions(max_positions, pos_embd_dim)

    def _split_heads(self, x, n_head, dim_head, mp_num):
        reshaped = x.reshape(x.shape[:-1] + [n_head // mp_num, dim_head])
        reshaped = reshaped.reshape(x.shape[:-2] + [-1] + reshaped.shape[-1:])
        return reshaped

    def _merge_heads(self, tensor, num_attention_heads, attn_head_size):
        """Merges attn_head_size dim and num_attn_heads dim into n_ctx"""
        if len(tensor.shape) == 5:
            tensor = tensor.transpose([0, 1, 3, 2, 4])
        elif len(tensor.shape) == 4:
            tensor = tensor.transpose([0, 2, 1, 3])
        else:
            raise ValueError(f"Input tensor rank should be one of [4, 5], but is: {len(tensor.shape)}")
        new_shape = tensor.shape[:-2] + [num_attention_heads * attn_head_size]
        return tensor.reshape(new_shape)

    def _attn(self, query, key, value, attention_mask=None):
        # compute causal mask from causal mask buffer
        query_length, key_length = query.shape[-2], key.shape[-2]
        causal_mask = self.causal_mask[:, :, key_length - query_length : key_length, :key_length]

        # Keep the attention weights computation in fp32 to avoid overflow issues
        query = query.astype("float32")
        key = key.astype("float32")

        attn_weights = paddle.matmul(query, key.transpose([0, 1, 3, 2]))

        attn_weights = attn_weights / self.scale_attn
        mask_value = paddle.finfo(attn_weights.dtype).min
        mask_value = paddle.full([], mask_value, dtype=attn_weights.dtype)
        attn_weights = paddle.where(causal_mask, attn_weights, mask_value)

        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask

        attn_weights = F.softmax(attn_weights, axis=-1)
        attn_weights = attn_weights.astype(value.dtype)
        attn_weights = self.attn_dropout(attn_weights)

        attn_output = paddle.matmul(attn_weights, value)
        return attn_output, attn_weights

    def forward(self, hidden_states, position_ids=None):
        qkv = self.qkv_proj(hidden_states)
        # TODO(enijkamp): factor out number of logical TPU-v4 cores or make forward pass agnostic
        mp_num = 4
        qkv_split = qkv.reshape(qkv.shape[:-1] + [mp_num, -1])

        local_dim = self.head_dim * self.num_attention_heads // mp_num
        query, value, key = paddle.split(qkv_split, [local_dim, local_dim, local_dim], axis=-1)

        query = self._split_heads(query, self.num_attention_heads, self.head_dim, mp_num=mp_num)
        key = self._split_heads(key, self.num_attention_heads, self.head_dim, mp_num=mp_num)

        value = self._split_heads(value, self.num_attention_heads, self.head_dim, mp_num=mp_num)
        value = value.transpose([0, 2, 1, 3])

        embed_positions = self.embed_positions
        sincos = embed_positions[position_ids]
        sin, cos = paddle.split(sincos, 2, axis=-1)

        if self.rotary_dim is not None:
            k_rot = key[:, :, :, : self.rotary_dim]
            k_pass = key[:, :, :, self.rotary_dim :]

            q_rot = query[:, :, :, : self.rotary_dim]
            q_pass = query[:, :, :, self.rotary_dim :]

            k_rot = apply_rotary_pos_emb(k_rot, sin, cos)
            q_rot = apply_rotary_pos_emb(q_rot, sin, cos)

            key = paddle.concat([k_rot, k_pass], axis=-1)
            query = paddle.concat([q_rot, q_pass], axis=-1)
        else:
            key = apply_rotary_pos_emb(key, sin, cos)
            query = apply_rotary_pos_emb(query, sin, cos)

        key = key.transpose([0, 2, 1, 3])
        query = query.transpose([0, 2, 1, 3])

        # compute self-attention: V x Softmax(QK^T)
        attn_output, attn_weights = self._attn(query, key, value)

        attn_output = self._merge_heads(attn_output, self.num_attention_heads, self.head_dim)
        attn_output = self.out_proj(attn_output)
        attn_output = self.resid_dropout(attn_output)
        return attn_output, attn_weights


class CodeGenMLP(nn.Layer):
    def __init__(self, intermediate_size, config):  # in MLP: intermediate_size= 4 * embed_dim
        super().__init__()
        embed_dim = config.n_embd
        self.fc_in = nn.Linear(embed_dim, intermediate_size)
        self.fc_out = nn.Linear(intermediate_size, embed_dim)
        self.act = gelu_new
        self.dropout = nn.Dropout(config.resid_pdrop)

    def forward(self, hidden_states):
        hidden_states = self.fc_in(hidden_states)
        hidden_states = self.act(hidden_states)
        hidden_states = self.fc_out(hidden_states)
        hidden_states = self.dropout(hidden_states)
        return hidden_states


class CodeGenBlock(nn.Layer):
    def __init__(self, config, layer_idx=None):
        super().__init__()
        inner_dim = config.n_inner if config.n_inner is not None else 4 * config.n_embd
        self.ln_1 = nn.LayerNorm(config.n_embd, epsilon=config.layer_norm_epsilon)
        self.attn = CodeGenAttention(config, layer_idx)
        self.mlp = CodeGenMLP(inner_dim, config)

    def forward(self, hidden_states, position_ids=None):
        residual = hidden_states
        hidden_states = self.ln_1(hidden_states)
        attn_outputs, _ = self.attn(hidden_states=hidden_states, position_ids=position_ids)
        feed_forward_hidden_states = self.mlp(hidden_states)
        hidden_states = attn_outputs + feed_forward_hidden_states + residual
        return hidden_states


class CodeGenModel(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.embed_dim = config.n_embd
        self.vocab_size = config.vocab_size
        self.wte = nn.Embedding(config.vocab_size, self.embed_dim)
        self.drop = nn.Dropout(config.embd_pdrop)
        self.h = nn.LayerList([CodeGenBlock(config, layer_idx=i) for i in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(self.embed_dim, epsilon=config.layer_norm_epsilon)

    def forward(self, input_ids):
        inputs_embeds = self.wte(input_ids)
        position_ids = paddle.arange(0, input_ids.shape[-1], dtype="int64").unsqueeze(0)
        hidden_states = self.drop(inputs_embeds)
        for block in self.h:
            hidden_states = block(hidden_states, position_ids=position_ids)
        return self.ln_f(hidden_states)


class CodeGenForCausalLM(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.transformer = CodeGenModel(config)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size)

    def forward(self, input_ids):
        return self.lm_head(self.transformer(input_ids))


def build_model():
    return CodeGenForCausalLM(CodeGenConfig())


def input_spec():
    return [paddle.static.InputSpec([2, SEQ], "int64", "input_ids")]


def loss(model, tokens, labels):
    return F.cross_entropy(model(tokens).reshape([-1, VOCAB]), labels.reshape([-1]))
