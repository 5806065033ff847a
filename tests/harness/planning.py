"""The planner for the tests, with each model file traced once per session.

Tracing (2-7 s a model on the 2-core machine) is most of a plan's time, and the tests plan the
same zoo files many times, for different requests, in several modules. :func:`plan_target` is
the driver's, with the load, trace and analysis of a ``(target, input specs, environment)``
kept for the session (a model file may read the environment, as the docstring Llama reads its
sizes): what follows them (cost, search, emit) is run for every call, as the driver runs it
(:func:`autodist.planner.driver.plan_analysed`). A failed load or trace is not kept (it raises
again). Rules change the analysis, so a call with rules plans without the cache.

The planner's own tests of loading and tracing call the driver directly. :func:`plan_command`
runs the ``autodist-plan`` command itself (its options, checks and ``save_plan``) in this
process through :func:`plan_target`, for tests that want a plan file as users make one without
a planner process that imports Paddle and traces the model again.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Sequence
from unittest import mock

from click.testing import CliRunner

from autodist.planner import driver
from autodist.planner.cost.search import SearchRequest


#: The driver's own, kept before :func:`plan_command` patches ``driver.plan_target`` with ours.
_DRIVER_PLAN_TARGET = driver.plan_target


@functools.cache
def _analysed(target: str, input_specs: tuple[str, ...] | None, environment: tuple[tuple[str, str], ...]):
    loaded = driver.load(target, input_specs)
    traced = driver.trace(loaded.model, loaded.input_specs)
    return traced, driver.analyse(loaded.model, traced), loaded.model


def plan_target(
    target: str,
    input_specs: Sequence[str] | None,
    request,
    arguments: dict[str, str],
    progress=None,
    rules: dict[str, str] | None = None,
    *,
    local_view: bool = False,
) -> driver.PlannedModel:
    """:func:`autodist.planner.driver.plan_target`, tracing each model once (a call with rules
    plans without the cache). Local views are proven on the cached model (the proof leaves it as
    it was); off unless asked, so the tests' plans keep the gathered layout they were written for."""
    if rules:
        return _DRIVER_PLAN_TARGET(target, input_specs, request, arguments, progress, rules, local_view=local_view)
    specs = tuple(input_specs) if input_specs else None
    environment = tuple(sorted((k, v) for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"))
    traced, analysis, model = _analysed(target, specs, environment)
    return driver.plan_analysed(analysis, traced, request, arguments, progress, model=model, local_view=local_view)


def plan_command(
    target: str, arguments: Sequence[str], output: Path, environment: dict[str, str] | None = None
) -> Path:
    """``autodist-plan TARGET ARGUMENTS -o OUTPUT`` in this process, each model traced once per
    session (TARGET relative to the repository unless absolute; ``environment`` set while it
    runs, as a model file may read its sizes there); the plan's path, or AssertionError with
    the command's output.

    >>> plan_command("tests/models/gpt.py", ["--devices", "2", "--device", "cpu"], tmp / "dp2.json")  # doctest: +SKIP
    """
    from autodist.planner.cli import cli

    root = Path(__file__).resolve().parents[2]
    command = [str(root / target), *arguments, "-o", str(output)]
    with mock.patch.dict(os.environ, environment or {}), mock.patch.object(driver, "plan_target", plan_target):
        done = CliRunner().invoke(cli, command)
    assert done.exit_code == 0, f"autodist-plan {' '.join(command)}: {done.exception!r}\n{done.output[-3000:]}"
    return output


def gloo_mp2_request(dp: int = 1, **extra) -> SearchRequest:
    """dp x mp2 on one node of ``2 * dp`` devices as the CPU's gloo backend runs it (no sequence
    parallelism, no pipeline, no ZeRO unless asked: gloo runs it through the harness's stand-in),
    for the harness's loader batch; ``extra``: any other field (``recompute``, ``micro_batches``,
    ``sharding_stage``)."""
    from harness.workloads import BATCH

    fields = dict(devices_per_node=2 * dp, dp=dp, mp=2, pp=1, sharding_stage=0, sequence_parallel=False)
    return SearchRequest(**{**fields, "global_batch_size": BATCH, **extra})
