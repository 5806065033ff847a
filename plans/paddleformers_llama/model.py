"""PaddleFormers ``LlamaForCausalLM`` at a ~0.8B-parameter configuration: the real-library example of plans/.

Built from a config with random weights (nothing is downloaded): 16 layers, hidden 2048,
grouped-query attention with 32 heads and 8 KV heads, SwiGLU MLP of 5632, vocabulary 32000; a
batch of 8 sequences of 2048 tokens. ``fuse_rms_norm=False`` because the fused RMSNorm kernel
rejects float32 on CPU, where the planner traces.

Planner use::

    autodist-plan plans/paddleformers_llama/model.py --devices 8 --device h100-sxm -o plan.json
"""

from __future__ import annotations

import paddle

BATCH, SEQ = 8, 2048
CONFIG = dict(
    vocab_size=32000,
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=SEQ,
    fuse_rms_norm=False,
    # Llama-2-style separate LM head: a tied embedding/head cannot be split across pipeline stages
    # (the pp2 example plan needs that), see the planner's rejection reasons.
    tie_word_embeddings=False,
)


def build_model():
    from paddleformers.transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(**CONFIG))


def input_spec() -> list[paddle.static.InputSpec]:
    return [paddle.static.InputSpec([BATCH, SEQ], "int64", "input_ids")]
