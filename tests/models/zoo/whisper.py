"""Whisper as OpenAI's ``whisper/model.py`` writes it (and PaddleSpeech's port keeps it): an audio
encoder of two ``Conv1d`` + GELU with a fixed sinusoid table, a text decoder with a learned
position table, a causal mask built once with ``triu_`` and added to the scores, and
``ResidualAttentionBlock``s whose ``MultiHeadAttention`` has ``query``/``key``/``value``/``out``
(``key`` without bias) and scales q and k each by ``d ** -0.25``; decoder blocks add
cross-attention on the audio features; the MLP is an ``nn.Sequential`` of Linear, GELU, Linear;
the logits reuse the token embedding (``x @ token_embedding.weight.T``). Sizes are tiny.

    >>> model = build_model()
    >>> mel = paddle.randn([2, N_MELS, 2 * N_AUDIO_CTX])
    >>> list(model(mel, paddle.randint(0, N_VOCAB, [2, N_TEXT_CTX])).shape)
    [2, 8, 64]
"""

from collections.abc import Iterable

import numpy as np
import paddle
import paddle.nn.functional as F
from paddle import nn

N_MELS, N_AUDIO_CTX, N_TEXT_CTX, N_VOCAB = 8, 16, 8, 64
N_STATE, N_HEAD, N_LAYER = 32, 4, 2


class LayerNorm(nn.LayerNorm):
    def forward(self, x):
        return super().forward(x.astype("float32")).astype(x.dtype)


class Linear(nn.Linear):
    def forward(self, x):
        return F.linear(x, self.weight.astype(x.dtype), None if self.bias is None else self.bias.astype(x.dtype))


class Conv1d(nn.Conv1D):
    def forward(self, x):
        return super().forward(x)


def sinusoids(length, channels, max_timescale=10000):
    """Returns sinusoids for positional embedding"""
    assert channels % 2 == 0
    log_timescale_increment = np.log(max_timescale) / (channels // 2 - 1)
    inv_timescales = paddle.exp(-log_timescale_increment * paddle.arange(channels // 2, dtype="float32"))
    scaled_time = paddle.arange(length, dtype="float32")[:, None] * inv_timescales[None, :]
    return paddle.concat([paddle.sin(scaled_time), paddle.cos(scaled_time)], axis=1)


class MultiHeadAttention(nn.Layer):
    def __init__(self, n_state: int, n_head: int):
        super().__init__()
        self.n_head = n_head
        self.query = Linear(n_state, n_state)
        self.key = Linear(n_state, n_state, bias_attr=False)
        self.value = Linear(n_state, n_state)
        self.out = Linear(n_state, n_state)

    def forward(self, x, xa=None, mask=None, kv_cache=None):
        q = self.query(x)
        if kv_cache is None or xa is None or self.key not in kv_cache:
            # hooks, if installed (i.e. kv_cache is not None), will prepend the cached kv tensors;
            # otherwise, perform key/value projections for self- or cross-attention as usual.
            k = self.key(x if xa is None else xa)
            v = self.value(x if xa is None else xa)
        else:
            # for cross-attention, calculate keys and values once and reuse in subsequent calls.
            k = kv_cache[self.key]
            v = kv_cache[self.value]
        wv, qk = self.qkv_attention(q, k, v, mask)
        return self.out(wv), qk

    def qkv_attention(self, q, k, v, mask=None):
        n_batch, n_ctx, n_state = q.shape
        scale = (n_state // self.n_head) ** -0.25
        q = q.reshape([*q.shape[:2], self.n_head, -1]).transpose([0, 2, 1, 3]) * scale
        k = k.reshape([*k.shape[:2], self.n_head, -1]).transpose([0, 2, 3, 1]) * scale
        v = v.reshape([*v.shape[:2], self.n_head, -1]).transpose([0, 2, 1, 3])
        qk = q @ k
        if mask is not None:
            qk = qk + mask[:n_ctx, :n_ctx]
        qk = qk.astype("float32")
        w = F.softmax(qk, axis=-1).astype(q.dtype)
        return (w @ v).transpose([0, 2, 1, 3]).flatten(start_axis=2), qk.detach()


class ResidualAttentionBlock(nn.Layer):
    def __init__(self, n_state: int, n_head: int, cross_attention: bool = False):
        super().__init__()
        self.attn = MultiHeadAttention(n_state, n_head)
        self.attn_ln = LayerNorm(n_state)
        self.cross_attn = MultiHeadAttention(n_state, n_head) if cross_attention else None
        self.cross_attn_ln = LayerNorm(n_state) if cross_attention else None
        n_mlp = n_state * 4
        self.mlp = nn.Sequential(Linear(n_state, n_mlp), nn.GELU(), Linear(n_mlp, n_state))
        self.mlp_ln = LayerNorm(n_state)

    def forward(self, x, xa=None, mask=None, kv_cache=None):
        x = x + self.attn(self.attn_ln(x), mask=mask, kv_cache=kv_cache)[0]
        if self.cross_attn:
            x = x + self.cross_attn(self.cross_attn_ln(x), xa, kv_cache=kv_cache)[0]
        x = x + self.mlp(self.mlp_ln(x))
        return x


class AudioEncoder(nn.Layer):
    def __init__(self, n_mels: int, n_ctx: int, n_state: int, n_head: int, n_layer: int):
        super().__init__()
        self.conv1 = Conv1d(n_mels, n_state, kernel_size=3, padding=1)
        self.conv2 = Conv1d(n_state, n_state, kernel_size=3, stride=2, padding=1)
        self.register_buffer("positional_embedding", sinusoids(n_ctx, n_state))
        self.blocks: Iterable[ResidualAttentionBlock] = nn.LayerList(
            [ResidualAttentionBlock(n_state, n_head) for _ in range(n_layer)]
        )
        self.ln_post = LayerNorm(n_state)

    def forward(self, x):
        """x : paddle.Tensor, shape = (batch_size, n_mels, n_ctx), the mel spectrogram of the audio"""
        x = F.gelu(self.conv1(x))
        x = F.gelu(self.conv2(x))
        x = x.transpose([0, 2, 1])
        x = (x + self.positional_embedding).astype(x.dtype)
        for block in self.blocks:
            x = block(x)
        x = self.ln_post(x)
        return x


class TextDecoder(nn.Layer):
    def __init__(self, n_vocab: int, n_ctx: int, n_state: int, n_head: int, n_layer: int):
        super().__init__()
        self.token_embedding = nn.Embedding(n_vocab, n_state)
        self.positional_embedding = self.create_parameter([n_ctx, n_state])
        self.blocks: Iterable[ResidualAttentionBlock] = nn.LayerList(
            [ResidualAttentionBlock(n_state, n_head, cross_attention=True) for _ in range(n_layer)]
        )
        self.ln = LayerNorm(n_state)
        mask = paddle.full([n_ctx, n_ctx], float("-inf")).triu_(1)
        self.register_buffer("mask", mask, persistable=False)

    def forward(self, x, xa, kv_cache=None):
        """x : the text tokens, (batch_size, <= n_ctx); xa : the encoded audio features,
        (batch_size, n_audio_ctx, n_audio_state)"""
        offset = 0
        x = self.token_embedding(x) + self.positional_embedding[offset : offset + x.shape[-1]]
        x = x.astype(xa.dtype)
        for block in self.blocks:
            x = block(x, xa, mask=self.mask, kv_cache=kv_cache)
        x = self.ln(x)
        logits = (x @ self.token_embedding.weight.astype(x.dtype).T).astype("float32")
        return logits


class Whisper(nn.Layer):
    def __init__(self):
        super().__init__()
        self.encoder = AudioEncoder(N_MELS, N_AUDIO_CTX, N_STATE, N_HEAD, N_LAYER)
        self.decoder = TextDecoder(N_VOCAB, N_TEXT_CTX, N_STATE, N_HEAD, N_LAYER)

    def forward(self, mel, tokens):
        return self.decoder(tokens, self.encoder(mel))


def build_model():
    return Whisper()


def input_spec():
    return [
        paddle.static.InputSpec([2, N_MELS, 2 * N_AUDIO_CTX], "float32", "mel"),
        paddle.static.InputSpec([2, N_TEXT_CTX], "int64", "tokens"),
    ]


#: For the training harness (tests/harness/workloads.py): vocabulary size and loss.
VOCAB = N_VOCAB


def loss(model, tokens, labels):
    """A mel spectrogram from the harness's token ids (a fixed function of them), then the
    decoder's next-token loss."""
    mel = (tokens.astype("float32") / VOCAB).reshape([tokens.shape[0], 1, -1])
    mel = paddle.tile(mel, [1, N_MELS, 2 * N_AUDIO_CTX // mel.shape[-1]])
    return F.cross_entropy(model(mel, tokens).reshape([-1, VOCAB]), labels.reshape([-1]))
