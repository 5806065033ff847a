"""Build, run and check a set of training configurations in as few launches as possible.

A test module names its configurations as (dp, mp, optimizer); :func:`train_configurations`
writes one plan per mesh, trains every configuration of the same world size in one job, and
returns per configuration the plan and each rank's output, ready for the checks.

Example::

    >>> results = train_configurations("paddleformers_llama", [(1, 2, "sgd")], tmp)   # doctest: +SKIP
    >>> check_against_reference(results["mp2_sgd"], reference_runs)                    # doctest: +SKIP
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from autodist.schemas import Plan, load_plan

from .compare import assert_same_training, layout_differences
from .jobs import TrainRun
from .plans import tensor_parallel_plan, write_plan
from .runner import ReferenceRuns, train_distributed
from .workloads import WORKLOADS


@dataclass
class Trained:
    run: TrainRun
    plan: Plan
    outputs: list[dict]


def config_name(dp: int, mp: int, optimizer: str) -> str:
    mesh = "_".join(f"{name}{size}" for name, size in (("dp", dp), ("mp", mp)) if size > 1)
    return f"{mesh}_{optimizer}"


def train_configurations(
    workload: str, configs: list[tuple[int, int, str]], workdir: Path, nodes: int = 1
) -> dict[str, Trained]:
    """Train every (dp, mp, optimizer) configuration with a hand-written plan; one job per
    world size."""
    model = WORKLOADS[workload].build(seed=0)  # only its parameter names and shapes are used
    plans: dict[tuple[int, int], str] = {}
    runs_by_world: dict[int, list[TrainRun]] = {}
    for dp, mp, optimizer in configs:
        if (dp, mp) not in plans:
            plan = tensor_parallel_plan(model, dp=dp, mp=mp, nodes=nodes)
            plans[(dp, mp)] = write_plan(plan, workdir / f"plan_dp{dp}_mp{mp}.json")
        run = TrainRun(config_name(dp, mp, optimizer), workload, optimizer=optimizer, plan=plans[(dp, mp)])
        runs_by_world.setdefault(dp * mp, []).append(run)
    trained = {}
    for world, runs in sorted(runs_by_world.items()):
        outputs = train_distributed(runs, world, workdir / f"world{world}", nodes=nodes)
        for run in runs:
            trained[run.name] = Trained(run, load_plan(run.plan), outputs[run.name])
    return trained


def check_against_reference(trained: Trained, reference_runs: ReferenceRuns) -> None:
    """The plan was really applied on every rank, and training matched the single device."""
    problems = [line for out in trained.outputs for line in layout_differences(trained.plan, out)]
    assert not problems, f"{trained.run.name}: parameters not laid out as planned:\n  " + "\n  ".join(problems)
    assert_same_training(trained.run.name, reference_runs.get(trained.run), trained.outputs)
