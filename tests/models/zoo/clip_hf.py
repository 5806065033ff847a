"""HF CLIP (``CLIPModel``) as transformers' modeling_clip writes it, ported to Paddle at a small
config: both towers, their projections and the contrastive loss.

The text tower: token and learned position embeddings (``position_ids`` a registered buffer
sliced to the sequence), the causal mask built in the text transformer
(``_build_causal_attention_mask``: filled with the dtype's minimum, ``triu_(1)``), the pooled
output at each sequence's largest token id (the end-of-text token, ``argmax``). The vision tower:
a bias-free Conv2D patch embedding, a ``class_embedding`` vector expanded over the batch and
concatenated before the patches, ``pre_layrnorm`` (HF's spelling) before the encoder and
``post_layernorm`` on the class token. Both towers' pre-LN encoder layers
(``layer_norm1``/``self_attn``/``layer_norm2``/``mlp``, ``quick_gelu``) use CLIP's attention: the
query scaled before the scores (``q_proj(h) * self.scale``), heads folded into the batch by
``_shape`` and ``proj_shape``, scores by ``bmm``, the causal mask added on a ``[bsz, heads, tgt,
src]`` view, the output reshaped with the width read from its input
(``bsz, tgt_len, embed_dim = hidden_states.shape``). The embeddings are projected, normalised and
scored against each other times ``logit_scale.exp()`` (a 0-d parameter); ``clip_loss`` averages
the captions' and the images' cross entropies.

What differs from the torch code is spelling (``reshape`` for ``view``, ``transpose`` with the
whole permutation, ``axis`` for ``dim``, ``paddle.full`` + ``paddle.triu`` for ``empty`` +
``fill_`` + ``triu_``); output_attentions and the SDPA/flash paths are left out.

    >>> model = build_model()
    >>> ids, pixels = paddle.randint(0, VOCAB, [3, 16]), paddle.rand([3, CHANS, IMG, IMG])
    >>> [list(logits.shape) for logits in model(input_ids=ids, pixel_values=pixels)]
    [[3, 3], [3, 3]]
"""

import paddle
import paddle.nn as nn
import paddle.nn.functional as F

VOCAB, HIDDEN, INTER, LAYERS, HEADS, PROJ = 64, 40, 72, 2, 4, 24
IMG, PATCH, CHANS, V_HIDDEN, V_INTER = 16, 4, 3, 48, 88


class CLIPTextConfig:
    vocab_size = VOCAB
    hidden_size = HIDDEN
    intermediate_size = INTER
    projection_dim = PROJ
    num_hidden_layers = LAYERS
    num_attention_heads = HEADS
    max_position_embeddings = 32
    hidden_act = "quick_gelu"
    layer_norm_eps = 1e-5
    attention_dropout = 0.0


class CLIPVisionConfig:
    hidden_size = V_HIDDEN
    intermediate_size = V_INTER
    projection_dim = PROJ
    num_hidden_layers = LAYERS
    num_attention_heads = HEADS
    num_channels = CHANS
    image_size = IMG
    patch_size = PATCH
    hidden_act = "quick_gelu"
    layer_norm_eps = 1e-5
    attention_dropout = 0.0


class CLIPConfig:
    text_config = CLIPTextConfig()
    vision_config = CLIPVisionConfig()
    projection_dim = PROJ
    logit_scale_init_value = 2.6592


def quick_gelu(x):
    return x * F.sigmoid(1.702 * x)


ACT2FN = {"quick_gelu": quick_gelu, "gelu": F.gelu}


class CLIPVisionEmbeddings(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_dim = config.hidden_size
        self.image_size = config.image_size
        self.patch_size = config.patch_size

        self.class_embedding = self.create_parameter([self.embed_dim], default_initializer=nn.initializer.Normal())

        self.patch_embedding = nn.Conv2D(
            in_channels=config.num_channels,
            out_channels=self.embed_dim,
            kernel_size=self.patch_size,
            stride=self.patch_size,
            bias_attr=False,
        )

        self.num_patches = (self.image_size // self.patch_size) ** 2
        self.num_positions = self.num_patches + 1
        self.position_embedding = nn.Embedding(self.num_positions, self.embed_dim)
        self.register_buffer("position_ids", paddle.arange(self.num_positions).expand((1, -1)), persistable=False)

    def forward(self, pixel_values):
        batch_size = pixel_values.shape[0]
        target_dtype = self.patch_embedding.weight.dtype
        patch_embeds = self.patch_embedding(pixel_values.astype(target_dtype))  # shape = [*, width, grid, grid]
        patch_embeds = patch_embeds.flatten(2).transpose([0, 2, 1])

        class_embeds = self.class_embedding.expand([batch_size, 1, -1])
        embeddings = paddle.concat([class_embeds, patch_embeds], axis=1)
        embeddings = embeddings + self.position_embedding(self.position_ids)
        return embeddings


class CLIPTextEmbeddings(nn.Layer):
    def __init__(self, config):
        super().__init__()
        embed_dim = config.hidden_size
        self.token_embedding = nn.Embedding(config.vocab_size, embed_dim)
        self.position_embedding = nn.Embedding(config.max_position_embeddings, embed_dim)
        # position_ids (1, len position emb) is contiguous in memory and exported when serialized
        self.register_buffer(
            "position_ids", paddle.arange(config.max_position_embeddings).expand((1, -1)), persistable=False
        )

    def forward(self, input_ids=None, position_ids=None, inputs_embeds=None):
        seq_length = input_ids.shape[-1] if input_ids is not None else inputs_embeds.shape[-2]
        if position_ids is None:
            position_ids = self.position_ids[:, :seq_length]
        if inputs_embeds is None:
            inputs_embeds = self.token_embedding(input_ids)
        position_embeddings = self.position_embedding(position_ids)
        embeddings = inputs_embeds + position_embeddings
        return embeddings


class CLIPAttention(nn.Layer):
    """Multi-headed attention from 'Attention Is All You Need' paper"""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_dim = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.embed_dim // self.num_heads
        if self.head_dim * self.num_heads != self.embed_dim:
            raise ValueError(
                f"embed_dim must be divisible by num_heads (got `embed_dim`: {self.embed_dim} and `num_heads`:"
                f" {self.num_heads})."
            )
        self.scale = self.head_dim**-0.5
        self.dropout = config.attention_dropout

        self.k_proj = nn.Linear(self.embed_dim, self.embed_dim)
        self.v_proj = nn.Linear(self.embed_dim, self.embed_dim)
        self.q_proj = nn.Linear(self.embed_dim, self.embed_dim)
        self.out_proj = nn.Linear(self.embed_dim, self.embed_dim)

    def _shape(self, tensor, seq_len, bsz):
        return tensor.reshape([bsz, seq_len, self.num_heads, self.head_dim]).transpose([0, 2, 1, 3])

    def forward(self, hidden_states, attention_mask=None, causal_attention_mask=None):
        """Input shape: Batch x Time x Channel"""

        bsz, tgt_len, embed_dim = hidden_states.shape

        # get query proj
        query_states = self.q_proj(hidden_states) * self.scale
        key_states = self._shape(self.k_proj(hidden_states), -1, bsz)
        value_states = self._shape(self.v_proj(hidden_states), -1, bsz)

        proj_shape = (bsz * self.num_heads, -1, self.head_dim)
        query_states = self._shape(query_states, tgt_len, bsz).reshape(proj_shape)
        key_states = key_states.reshape(proj_shape)
        value_states = value_states.reshape(proj_shape)

        src_len = key_states.shape[1]
        attn_weights = paddle.bmm(query_states, key_states.transpose([0, 2, 1]))

        # apply the causal_attention_mask first
        if causal_attention_mask is not None:
            attn_weights = attn_weights.reshape([bsz, self.num_heads, tgt_len, src_len]) + causal_attention_mask
            attn_weights = attn_weights.reshape([bsz * self.num_heads, tgt_len, src_len])

        if attention_mask is not None:
            attn_weights = attn_weights.reshape([bsz, self.num_heads, tgt_len, src_len]) + attention_mask
            attn_weights = attn_weights.reshape([bsz * self.num_heads, tgt_len, src_len])

        attn_weights = F.softmax(attn_weights, axis=-1)
        attn_probs = F.dropout(attn_weights, p=self.dropout, training=self.training)

        attn_output = paddle.bmm(attn_probs, value_states)

        attn_output = attn_output.reshape([bsz, self.num_heads, tgt_len, self.head_dim])
        attn_output = attn_output.transpose([0, 2, 1, 3])
        attn_output = attn_output.reshape([bsz, tgt_len, embed_dim])

        attn_output = self.out_proj(attn_output)
        return attn_output


class CLIPMLP(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.activation_fn = ACT2FN[config.hidden_act]
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, hidden_states):
        hidden_states = self.fc1(hidden_states)
        hidden_states = self.activation_fn(hidden_states)
        hidden_states = self.fc2(hidden_states)
        return hidden_states


class CLIPEncoderLayer(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.embed_dim = config.hidden_size
        self.self_attn = CLIPAttention(config)
        self.layer_norm1 = nn.LayerNorm(self.embed_dim, epsilon=config.layer_norm_eps)
        self.mlp = CLIPMLP(config)
        self.layer_norm2 = nn.LayerNorm(self.embed_dim, epsilon=config.layer_norm_eps)

    def forward(self, hidden_states, attention_mask, causal_attention_mask):
        residual = hidden_states

        hidden_states = self.layer_norm1(hidden_states)
        hidden_states = self.self_attn(
            hidden_states=hidden_states,
            attention_mask=attention_mask,
            causal_attention_mask=causal_attention_mask,
        )
        hidden_states = residual + hidden_states

        residual = hidden_states
        hidden_states = self.layer_norm2(hidden_states)
        hidden_states = self.mlp(hidden_states)
        hidden_states = residual + hidden_states
        return hidden_states


class CLIPEncoder(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.layers = nn.LayerList([CLIPEncoderLayer(config) for _ in range(config.num_hidden_layers)])

    def forward(self, inputs_embeds, attention_mask=None, causal_attention_mask=None):
        hidden_states = inputs_embeds
        for encoder_layer in self.layers:
            hidden_states = encoder_layer(hidden_states, attention_mask, causal_attention_mask)
        return hidden_states


class CLIPTextTransformer(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.config = config
        embed_dim = config.hidden_size
        self.embeddings = CLIPTextEmbeddings(config)
        self.encoder = CLIPEncoder(config)
        self.final_layer_norm = nn.LayerNorm(embed_dim, epsilon=config.layer_norm_eps)

    def forward(self, input_ids=None, attention_mask=None, position_ids=None):
        input_shape = input_ids.shape
        input_ids = input_ids.reshape([-1, input_shape[-1]])

        hidden_states = self.embeddings(input_ids=input_ids, position_ids=position_ids)

        bsz, seq_len = input_shape
        # CLIP's text model uses causal mask, prepare it here.
        # https://github.com/openai/CLIP/blob/cfcffb90e69f37bf2ff1e988237a0fbe41f33c04/clip/model.py#L324
        causal_attention_mask = self._build_causal_attention_mask(bsz, seq_len, hidden_states.dtype)
        # expand attention_mask
        if attention_mask is not None:
            # [bsz, seq_len] -> [bsz, 1, tgt_seq_len, src_seq_len]
            attention_mask = _expand_mask(attention_mask, hidden_states.dtype)

        last_hidden_state = self.encoder(
            inputs_embeds=hidden_states,
            attention_mask=attention_mask,
            causal_attention_mask=causal_attention_mask,
        )
        last_hidden_state = self.final_layer_norm(last_hidden_state)

        # text_embeds.shape = [batch_size, sequence_length, transformer.width]
        # take features from the eot embedding (eot_token is the highest number in each sequence)
        pooled_output = last_hidden_state[
            paddle.arange(last_hidden_state.shape[0]), input_ids.astype("int32").argmax(axis=-1)
        ]
        return last_hidden_state, pooled_output

    def _build_causal_attention_mask(self, bsz, seq_len, dtype):
        # lazily create causal attention mask, with full attention between the vision tokens
        # pytorch uses additive attention mask; fill with -inf
        mask = paddle.full([bsz, seq_len, seq_len], paddle.finfo(dtype).min, dtype=dtype)
        mask = paddle.triu(mask, 1)  # zero out the lower diagonal
        mask = mask.unsqueeze(1)  # expand mask
        return mask


def _expand_mask(mask, dtype, tgt_len=None):
    """Expands attention_mask from `[bsz, seq_len]` to `[bsz, 1, tgt_seq_len, src_seq_len]`."""
    bsz, src_len = mask.shape
    tgt_len = tgt_len if tgt_len is not None else src_len
    expanded_mask = mask[:, None, None, :].expand([bsz, 1, tgt_len, src_len]).astype(dtype)
    inverted_mask = 1.0 - expanded_mask
    return inverted_mask.masked_fill(inverted_mask.astype("bool"), paddle.finfo(dtype).min)


class CLIPVisionTransformer(nn.Layer):
    def __init__(self, config):
        super().__init__()
        self.config = config
        embed_dim = config.hidden_size

        self.embeddings = CLIPVisionEmbeddings(config)
        self.pre_layrnorm = nn.LayerNorm(embed_dim, epsilon=config.layer_norm_eps)
        self.encoder = CLIPEncoder(config)
        self.post_layernorm = nn.LayerNorm(embed_dim, epsilon=config.layer_norm_eps)

    def forward(self, pixel_values=None):
        hidden_states = self.embeddings(pixel_values)
        hidden_states = self.pre_layrnorm(hidden_states)

        last_hidden_state = self.encoder(inputs_embeds=hidden_states)
        pooled_output = last_hidden_state[:, 0, :]
        pooled_output = self.post_layernorm(pooled_output)
        return last_hidden_state, pooled_output


# contrastive loss function, adapted from
# https://sachinruk.github.io/blog/2021-03-07-clip.html
def contrastive_loss(logits):
    return F.cross_entropy(logits, paddle.arange(logits.shape[0]))


def clip_loss(similarity):
    caption_loss = contrastive_loss(similarity)
    image_loss = contrastive_loss(similarity.t())
    return (caption_loss + image_loss) / 2.0


class CLIPModel(nn.Layer):
    def __init__(self, config):
        super().__init__()
        text_config = config.text_config
        vision_config = config.vision_config

        self.projection_dim = config.projection_dim
        self.text_embed_dim = text_config.hidden_size
        self.vision_embed_dim = vision_config.hidden_size

        self.text_model = CLIPTextTransformer(text_config)
        self.vision_model = CLIPVisionTransformer(vision_config)

        self.visual_projection = nn.Linear(self.vision_embed_dim, self.projection_dim, bias_attr=False)
        self.text_projection = nn.Linear(self.text_embed_dim, self.projection_dim, bias_attr=False)
        self.logit_scale = self.create_parameter(
            [], default_initializer=nn.initializer.Constant(config.logit_scale_init_value)
        )

    def forward(self, input_ids=None, pixel_values=None, attention_mask=None, position_ids=None, return_loss=None):
        _, image_embeds = self.vision_model(pixel_values=pixel_values)
        _, text_embeds = self.text_model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)

        image_embeds = self.visual_projection(image_embeds)
        text_embeds = self.text_projection(text_embeds)

        # normalized features
        image_embeds = image_embeds / image_embeds.norm(p=2, axis=-1, keepdim=True)
        text_embeds = text_embeds / text_embeds.norm(p=2, axis=-1, keepdim=True)

        # cosine similarity as logits
        logit_scale = self.logit_scale.exp()
        logits_per_text = paddle.matmul(text_embeds, image_embeds.t()) * logit_scale
        logits_per_image = logits_per_text.t()

        if return_loss:
            return clip_loss(logits_per_text)
        return logits_per_image, logits_per_text


def build_model():
    return CLIPModel(CLIPConfig())


def input_spec():
    return [
        paddle.static.InputSpec([2, 16], "int64", "input_ids"),
        paddle.static.InputSpec([2, CHANS, IMG, IMG], "float32", "pixel_values"),
    ]


def loss(model, tokens, labels):
    """CLIP's contrastive loss over the batch's captions (the tokens) and images (pixels, a fixed
    function of the tokens); the labels are not read."""
    pixels = (tokens.astype("float32") / VOCAB).reshape([tokens.shape[0], 1, 1, -1])
    pixels = paddle.tile(pixels, [1, CHANS, IMG, IMG // pixels.shape[-1]])
    return model(input_ids=tokens, pixel_values=pixels, return_loss=True)
