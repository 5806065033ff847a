"""Tiny PaddleFormers models (random weights, no download), a CNN and single-MLP models.

The PaddleFormers configs pass ``fuse_rms_norm=False``: the fused RMSNorm kernel rejects
float32 on CPU (docs/paddle-notes.md, "Tracing"). Their full ``ForCausalLM.forward`` traces (the planner
works around dy2static's ``super()`` rewrite, planner/trace.py).

Example::

    >>> llama = build_llama(num_hidden_layers=2)
    >>> [n for n, _ in llama.named_parameters()][:1]
    ['model.embed_tokens.weight']
"""

from __future__ import annotations

import paddle
import paddle.nn as nn
import paddle.nn.functional as F

BATCH, SEQ = 2, 8

_TINY = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    fuse_rms_norm=False,
)


def build_llama(**overrides):
    """PaddleFormers ``LlamaForCausalLM`` with grouped-query attention (4 heads, 2 KV heads)."""
    from paddleformers.transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(**{**_TINY, **overrides}))


def build_untied_llama():
    """``build_llama`` with a separate LM head weight (Llama-2 style), which pipelines can split."""
    return build_llama(tie_word_embeddings=False)


def build_phi3(**overrides):
    """PaddleFormers ``Phi3ForCausalLM`` (GQA too): one fused ``qkv_proj``, one fused ``gate_up_proj``."""
    from paddleformers.transformers import Phi3Config, Phi3ForCausalLM

    return Phi3ForCausalLM(Phi3Config(**{**_TINY, **overrides}))


def build_gemma3(**overrides):
    """PaddleFormers ``Gemma3ForCausalLM``: fused ``qkv_proj`` / ``up_gate_proj`` (GeGLU),
    q/k RMSNorms, sandwich norms around attention and MLP, tied head."""
    from paddleformers.transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = {**_TINY, "head_dim": 8, "sliding_window": 8, "query_pre_attn_scalar": 8, **overrides}
    return Gemma3ForCausalLM(Gemma3TextConfig(**config))


def input_spec(batch: int = BATCH, seq: int = SEQ) -> list[paddle.static.InputSpec]:
    return [paddle.static.InputSpec([batch, seq], "int64", "input_ids")]


class TinyCNN(nn.Layer):
    """conv -> relu -> pool -> linear: no transformer block at all."""

    def __init__(self, channels: int = 4, classes: int = 10):
        super().__init__()
        self.conv = nn.Conv2D(3, channels, kernel_size=3, padding=1)
        self.pool = nn.AdaptiveAvgPool2D(1)
        self.fc = nn.Linear(channels, classes)

    def forward(self, images):
        return self.fc(self.pool(F.relu(self.conv(images))).flatten(1))


def build_cnn() -> TinyCNN:
    return TinyCNN()


def cnn_input_spec() -> list[paddle.static.InputSpec]:
    return [paddle.static.InputSpec([BATCH, 3, 8, 8], "float32", "images")]


class SwiGLUMLP(nn.Layer):
    """Llama's MLP alone: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int = 32, intermediate: int = 64):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias_attr=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias_attr=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias_attr=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class GELUMLP(nn.Layer):
    """GPT-2's MLP alone: fc_out(gelu(fc_in(x))) with biases."""

    def __init__(self, hidden: int = 32, intermediate: int = 128):
        super().__init__()
        self.fc_in = nn.Linear(hidden, intermediate)
        self.fc_out = nn.Linear(intermediate, hidden)

    def forward(self, x):
        return self.fc_out(F.gelu(self.fc_in(x)))


def mlp_input_spec(hidden: int = 32) -> list[paddle.static.InputSpec]:
    return [paddle.static.InputSpec([BATCH, SEQ, hidden], "float32", "x")]


def build_ernie45(**overrides):
    """PaddleFormers ``Ernie4_5ForCausalLM`` (dense): GQA attention, SwiGLU MLP; traces in eval mode only."""
    from paddleformers.transformers import Ernie4_5Config, Ernie4_5ForCausalLM

    return Ernie4_5ForCausalLM(Ernie4_5Config(**{**_TINY, "head_dim": 8, **overrides}))


def build_gpt_oss(**overrides):
    """PaddleFormers ``GptOssForCausalLM``: attention with sinks and alternating sliding windows,
    an MoE of 4 experts as batched 3-D weights (interleaved gate|up); traces in eval mode only."""
    from paddleformers.transformers import GptOssConfig, GptOssForCausalLM

    config = {
        **_TINY,
        "head_dim": 8,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "sliding_window": 8,
        "rope_scaling": None,
        **overrides,
    }
    return GptOssForCausalLM(GptOssConfig(**config))
