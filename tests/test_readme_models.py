"""The README's PaddleFormers model classes: the ones it says build do, and are the ones the tests
plan; the ones it says do not build fail to, for want of ``paddlefleet``.

The README once claimed "its model classes" at large, while Qwen2 and Qwen3 fail to import here
(``ImportError: paddlefleet is required for gpt_provider``) and no ``paddlefleet`` installs.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from harness.workloads import ZOO_PADDLEFORMERS

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def _listed(start: str, end: str) -> list[str]:
    """The backticked class names of the README between ``start`` and ``end``."""
    found = re.search(re.escape(start) + r"(.*?)" + re.escape(end), README, re.S)
    assert found, f"README no longer says {start!r} ... {end!r}"
    return re.findall(r"`(\w+ForCausalLM)`", found.group(1))


BUILD = _listed("these build in that environment", "also train on CPU ranks")
NOT_BUILD = _listed("These do not build there", "Their modules import")


def test_the_classes_said_to_build_are_the_zoo_s_and_build():
    from models import paddleformers_models

    built = [type(getattr(paddleformers_models, factory)()).__name__ for factory in ZOO_PADDLEFORMERS]
    assert sorted(BUILD) == sorted(built)


@pytest.mark.parametrize("name", NOT_BUILD)
def test_the_classes_said_not_to_build_fail_for_want_of_paddlefleet(name):
    import paddleformers.transformers as transformers

    with pytest.raises(ImportError) as failed:
        getattr(transformers, name)
    chain, error = [], failed.value
    while error is not None:
        chain.append(str(error))
        error = error.__cause__ or error.__context__
    assert any("paddlefleet" in text for text in chain), chain
