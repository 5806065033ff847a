"""Refuse a plan the running collectives backend cannot run, before anything is touched.

Paddle 3.3.1's gloo backend (CPU) lacks reduce-scatter, all-to-all, a reshard between two
meshes and batched P2P (schemas/backend.py says which plan features need which, and what
happens instead: an exception deep inside Paddle, a segfault, or a hang until gloo's timeout).
``apply_plan`` names the feature and the backend in one ``PlanError`` on every rank instead.

A caller that supplies an operation itself says so (``apply_plan(..., stand_ins=...)``): the
test harness's TEST-ONLY detours (tests/harness/cpu_substitutes.py) do reduce-scatter and
all-to-all through Replicate and batched P2P as blocking send/recv.

    >>> from autodist.schemas.plan import Strategy
    >>> lacking(Strategy(dp=2, sharding_stage=1), "gloo", stand_ins=())  # doctest: +ELLIPSIS
    ['$.strategy: ZeRO stage 1 needs reduce-scatter, which the gloo backend lacks (its CPU kernel ...']
    >>> lacking(Strategy(dp=2, sharding_stage=1), "gloo", stand_ins=("reduce_scatter",))
    []
"""

from __future__ import annotations

import os
from typing import Collection

import paddle

from autodist.schemas import Strategy
from autodist.schemas.backend import LACKS, OPERATIONS, needs_missing


def running_backend() -> str:
    """The collectives backend this job runs on, as ``paddle.distributed.init_parallel_env``
    picks it: ``PADDLE_DISTRI_BACKEND``, else nccl where Paddle has CUDA and gloo where not."""
    name = os.environ.get("PADDLE_DISTRI_BACKEND", "auto")
    if name == "auto":
        name = "nccl" if paddle.is_compiled_with_cuda() else "gloo"
    return name


def lacking(strategy: Strategy, backend: str, stand_ins: Collection[str]) -> list[str]:
    """Why ``backend`` cannot run ``strategy`` (one line per operation), empty when it can."""
    unknown = sorted(set(stand_ins) - set(OPERATIONS))
    problems = [f"stand_ins: unknown operation(s) {unknown}; known: {', '.join(OPERATIONS)}"] if unknown else []
    lacks = LACKS.get(backend, {})
    features: dict[str, list[str]] = {}
    for feature, operation in needs_missing(strategy, set(lacks) - set(stand_ins)):
        features.setdefault(operation, []).append(feature)
    for operation, names in features.items():
        problems.append(
            f"$.strategy: {' and '.join(dict.fromkeys(names))} needs {OPERATIONS[operation]}, which the {backend} "
            f"backend lacks ({lacks[operation]}); re-plan for this machine (autodist-plan --device cpu) "
            "or run on GPUs"
        )
    return problems
