"""ModernBERT as HuggingFace transformers writes it (src/transformers/models/modernbert/
modeling_modernbert.py), ported to Paddle at a small config (masked LM, eager attention, no
unpadding).

A pre-norm encoder (bias-free LayerNorms, the first layer's ``attn_norm`` an ``Identity``) with
one fused ``Wqkv`` Linear viewed as ``[bs, seq, 3, heads, head_dim]``, turned by
``transpose(3, 1)`` to ``[bs, heads, 3, seq, head_dim]`` and ``unbind`` along the 3; rotary
positions from the attention's own rotary layer (a global theta on global layers, a local one on
the others), called inside a module-level ``eager_attention_forward`` that takes the attention
layer as ``module``; every ``global_attn_every_n_layers``-th layer attends globally, the others
through a sliding-window mask the model builds once from ``abs(rows - rows.T) <=
local_attention // 2`` (``masked_fill``). GeGLU MLP from one fused ``Wi`` cut by ``chunk(2)``
into input and gate, ``Wo``. The head (dense, GELU, norm) decodes with the token embeddings
(tied) plus its own bias.

What differs from the torch code is spelling (``reshape`` for ``view``, ``transpose`` with the
whole permutation, ``axis`` for ``dim``; torch's ``Linear`` shares its ``[vocab, hidden]`` weight
with the embedding, Paddle's ``[in, out]`` cannot, so the tied decoder is ``matmul(...,
transpose_y=True)``); SDPA, flash and unpadding paths are left out.

    >>> model = build_model()
    >>> list(model(paddle.randint(0, VOCAB, [2, 10])).shape)
    [2, 10, 90]
"""

import paddle
import paddle.nn as nn
import paddle.nn.functional as F

VOCAB, SEQ = 90, 10


class ModernBertConfig:
    vocab_size = VOCAB
    hidden_size = 48
    intermediate_size = 56
    num_hidden_layers = 3
    num_attention_heads = 4
    norm_eps = 1e-5
    norm_bias = False
    global_rope_theta = 160000.0
    local_rope_theta = 10000.0
    local_attention = 4
    global_attn_every_n_layers = 3
    attention_bias = False
    attention_dropout = 0.0
    mlp_bias = False
    mlp_dropout = 0.0
    embedding_dropout = 0.0
    classifier_bias = False
    decoder_bias = True


def layer_norm(config, size):
    return nn.LayerNorm(size, epsilon=config.norm_eps, bias_attr=None if config.norm_bias else False)


class ModernBertEmbeddings(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.norm = layer_norm(config, config.hidden_size)
        self.drop = nn.Dropout(config.embedding_dropout)

    def forward(self, input_ids):
        return self.drop(self.norm(self.tok_embeddings(input_ids)))


class ModernBertMLP(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.Wi = nn.Linear(config.hidden_size, int(config.intermediate_size) * 2, bias_attr=config.mlp_bias)
        self.act = nn.GELU()
        self.drop = nn.Dropout(config.mlp_dropout)
        self.Wo = nn.Linear(config.intermediate_size, config.hidden_size, bias_attr=config.mlp_bias)

    def forward(self, hidden_states):
        input, gate = self.Wi(hidden_states).chunk(2, axis=-1)
        return self.Wo(self.drop(self.act(input) * gate))


class ModernBertRotaryEmbedding(nn.Layer):
    def __init__(self, dim, base):
        super().__init__()
        inv_freq = 1.0 / (base ** (paddle.arange(0, dim, 2, dtype="int64").astype("float32") / dim))
        self.register_buffer("inv_freq", inv_freq, persistable=False)
        self.attention_scaling = 1.0

    def forward(self, x, position_ids):
        inv_freq_expanded = self.inv_freq[None, :, None].astype("float32").expand([position_ids.shape[0], -1, 1])
        position_ids_expanded = position_ids[:, None, :].astype("float32")
        freqs = paddle.matmul(inv_freq_expanded, position_ids_expanded).transpose([0, 2, 1])
        emb = paddle.concat((freqs, freqs), axis=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.astype(x.dtype), sin.astype(x.dtype)


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return paddle.concat((-x2, x1), axis=-1)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed


def eager_attention_forward(module, qkv, attention_mask, sliding_window_mask, position_ids, local_attention, bs, dim):
    # qkv: [batch_size, seqlen, 3, nheads, headdim]
    cos, sin = module.rotary_emb(qkv, position_ids=position_ids)
    query, key, value = qkv.transpose([0, 3, 2, 1, 4]).unbind(axis=2)
    # query, key, value: [batch_size, heads, seq_len, head_dim]
    query, key = apply_rotary_pos_emb(query, key, cos, sin)
    scale = module.head_dim**-0.5
    attn_weights = paddle.matmul(query, key.transpose([0, 1, 3, 2])) * scale
    if local_attention != (-1, -1):
        attention_mask = sliding_window_mask
    attn_weights = attn_weights + attention_mask
    # upcast attention to fp32
    attn_weights = F.softmax(attn_weights, axis=-1, dtype="float32").astype(query.dtype)
    attn_weights = F.dropout(attn_weights, p=module.attention_dropout, training=module.training)
    attn_output = paddle.matmul(attn_weights, value)
    attn_output = attn_output.transpose([0, 2, 1, 3])
    attn_output = attn_output.reshape([bs, -1, dim])
    return (attn_output,)


class ModernBertAttention(nn.Layer):
    def __init__(self, config, layer_id):
        super().__init__()
        self.config = config
        self.layer_id = layer_id
        self.attention_dropout = config.attention_dropout
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.all_head_size = self.head_dim * self.num_heads
        self.Wqkv = nn.Linear(config.hidden_size, 3 * self.all_head_size, bias_attr=config.attention_bias)
        if layer_id % config.global_attn_every_n_layers != 0:
            self.local_attention = (config.local_attention // 2, config.local_attention // 2)
            rope_theta = config.local_rope_theta
        else:
            self.local_attention = (-1, -1)
            rope_theta = config.global_rope_theta
        self.rotary_emb = ModernBertRotaryEmbedding(dim=self.head_dim, base=rope_theta)
        self.Wo = nn.Linear(config.hidden_size, config.hidden_size, bias_attr=config.attention_bias)
        self.out_drop = nn.Dropout(config.attention_dropout) if config.attention_dropout > 0.0 else nn.Identity()

    def forward(self, hidden_states, attention_mask=None, sliding_window_mask=None, position_ids=None):
        qkv = self.Wqkv(hidden_states)
        bs = hidden_states.shape[0]
        qkv = qkv.reshape([bs, -1, 3, self.num_heads, self.head_dim])
        attn_outputs = eager_attention_forward(
            self,
            qkv=qkv,
            attention_mask=attention_mask,
            sliding_window_mask=sliding_window_mask,
            position_ids=position_ids,
            local_attention=self.local_attention,
            bs=bs,
            dim=self.all_head_size,
        )
        hidden_states = attn_outputs[0]
        hidden_states = self.out_drop(self.Wo(hidden_states))
        return (hidden_states,) + attn_outputs[1:]  # add attentions if outputted


class ModernBertEncoderLayer(nn.Layer):
    def __init__(self, config, layer_id):
        super().__init__()
        self.config = config
        if layer_id == 0:
            self.attn_norm = nn.Identity()
        else:
            self.attn_norm = layer_norm(config, config.hidden_size)
        self.attn = ModernBertAttention(config=config, layer_id=layer_id)
        self.mlp_norm = layer_norm(config, config.hidden_size)
        self.mlp = ModernBertMLP(config)

    def forward(self, hidden_states, attention_mask=None, sliding_window_mask=None, position_ids=None):
        attn_outputs = self.attn(
            self.attn_norm(hidden_states),
            attention_mask=attention_mask,
            sliding_window_mask=sliding_window_mask,
            position_ids=position_ids,
        )
        hidden_states = hidden_states + attn_outputs[0]
        mlp_output = self.mlp(self.mlp_norm(hidden_states))
        hidden_states = hidden_states + mlp_output
        return (hidden_states,) + attn_outputs[1:]  # add attentions if outputted


def _prepare_4d_attention_mask(mask, dtype, tgt_len=None):
    bsz, src_len = mask.shape
    tgt_len = tgt_len if tgt_len is not None else src_len
    expanded_mask = mask[:, None, None, :].expand([bsz, 1, tgt_len, src_len]).astype(dtype)
    inverted_mask = 1.0 - expanded_mask
    return inverted_mask.masked_fill(inverted_mask.astype("bool"), paddle.finfo(dtype).min)


class ModernBertModel(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embeddings = ModernBertEmbeddings(config)
        self.layers = nn.LayerList(
            [ModernBertEncoderLayer(config, layer_id) for layer_id in range(config.num_hidden_layers)]
        )
        self.final_norm = layer_norm(config, config.hidden_size)

    def _update_attention_mask(self, attention_mask):
        global_attention_mask = _prepare_4d_attention_mask(attention_mask, paddle.float32)
        # Create position indices
        rows = paddle.arange(global_attention_mask.shape[2]).unsqueeze(0)
        # Calculate distance between positions
        distance = paddle.abs(rows - rows.T)
        # Create sliding window mask (1 for positions within window, 0 outside)
        window_mask = (distance <= self.config.local_attention // 2).unsqueeze(0).unsqueeze(0)
        # Combine with existing mask
        sliding_window_mask = global_attention_mask.masked_fill(
            window_mask.logical_not(), paddle.finfo(paddle.float32).min
        )
        return global_attention_mask, sliding_window_mask

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        batch_size, seq_len = input_ids.shape[:2]
        if attention_mask is None:
            attention_mask = paddle.ones((batch_size, seq_len), dtype="bool")
        if position_ids is None:
            position_ids = paddle.arange(seq_len).unsqueeze(0)
        attention_mask, sliding_window_mask = self._update_attention_mask(attention_mask)
        hidden_states = self.embeddings(input_ids)
        for encoder_layer in self.layers:
            layer_outputs = encoder_layer(
                hidden_states,
                attention_mask=attention_mask,
                sliding_window_mask=sliding_window_mask,
                position_ids=position_ids,
            )
            hidden_states = layer_outputs[0]
        return self.final_norm(hidden_states)


class ModernBertPredictionHead(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size, bias_attr=config.classifier_bias)
        self.act = nn.GELU()
        self.norm = layer_norm(config, config.hidden_size)

    def forward(self, hidden_states):
        return self.norm(self.act(self.dense(hidden_states)))


class ModernBertForMaskedLM(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.model = ModernBertModel(config)
        self.head = ModernBertPredictionHead(config)
        # the decoder is tied to the token embeddings (HF's tie_weights), with its own bias
        self.decoder_bias = self.create_parameter([config.vocab_size], is_bias=True)

    def forward(self, input_ids, attention_mask=None):
        last_hidden_state = self.model(input_ids, attention_mask)
        hidden = self.head(last_hidden_state)
        weight = self.model.embeddings.tok_embeddings.weight
        return paddle.matmul(hidden, weight, transpose_y=True) + self.decoder_bias


def build_model():
    return ModernBertForMaskedLM(ModernBertConfig())


def input_spec():
    return [paddle.static.InputSpec([2, SEQ], "int64", "input_ids")]


def loss(model, tokens, labels):
    return F.cross_entropy(model(tokens).reshape([-1, VOCAB]), labels.reshape([-1]))
