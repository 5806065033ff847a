"""Run jobs from a test: write the job file, start the ranks, read back what each rank wrote.

Example::

    >>> outputs = train_distributed([TrainRun("mp2", "paddleformers_llama", plan=p)], 2, tmp)  # doctest: +SKIP
    >>> reference = ReferenceRuns(tmp).get(TrainRun("mp2", ...))                               # doctest: +SKIP
    >>> assert_same_training("mp2", reference, outputs["mp2"])                                  # doctest: +SKIP
"""

from __future__ import annotations

import json
from pathlib import Path

from .jobs import BadPlanCase, Job, TrainRun, output_path
from .launcher import JobResult, launch_nodes, launch_ranks
from .workloads import BATCH

RANK_MODULE = ["-m", "harness.rank_main"]
#: paddle.distributed.launch takes a script path, not ``-m``.
RANK_SCRIPT = [str(Path(__file__).with_name("rank_main.py"))]


def start_job(
    job: Job,
    nranks: int,
    workdir: Path,
    timeout_s: float = 180.0,
    nodes: int = 1,
    backend: str = "gloo",
    paddle_launch: bool = False,
    **launch,
) -> JobResult:
    """Start ``job`` on ``nranks`` ranks (over ``nodes`` simulated machines when > 1, each with
    its own ``paddle.distributed.launch``; with ``paddle_launch`` under it even on one node);
    ``launch`` goes to :func:`launch_ranks` (``extra_env``, ``failure_grace_s``)."""
    Path(job.out_dir).mkdir(parents=True, exist_ok=True)
    job_file = job.save(workdir / "job.json")
    if nodes > 1 or paddle_launch:
        return launch_nodes(nodes, nranks // nodes, [*RANK_SCRIPT, str(job_file)], workdir, timeout_s)
    return launch_ranks(nranks, [*RANK_MODULE, str(job_file)], workdir, timeout_s, backend=backend, **launch)


def read_outputs(out_dir: str | Path, name: str, nranks: int) -> list[dict]:
    return [json.loads(output_path(out_dir, name, r).read_text()) for r in range(nranks)]


def train_distributed(
    runs: list[TrainRun],
    nranks: int,
    workdir: Path,
    timeout_s: float = 240.0,
    nodes: int = 1,
    backend: str = "gloo",
) -> dict[str, list[dict]]:
    """Train every run in turn in one ``nranks``-rank job; ``{run name: [rank 0 output, ...]}``.
    A failed or hung job raises AssertionError with the failed ranks' stderr."""
    job = Job(out_dir=str(workdir / "out"), train=list(runs))
    retry = {"retry_rendezvous": True} if nodes == 1 else {}  # a run must succeed: see launch_ranks
    start_job(job, nranks, workdir, timeout_s, nodes, backend, **retry).raise_for_failure()
    return {run.name: read_outputs(job.out_dir, run.name, nranks) for run in runs}


def train_by_world(
    runs: list[tuple[TrainRun, int]],
    workdir: Path,
    timeout_s: float = 240.0,
    references: tuple[ReferenceRuns, list[TrainRun]] | None = None,
) -> dict[str, list[dict]]:
    """Every run (with its number of ranks), one job per world size; ``{run name: outputs}``.
    ``references``: (the session's ReferenceRuns, runs to compare): the single-device runs they
    need that were not made yet train in this call's one-process job (one launch fewer)."""
    singles = references[0].missing(references[1]) if references else []
    everything = runs + [(single, 1) for single in singles]
    outputs = {}
    for world in sorted({w for _, w in everything}):
        group = [run for run, w in everything if w == world]
        outputs.update(train_distributed(group, world, workdir / f"world{world}", timeout_s))
    if references:
        references[0].record({single.name: outputs.pop(single.name) for single in singles})
    return outputs


def check_bad_plans(
    cases: list[BadPlanCase], nranks: int, workdir: Path, timeout_s: float = 120.0, let_escape: bool = False, **launch
) -> tuple[JobResult, list[dict]]:
    """Run the bad-plan cases on ``nranks`` ranks; (the job, each rank's ``{case: result}``)."""
    job = Job(out_dir=str(workdir / "out"), bad_plans=list(cases), let_plan_error_escape=let_escape)
    result = start_job(job, nranks, workdir, timeout_s, **launch)
    files = [Path(job.out_dir) / f"bad_plans.rank{r}.json" for r in range(nranks)]
    return result, [json.loads(f.read_text()) if f.exists() else {} for f in files]


def reference_key(run: TrainRun) -> str:
    """Runs that differ only in how they are distributed share one single-device reference;
    a run resumed from a checkpoint is compared with the uninterrupted run up to its last step."""
    key = f"{run.workload}-{run.optimizer}-{run.first_step + run.steps}steps-seed{run.seed}"
    return key + (f"-batch{run.batch}" if run.batch != BATCH else "")


class ReferenceRuns:
    """Single-device results, computed once per configuration (one process for a whole batch).

    Example::

        >>> refs = ReferenceRuns(tmp_path)             # doctest: +SKIP
        >>> refs.prepare(runs); refs.get(runs[0])["losses"]   # doctest: +SKIP
    """

    def __init__(self, workdir: Path):
        self.workdir = workdir
        self.results: dict[str, dict] = {}

    def missing(self, runs: list[TrainRun]) -> list[TrainRun]:
        """The single-device runs ``runs`` are compared with that are not made yet, each named
        by its :func:`reference_key` (for :meth:`record`)."""
        todo = {reference_key(r): r for r in runs if reference_key(r) not in self.results}
        return [
            TrainRun(
                key,
                r.workload,
                optimizer=r.optimizer,
                method="single",
                steps=r.first_step + r.steps,
                seed=r.seed,
                batch=r.batch,
            )
            for key, r in todo.items()
        ]

    def record(self, outputs: dict[str, list[dict]]) -> None:
        """The outputs of :meth:`missing`'s runs, however they were launched."""
        self.results.update({key: out[0] for key, out in outputs.items()})

    def prepare(self, runs: list[TrainRun]) -> None:
        singles = self.missing(runs)
        if singles:
            self.record(train_distributed(singles, 1, self.workdir / f"reference{len(self.results)}"))

    def get(self, run: TrainRun) -> dict:
        self.prepare([run])
        return self.results[reference_key(run)]
