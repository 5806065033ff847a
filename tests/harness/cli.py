"""The ``autodist-plan`` command line in a test: the docstring Llama at a tiny size, and a runner.

Example (in a test module; importing ``tiny_docstring`` turns the autouse fixture on there)::

    from harness.cli import DOCSTRING, run, tiny_docstring  # noqa: F401 (autouse fixture)

    def test_plans(tmp_path):
        assert run(DOCSTRING, "--devices", 2, "-o", tmp_path / "plan.json").exit_code == 0
"""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from autodist.planner.cli import cli

ROOT = Path(__file__).resolve().parents[2]
#: The docstring Llama's model file; it reads its sizes from ``LLAMA_DOCSTRING_<FIELD>``.
DOCSTRING = str(ROOT / "plans" / "llama_docstring" / "model.py")
#: Sizes that trace in a second.
TINY = dict(VOCAB_SIZE=64, HIDDEN_SIZE=32, INTERMEDIATE_SIZE=64, NUM_HEADS=4, NUM_LAYERS=2, SEQ_LENGTH=16)


@pytest.fixture(autouse=True)
def tiny_docstring(monkeypatch):
    """The docstring Llama at :data:`TINY` sizes for every test of the importing module."""
    for field, value in TINY.items():
        monkeypatch.setenv(f"LLAMA_DOCSTRING_{field}", str(value))


def run(*args) -> Result:
    """``autodist-plan ARGS...`` in this process (arguments turned into strings)."""
    return CliRunner().invoke(cli, [str(a) for a in args])
