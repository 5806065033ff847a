"""Build, run and check a set of training configurations in as few launches as possible.

A test module lists :class:`Config` s; :func:`train_configurations` writes one plan per
distinct layout, trains every configuration of the same world size in one job, and returns per
configuration the plan and each rank's output, ready for :func:`check_against_reference`.

Example::

    >>> results = train_configurations("paddleformers_llama", [Config(mp=2)], tmp)   # doctest: +SKIP
    >>> check_against_reference(results["mp2_sgd"], reference_runs)                   # doctest: +SKIP
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from autodist.schemas import Plan, load_plan

from .compare import assert_same_training, layout_differences
from .jobs import TrainRun
from .plans import tensor_parallel_plan, write_plan
from .workloads import BATCH
from .runner import ReferenceRuns, train_distributed
from .workloads import WORKLOADS, Workload


#: The cpu profile without its backend limits: planner-made test plans may ask for what gloo
#: lacks, which the harness's TEST-ONLY stand-ins then supply.
CPU_WITH_STAND_INS = Path(__file__).with_name("cpu_with_stand_ins.toml")


@dataclass(frozen=True)
class Config:
    """One way to distribute and train; ``reshard="via_replicate"`` asks for the TEST-ONLY CPU
    stand-in of :mod:`harness.cpu_substitutes`."""

    dp: int = 1
    mp: int = 1
    pp: int = 1
    optimizer: str = "sgd"
    sequence_parallel: bool = False
    sharding_stage: int = 0
    reshard: str = "paddle"
    #: For pp > 1 (planner plans): the schedule, and the P2P of the run ("blocking": the
    #: TEST-ONLY CPU stand-in, see harness.cpu_substitutes).
    schedule: str | None = None
    p2p: str = "paddle"
    #: "hand": :func:`harness.plans.tensor_parallel_plan`; "planner": ``autodist-plan`` with
    #: these degrees fixed (its placements and hooks are then the ones under test).
    plan_source: str = "hand"
    #: Micro-batches per optimizer step (the plan's ``micro_batches``: gradient-accumulation
    #: steps, or with pp the pipeline's micro-batches), and the samples per optimizer step.
    micro_batches: int = 1
    batch: int = BATCH
    #: Activation recompute (planner plans only): "none", "selective" or "full".
    recompute: str = "none"

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.mp

    @property
    def name(self) -> str:
        parts = ["planner"] * (self.plan_source == "planner")
        parts += [f"{dim}{size}" for dim, size in (("pp", self.pp), ("dp", self.dp), ("mp", self.mp)) if size > 1]
        parts += ["sp"] * self.sequence_parallel + [f"zero{self.sharding_stage}"] * bool(self.sharding_stage)
        parts += [f"m{self.micro_batches}"] * (self.micro_batches > 1) + [f"batch{self.batch}"] * (self.batch != BATCH)
        parts += [f"recompute_{self.recompute}"] * (self.recompute != "none")
        parts += [self.schedule] if self.schedule else []
        parts += [self.optimizer] + ["via_replicate"] * (self.reshard == "via_replicate")
        return "_".join(parts)

    def planner_arguments(self, nodes: int = 1) -> list[str]:
        return [
            f"--devices={self.world // nodes}", f"--nodes={nodes}", f"--cluster={CPU_WITH_STAND_INS}",
            f"--dp={self.dp}", f"--mp={self.mp}", f"--pp={self.pp}", f"--sharding-stage={self.sharding_stage}",
            "--sequence-parallel" if self.sequence_parallel else "--no-sequence-parallel",
            f"--micro-batches={self.micro_batches}", f"--global-batch-size={self.batch}",
            f"--recompute={self.recompute}",
        ] + [f"--schedule={self.schedule}"] * bool(self.schedule)  # fmt: skip

    def hand_written_plan(self, model, nodes: int = 1) -> Plan:
        return tensor_parallel_plan(
            model,
            dp=self.dp,
            mp=self.mp,
            pp=self.pp,
            nodes=nodes,
            sequence_parallel=self.sequence_parallel,
            sharding_stage=self.sharding_stage,
            micro_batches=self.micro_batches,
        )


@dataclass
class Trained:
    run: TrainRun
    plan: Plan
    outputs: list[dict]


def train_configurations(
    workload: str, configs: list[Config], workdir: Path, nodes: int = 1, backend: str = "gloo"
) -> dict[str, Trained]:
    """Train every configuration with its plan (hand-written, or from ``autodist-plan``); one
    job per world size."""
    model = WORKLOADS[workload].build(seed=0)  # only its parameter names and shapes are used
    by_world: dict[int, list[Config]] = {}
    for config in configs:
        by_world.setdefault(config.world, []).append(config)
    trained = {}
    for world, group in sorted(by_world.items()):
        runs = []
        for config in group:
            path = workdir / f"plan_{config.name}.json"
            if config.plan_source == "planner":
                plan = planned(WORKLOADS[workload], config.planner_arguments(nodes), path)
            else:
                plan = write_plan(config.hand_written_plan(model, nodes), path)
            runs.append(
                TrainRun(
                    config.name,
                    workload,
                    optimizer=config.optimizer,
                    plan=plan,
                    reshard=config.reshard,
                    batch=config.batch,
                    p2p=config.p2p,
                )
            )
        outputs = train_distributed(runs, world, workdir / f"world{world}", nodes=nodes, backend=backend)
        for run in runs:
            trained[run.name] = Trained(run, load_plan(run.plan), outputs[run.name])
    return trained


def train_planned(cases: list[tuple[str, Config]], workdir: Path, backend: str = "gloo") -> dict[str, Trained]:
    """Plan every ``(workload, config)`` with ``autodist-plan``, then train them all in one job of
    their common world size; keyed by workload."""
    worlds = {config.world for _, config in cases}
    assert len(worlds) == 1, f"one job needs one world size, got {sorted(worlds)}"
    runs = {
        w: TrainRun(
            f"{w}_{c.name}",
            w,
            optimizer=c.optimizer,
            plan=planned(WORKLOADS[w], c.planner_arguments(), workdir / f"plan_{w}.json"),
            reshard=c.reshard,
            batch=c.batch,
            p2p=c.p2p,
        )
        for w, c in cases
    }
    outputs = train_distributed(list(runs.values()), worlds.pop(), workdir / "job", backend=backend)
    return {w: Trained(run, load_plan(run.plan), outputs[run.name]) for w, run in runs.items()}


def planned(workload: Workload, arguments: list[str], path: Path) -> str:
    """``autodist-plan`` on the workload's model file, with its environment, run in this process
    (harness.planning.plan_command: each model traced once per session, where a planner process
    for each plan imported Paddle and traced it again); the plan's path."""
    from .planning import plan_command

    return str(plan_command(workload.planner_target, arguments, path, workload.planner_env))


def check_against_reference(trained: Trained, reference_runs: ReferenceRuns) -> None:
    """The plan was really applied on every rank, and training matched the single device."""
    problems = [line for out in trained.outputs for line in layout_differences(trained.plan, out)]
    assert not problems, f"{trained.run.name}: not laid out as planned:\n  " + "\n  ".join(problems)
    assert_same_training(trained.run.name, reference_runs.get(trained.run), trained.outputs)
