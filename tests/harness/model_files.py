"""Model files in the form ``autodist-plan`` and ``examples/train.py`` read, and that script
loaded as a module (its ``main(argv)`` run in the test's process).

Example::

    >>> "def loss_fn" in TINY_LM + TINY_LM_LOSS_FN, "def loss_fn" in TINY_LM
    (True, False)
"""

from __future__ import annotations

import importlib.util
from types import ModuleType

from .launcher import REPO_ROOT

#: A tiny language model file whose forward returns logits: alone it gives no loss.
TINY_LM = """
import paddle

INPUT_SPEC = [paddle.static.InputSpec([4, 8], "int64", "input_ids")]


class TinyLM(paddle.nn.Layer):
    def __init__(self):
        super().__init__()
        self.embed = paddle.nn.Embedding(32, 16)
        self.head = paddle.nn.Linear(16, 32)

    def forward(self, input_ids):
        return self.head(self.embed(input_ids))


def build_model():
    return TinyLM()
"""

#: The loss beside :data:`TINY_LM` (``TINY_LM + TINY_LM_LOSS_FN``: the file gives its loss).
TINY_LM_LOSS_FN = """

def loss_fn(logits, labels):
    return paddle.nn.functional.cross_entropy(logits, labels.unsqueeze(-1)).mean()
"""


def train_script() -> ModuleType:
    """``examples/train.py`` as a module."""
    spec = importlib.util.spec_from_file_location("autodist_example_train", REPO_ROOT / "examples" / "train.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
