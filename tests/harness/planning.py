"""The planner for the tests, with each model file traced once per session.

Tracing (2-7 s a model on the 2-core machine) is most of a plan's time, and the tests plan the
same zoo files many times, for different requests, in several modules. :func:`plan_target` is
the driver's, with the load, trace and analysis of a ``(target, input specs, environment)``
kept for the session (a model file may read the environment, as the docstring Llama reads its
sizes): what follows them (cost, search, emit) is run for every call, as the driver runs it
(:func:`autodist.planner.driver.plan_analysed`). A failed load or trace is not kept (it raises
again). Rules change the analysis, so a call with rules plans without the cache.

The planner's own tests of loading and tracing call the driver directly.
"""

from __future__ import annotations

import functools
import os
from typing import Sequence

from autodist.planner import driver


@functools.cache
def _analysed(target: str, input_specs: tuple[str, ...] | None, environment: tuple[tuple[str, str], ...]):
    loaded = driver.load(target, input_specs)
    traced = driver.trace(loaded.model, loaded.input_specs)
    return traced, driver.analyse(loaded.model, traced)


def plan_target(
    target: str,
    input_specs: Sequence[str] | None,
    request,
    arguments: dict[str, str],
    progress=None,
    rules: dict[str, str] | None = None,
) -> driver.PlannedModel:
    """:func:`autodist.planner.driver.plan_target`, tracing each model once."""
    if rules:
        return driver.plan_target(target, input_specs, request, arguments, progress, rules)
    specs = tuple(input_specs) if input_specs else None
    environment = tuple(sorted((k, v) for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"))
    traced, analysis = _analysed(target, specs, environment)
    return driver.plan_analysed(analysis, traced, request, arguments, progress)
