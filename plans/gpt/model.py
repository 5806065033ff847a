"""A GPT-2-small-sized model (124M-class): the GPT-style example of plans/.

The classes are the test suite's GPT-2-style model (``tests/models/gpt.py``: LayerNorm, one fused
qkv Linear with bias, explicit softmax attention, GELU MLP, token + position embeddings, an
untied LM head), loaded from there so there is one copy; this file only picks GPT-2 small's
sizes, with the vocabulary padded to 50304 (a multiple of 128, as nanoGPT does) so it divides
over mp.

Planner use::

    autodist-plan plans/gpt/model.py --devices 8 --device h100-sxm -o plan.json
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import paddle

_SOURCE = Path(__file__).resolve().parents[2] / "tests" / "models" / "gpt.py"
_NAME = "autodist_plans_gpt_classes"


def _classes():
    """tests/models/gpt.py as a module (a file, not an installed package)."""
    if _NAME not in sys.modules:
        spec = importlib.util.spec_from_file_location(_NAME, _SOURCE)
        module = importlib.util.module_from_spec(spec)
        sys.modules[_NAME] = module  # dataclasses look their module up while it executes
        spec.loader.exec_module(module)
    return sys.modules[_NAME]


def config():
    """GPT-2 small: 12 layers, hidden 768, 12 heads, 1024 positions; batch 8 of 1024 tokens."""
    gpt = _classes()
    return gpt.GPTConfig(
        vocab_size=50304,
        hidden_size=768,
        num_heads=12,
        num_layers=12,
        max_positions=1024,
        mlp_ratio=4,
        batch_size=8,
        seq_len=1024,
    )


def build_model():
    return _classes().build_model(config())


def input_spec() -> list[paddle.static.InputSpec]:
    return _classes().input_spec(config())


def loss_fn(logits: paddle.Tensor, labels: paddle.Tensor) -> paddle.Tensor:
    """Next-token cross-entropy, the mean over the batch's tokens: the model returns logits, and
    ``examples/train.py`` (and a pipeline schedule) calls this beside it."""
    return paddle.nn.functional.cross_entropy(logits, labels.unsqueeze(-1)).mean()
