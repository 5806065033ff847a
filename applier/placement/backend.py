"""Refuse a plan the running collectives backend cannot run, before anything is touched.

Paddle 3.3.1's gloo backend (CPU) lacks reduce-scatter, all-to-all, a reshard between two
meshes and batched P2P (schemas/backend.py says which plan features need which, and what
happens instead: an exception deep inside Paddle, a segfault, or a hang until gloo's timeout).
``apply_plan`` names the feature and the backend in one ``PlanError`` on every rank instead.

A caller that supplies an operation itself says so (``apply_plan(..., stand_ins=...)``): the
test harness's TEST-ONLY detours (tests/harness/cpu_substitutes.py) do reduce-scatter and
all-to-all through Replicate and batched P2P as blocking send/recv.

    >>> from autodist.schemas import load_plan
    >>> plan = load_plan("plans/gpt/plan_2x8dev_mp4.json")       # dp4 x mp4 with sequence parallelism
    >>> [line.split(",")[0] for line in lacking(plan, "gloo", stand_ins=())]
    ['$.strategy: sequence parallelism needs reduce-scatter', '$.strategy: sequence parallelism needs all-to-all']
    >>> lacking(plan, "gloo", stand_ins=("reduce_scatter", "all_to_all"))
    []
"""

from __future__ import annotations

import os
from typing import Collection

import paddle

from autodist.schemas import Plan
from autodist.schemas.backend import refusals
from autodist.schemas.parallel_dims import LACKS, OPERATIONS


def running_backend() -> str:
    """The collectives backend this job runs on, as ``paddle.distributed.init_parallel_env``
    picks it: ``PADDLE_DISTRI_BACKEND``, else nccl where Paddle has CUDA and gloo where not."""
    name = os.environ.get("PADDLE_DISTRI_BACKEND", "auto")
    if name == "auto":
        name = "nccl" if paddle.is_compiled_with_cuda() else "gloo"
    return name


def lacking(plan: Plan, backend: str, stand_ins: Collection[str]) -> list[str]:
    """Why ``backend`` cannot run ``plan`` (:func:`~autodist.schemas.backend.refusals`), empty when it can."""
    unknown = sorted(set(stand_ins) - set(OPERATIONS))
    problems = [f"stand_ins: unknown operation(s) {unknown}; known: {', '.join(OPERATIONS)}"] if unknown else []
    missing = {operation: why for operation, why in LACKS.get(backend, {}).items() if operation not in stand_ins}
    fix = "re-plan for this machine (autodist-plan --device cpu) or run on GPUs"
    return problems + refusals(plan.strategy, list(plan.mesh.axes), plan.hooks, missing, f"the {backend} backend", fix)
