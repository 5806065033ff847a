"""What a job asks each rank to do, and what each rank writes back: plain JSON both ways.

Example::

    >>> run = TrainRun(name="mp2_sgd", workload="paddleformers_llama", plan="/tmp/mp2.json")
    >>> TrainRun(**json.loads(json.dumps(asdict(run)))) == run
    True
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

#: How a run distributes the model before training.
METHODS = ("single", "autodist", "to_distributed")
RESHARDS = ("paddle", "via_replicate")
SAVE_FAULTS = ("kill", "no_space")
P2PS = ("paddle", "blocking")
#: How a run builds its model: eagerly, under ``paddle.LazyGuard()`` or ``autodist.LazyGuard()``.
BUILDS = ("eager", "paddle_lazy", "autodist_lazy")


@dataclass(frozen=True)
class TrainRun:
    """One training configuration: every rank builds, distributes, trains and reports it."""

    name: str
    workload: str
    optimizer: str = "sgd"
    method: str = "autodist"
    plan: str | None = None  # path of the plan file (method "autodist")
    steps: int = 3
    seed: int = 2024
    #: Samples per optimizer step (the plan's global batch).
    batch: int = 4
    #: "paddle": plain ``dist.reshard``. "via_replicate": the TEST-ONLY CPU stand-in of
    #: :mod:`harness.cpu_substitutes` for the P->S / S(i)->S(j) reshards gloo cannot do.
    reshard: str = "paddle"
    #: Checkpoints: a resumed run loads ``load_checkpoint`` (saved at step ``first_step``) after
    #: distributing, then trains batches ``first_step ..`` of the same data; ``save_checkpoint``
    #: is written after training, at step ``first_step + steps``.
    first_step: int = 0
    load_checkpoint: str | None = None
    save_checkpoint: str | None = None
    #: TEST-ONLY: rank ``save_fault_rank`` breaks half-way through writing its part of the
    #: save: "kill" (SIGKILL itself, as a killed job) or "no_space" (the write fails, ENOSPC).
    save_fault: str | None = None
    save_fault_rank: int = 0
    #: "paddle": the pipeline schedules' own ``batch_isend_irecv``. "blocking": the TEST-ONLY
    #: CPU stand-in :func:`harness.cpu_substitutes.blocking_p2p` (gloo times out on Paddle's).
    p2p: str = "paddle"
    #: One of BUILDS: a lazily built model is initialised by apply_plan (applier/placement/lazy.py).
    build: str = "eager"

    def __post_init__(self):
        # A typo in a test's configuration fails here, not later inside every rank.
        if self.method not in METHODS or self.reshard not in RESHARDS or self.p2p not in P2PS:
            raise ValueError(
                f"{self.name}: method must be one of {METHODS}, reshard one of {RESHARDS}, p2p one of {P2PS}"
            )
        if self.build not in BUILDS or (self.build != "eager" and self.method != "autodist"):
            raise ValueError(f"{self.name}: build must be one of {BUILDS}, lazy ones with method 'autodist'")
        if (self.method == "autodist") != (self.plan is not None):
            raise ValueError(f"{self.name}: a plan is needed by method 'autodist' and only by it")
        if (self.first_step > 0) != (self.load_checkpoint is not None):
            raise ValueError(f"{self.name}: a run starts after step 0 when, and only when, it loads a checkpoint")
        if self.save_fault not in (None, *SAVE_FAULTS) or (self.save_fault and not self.save_checkpoint):
            raise ValueError(f"{self.name}: save_fault is one of {SAVE_FAULTS} and needs a save_checkpoint")


@dataclass(frozen=True)
class BadPlanCase:
    """A plan every rank must refuse with a PlanError whose message contains ``expect``.

    Ranks can be made to disagree: rank ``r`` uses ``rank_plans[r]`` / ``rank_workloads[r]``
    when given; rank ``die_on_rank`` SIGKILLs itself inside ``apply_plan``, rank
    ``late_reader_rank`` reads the agreement's verdict only ``LATE_READ_S`` after it arrives,
    and rank ``fail_applying_rank`` raises a RuntimeError when it starts sharding, after the
    ranks agreed (all TEST-ONLY)."""

    name: str
    workload: str
    plan: str
    expect: str
    rank_plans: list[str] = field(default_factory=list)
    rank_workloads: list[str] = field(default_factory=list)
    die_on_rank: int | None = None
    late_reader_rank: int | None = None
    fail_applying_rank: int | None = None


@dataclass
class Job:
    out_dir: str
    train: list[TrainRun] = field(default_factory=list)
    bad_plans: list[BadPlanCase] = field(default_factory=list)
    #: Bad-plan cases are caught and recorded; with this set, the first one is left to
    #: propagate, so the rank exits non-zero as a user's job would.
    let_plan_error_escape: bool = False

    def save(self, path: Path) -> Path:
        path.write_text(json.dumps(asdict(self), indent=1))
        return path

    @classmethod
    def load(cls, path: str | Path) -> Job:
        raw = json.loads(Path(path).read_text())
        return cls(
            out_dir=raw["out_dir"],
            train=[TrainRun(**r) for r in raw["train"]],
            bad_plans=[BadPlanCase(**c) for c in raw["bad_plans"]],
            let_plan_error_escape=raw["let_plan_error_escape"],
        )


def output_path(out_dir: str | Path, run_name: str, rank: int) -> Path:
    return Path(out_dir) / f"{run_name}.rank{rank}.json"
