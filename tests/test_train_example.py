"""examples/train.py meets the common model-file forms: INPUT_SPEC instead of input_spec(), and
a model that returns logits with a loss function beside it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import paddle
import pytest
from harness.model_files import TINY_LM, TINY_LM_LOSS_FN, train_script

from autodist.applier import training

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("model_file", sorted((ROOT / "plans").glob("*/model.py")), ids=lambda p: p.parent.name)
def test_every_model_file_of_plans_gives_train_py_its_loss(model_file):
    """The README trains plans/'s model files with examples/train.py: each has either a
    ``loss_fn`` beside a model returning logits or a ``forward`` taking ``labels``."""
    module, factory = train_script().load_factory(str(model_file))
    with paddle.LazyGuard():
        model = factory()
    assert training.gives_loss(model, getattr(module, "loss_fn", None))


def test_input_spec_constant_and_a_loss_function_beside_the_model(tmp_path):
    (tmp_path / "lm.py").write_text(TINY_LM + TINY_LM_LOSS_FN)
    out = tmp_path / "losses.json"
    result = subprocess.run(
        [
            sys.executable,
            "examples/train.py",
            "--model",
            str(tmp_path / "lm.py"),
            "--steps",
            "3",
            "--losses-out",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    losses = json.loads(out.read_text())["losses"]
    assert len(losses) == 3 and all(3.0 < loss < 4.0 for loss in losses)  # about ln(32) = 3.47 at the start
    assert [line.split()[:2] for line in result.stdout.splitlines() if line.startswith("step")] == [
        ["step", "1"],
        ["step", "2"],
        ["step", "3"],
    ]


def test_lazy_flag_starts_from_the_eager_weights(tmp_path):
    """``--lazy`` builds under autodist.LazyGuard and apply_plan initialises the model as an
    eager build would: the docstring Llama (which creates its LM head after its decoder) trains
    to the same losses either way."""
    from harness.launcher import base_env
    from harness.plans import tensor_parallel_plan, write_plan
    from harness.workloads import WORKLOADS

    workload = WORKLOADS["docstring_llama"]
    plan = write_plan(tensor_parallel_plan(workload.build(seed=0)), tmp_path / "plan.json")
    losses = []
    for flags in ([], ["--lazy"]):
        out = tmp_path / f"losses{len(flags)}.json"
        result = subprocess.run(
            [
                sys.executable,
                "examples/train.py",
                "--model",
                workload.planner_target,
                "--plan",
                plan,
                "--steps",
                "2",
                "--losses-out",
                str(out),
                *flags,
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
            env=base_env(workload.planner_env),
        )
        assert result.returncode == 0, result.stderr[-2000:]
        losses.append(json.loads(out.read_text())["losses"])
    eager, lazy = losses
    assert len(eager) == 2 and lazy == eager
