"""schemas/parallel_dims.py is the one owner of which parallelisms combine: the planner's search,
``check_plan`` (so ``load_plan`` and ``apply_plan``), ``export`` and the Trainer integration refuse
with its sentences, and the backend operation names are one list (the plan schema's
``BackendOperation``), which the device profiles' ``unsupported`` and the words in ``OPERATIONS``
and ``LACKS`` follow."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import get_args

import msgspec
import pytest

from autodist.schemas import load_plan
from autodist.schemas.checks import check_plan
from autodist.schemas.parallel_dims import LACKS, OPERATIONS, combination_problems, runtime_refusals
from autodist.schemas.parallelize import ExportError, parallelize_config
from autodist.schemas.plan import BackendOperation, Strategy

DEVICES = Path(__file__).parent.parent / "planner" / "cost" / "devices"
PLAN = Path(__file__).parent.parent / "plans" / "llama_docstring" / "plan_4dev.json"


def test_backend_operations_are_one_list():
    names = set(get_args(BackendOperation))
    assert set(OPERATIONS) == names
    assert all(set(lacks) <= names for lacks in LACKS.values())
    for profile in sorted(DEVICES.glob("*.toml")):
        unsupported = tomllib.loads(profile.read_text())["device"].get("unsupported", [])
        assert set(unsupported) <= names, profile.name
    cpu = tomllib.loads((DEVICES / "cpu.toml").read_text())
    assert set(cpu["device"]["unsupported"]) == set(LACKS["gloo"])  # the CPU profile says what gloo lacks


def test_a_plan_no_runtime_builds_is_refused_in_the_owners_words():
    plan = load_plan(PLAN)
    tied = any(p.tied_to for p in plan.params.values())
    strategy = msgspec.structs.replace(plan.strategy, ep=3)
    sentences = combination_problems(strategy, tied=tied)
    assert sentences and all(
        f"$.strategy: {s}" in check_plan(msgspec.structs.replace(plan, strategy=strategy)) for s in sentences
    )


def test_export_refuses_with_the_owners_words():
    plan = load_plan(PLAN)
    strategy = msgspec.structs.replace(plan.strategy, ep=plan.strategy.dp)
    [sentence] = runtime_refusals(strategy, "dist.parallelize")
    with pytest.raises(ExportError) as refused:
        parallelize_config(msgspec.structs.replace(plan, strategy=strategy))
    assert sentence in str(refused.value)


@pytest.mark.parametrize(
    ("strategy", "trainer", "parallelize"),
    [
        (Strategy(dp=2, mp=2, sharding_stage=1), 0, 0),
        (Strategy(mp=2, pp=2, micro_batches=2, schedule="1F1B"), 1, 0),
        (Strategy(mp=2, pp=2, micro_batches=4, schedule="VPP", virtual_stages=2), 1, 1),
        (Strategy(mp=2, sequence_parallel=True, recompute="full"), 2, 0),
    ],
)
def test_runtime_refusals_count_what_each_runtime_lacks(strategy, trainer, parallelize):
    assert len(runtime_refusals(strategy, "trainer")) == trainer
    assert len(runtime_refusals(strategy, "dist.parallelize")) == parallelize
