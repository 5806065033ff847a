"""The MoE model ``bench/experts.py`` measures: the zoo's Mixtral-style decoder
(``tests/models/zoo/mixtral_moe.py``: GQA attention with rotary, a router picking the top-2
experts per token, each a SwiGLU MLP, gathered by index and added back with ``index_add``) at a
config where the experts hold most of the parameters: hidden 256, 8 experts with intermediate
512, 4 layers, 8 heads (4 KV heads), vocabulary 2000; 8 sequences of 128 tokens per step.

The zoo file keeps its sizes in module constants, as small model files do; this file loads its
own copy of that module (under another name, so the zoo's tests see theirs unchanged) and sets
them there. The classes are the zoo's, unchanged. ``autodist-plan bench/moe_model.py`` plans it
like any model file.

    >>> model = build_model()
    >>> round(sum(p.numel().item() for p in model.parameters()) / 1e6, 1)  # experts: 12.6 M
    14.4
"""

from __future__ import annotations

import sys
from pathlib import Path

import paddle
import paddle.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from harness.workloads import load_model_file  # noqa: E402  (tests/ is no package)

mixtral = load_model_file("tests/models/zoo/mixtral_moe.py", "bench_mixtral_moe")
mixtral.VOCAB, mixtral.HIDDEN, mixtral.INTER, mixtral.LAYERS = 2000, 256, 512, 4
mixtral.HEADS, mixtral.KV_HEADS, mixtral.EXPERTS, mixtral.TOP_K = 8, 4, 8, 2

BATCH, SEQ = 8, 128


def build_model() -> paddle.nn.Layer:
    return mixtral.build_model()


def input_spec():
    return [paddle.static.InputSpec([BATCH, SEQ], "int64", "input_ids")]


def loss_fn(logits: paddle.Tensor, labels: paddle.Tensor) -> paddle.Tensor:
    """Token cross-entropy, as the zoo's ``loss``."""
    return F.cross_entropy(logits.reshape([-1, mixtral.VOCAB]), labels.reshape([-1]))
