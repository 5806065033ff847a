"""``autodist-run``: a training job that goes on when the cluster changes (one machine).

It launches the user's unchanged script with ``python -m paddle.distributed.launch`` under the
plan of a *family* (plans for several device counts, made ahead of time and kept in git), for
the devices it has. When a rank dies, Paddle's launcher stops the others at once (measured:
within 2 s, no rank left in a collective); the supervisor reads which rank failed from the
launcher's own report, drops that rank's device, takes the family's plan for the devices left
(the largest count a plan fits: 3 of 4 devices for a model whose heads split only by 2 run 2),
and launches again. The script resumes from its last complete checkpoint, as it already can:
checkpoints load under any plan, and every plan keeps the global batch, so the job trains
exactly as one device would, whatever it shrank to. With ``--grow``, a lost device is taken
back once the smaller job has committed a newer checkpoint: the job is stopped there and
launched again on every device.

    autodist-run --nproc-per-node 4 --plans plans/family --checkpoint ckpt \\
        train.py --plan {plan} --ckpt ckpt

``{plan}`` in the script's arguments becomes the chosen plan's path (``AUTODIST_PLAN`` holds it
too). The script resumes the way docs/checkpoints.md shows (``load_checkpoint(..., loader=loader)``
when the checkpoint exists: the loader starts at the first batch not trained on). One line per event goes
to stderr (a rank lost, how far its launch got past the last checkpoint, re-planned to dp2,
resumed at step 6, grown back), and a summary at the end: the launches, the time lost (what
interrupted launches ran after their last checkpoint) and the steps trained again (what they
finished after it: rank 0's loader reports each step finished, when the next batch is asked for
or a checkpoint saved with ``loader=``, in ``AUTODIST_RUN_PROGRESS``).

On several machines (``--nnodes N`` or ``MIN:MAX``, ``--master``), membership is Paddle's
launcher's, its elastic mode for a range (:func:`several_nodes`); each rank runs the script under
the family's plan for the job's world size (:func:`as_rank`). What is tested here is one machine
(gloo, CPU ranks as devices; two launchers on loopback as two nodes), not the elastic mode
(docs/workflow.md, "On several machines").

Example::

    >>> family = Family.read("plans/llama_docstring")             # plan_2dev.json, plan_4dev.json, ...
    >>> family.sizes
    [2, 4, 8]
    >>> family.largest(3)[0]     # 3 devices left: the family's largest plan that fits runs 2
    2
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from autodist.schemas import PlanError, load_plan
from autodist.schemas.checkpoint import METADATA_FILE, PROGRESS_ENV, CheckpointError, read_checkpoint
from autodist.schemas.describe import strategy_text

#: The launcher's report of a rank that failed (Paddle 3.3's ``controllers/controller.py``):
#: ``Container rank 1 status failed cmd [...] code -9 log ...``.
_FAILED_RANK = re.compile(r"Container rank (\d+) status failed .* code (-?\d+)")
#: How often the supervisor looks at the job and the checkpoint.
POLL_S = 0.2
#: After SIGTERM, how long a stopped job gets before it is killed.
STOP_GRACE_S = 10.0


class RunError(RuntimeError):
    """The job cannot go on (no plan fits the devices left, too many restarts); one line."""


@dataclass
class Family:
    """Plans of one model for several device counts, by world size (the plan's mesh)."""

    plans: dict[int, Path]

    @classmethod
    def read(cls, folder: str | os.PathLike) -> Family:
        """Every plan (``*.json``) in ``folder``; two for one device count is an error."""
        plans: dict[int, Path] = {}
        for path in sorted(Path(folder).glob("*.json")):
            try:
                plan = load_plan(path)
            except PlanError:
                continue  # not a plan (a README, a config)
            size = len(plan.mesh.process_ids)
            if size in plans:
                raise RunError(f"{folder}: {plans[size].name} and {path.name} are both plans for {size} devices")
            plans[size] = path
        if not plans:
            raise RunError(f"{folder}: no plan in it (make one per device count with autodist-plan --devices N)")
        return cls(plans)

    @property
    def sizes(self) -> list[int]:
        return sorted(self.plans)

    def largest(self, devices: int) -> tuple[int, Path]:
        """The plan for the most devices that fit in ``devices``."""
        fits = [size for size in self.sizes if size <= devices]
        if not fits:
            raise RunError(f"no plan of the family fits {devices} device(s): it has plans for {self.sizes}")
        return fits[-1], self.plans[fits[-1]]


@dataclass
class Launch:
    """One launch of the job, as the summary counts it."""

    devices: list[int]
    plan: Path
    resumed_at: int | None  # the checkpoint's step it started from (None: from the start)
    started: float
    ended: float = 0.0
    outcome: str = ""  # "finished", "lost rank N", "stopped to grow"
    last_checkpoint: tuple[int | None, float] = (None, 0.0)  # (step, when it was first seen)
    #: Steps it finished after the checkpoint the next launch resumes from: trained again.
    recomputed: int = 0

    def reached(self, progress: Path) -> int | None:
        """The last step this launch finished, from rank 0's loader's report (None: no report)."""
        try:
            done = int(progress.read_text())
        except (OSError, ValueError):
            return None
        return (self.resumed_at or 0) + done


@dataclass
class Supervisor:
    """Launch, watch, re-plan, launch again. ``devices``: the device ids this node may use; with
    ``gpus`` they are GPU ids, each launch passed the healthy ones (Paddle's launcher ``--devices``),
    so a lost GPU is not used again; without, CPU slots 0..N-1, only their number matters.

    >>> sup = Supervisor(["train.py"], Family({2: Path("p2.json")}), [0, 1, 2, 3], None, gpus=True)
    >>> sup.command(Launch([0, 1, 3], Path("p2.json"), None, 0.0), Path("log/launch1"))[3:7]
    ['--nproc_per_node', '3', '--devices', '0,1,3']
    >>> "--devices" in Supervisor(["train.py"], Family({}), [0, 1], None).command(Launch([0, 1], Path("p"), None, 0.0), Path("l"))
    False
    """

    script: list[str]
    family: Family
    devices: list[int]
    checkpoint: Path | None
    gpus: bool = False
    grow: bool = False
    max_restarts: int = 3
    log_dir: Path = Path("log")
    say: Callable[[str], None] = lambda line: print(f"autodist-run: {line}", file=sys.stderr, flush=True)
    launches: list[Launch] = field(default_factory=list)

    def run(self) -> int:
        healthy, lost = list(self.devices), list[int]()
        while True:
            size, plan_path = self.family.largest(len(healthy))
            if size < len(healthy):
                self.say(
                    f"{len(healthy)} devices, but the family's largest plan that fits is for {size}: running {size}"
                )
            launch = Launch(healthy[:size], plan_path, self._checkpoint_step(), time.monotonic())
            self.launches.append(launch)
            strategy = strategy_text(load_plan(plan_path).strategy, "short")
            resumed = f", resuming at step {launch.resumed_at}" if launch.resumed_at is not None else ""
            self.say(f"launch {len(self.launches)}: {size} ranks under {plan_path.name} ({strategy}){resumed}")
            failed, grown = self._watch(launch, bool(self.grow and lost))
            launch.ended = time.monotonic()
            if failed or grown:
                self._count_recomputed(launch)
            if grown:
                launch.outcome = "stopped to grow"
                self.say(f"checkpoint at step {launch.last_checkpoint[0]}: taking back device(s) {lost}")
                healthy, lost = sorted(healthy + lost), []
                continue
            if failed is None:
                launch.outcome = "finished"
                self._summary()
                return 0
            culprits = [launch.devices[rank] for rank, _ in failed if rank < len(launch.devices)]
            launch.outcome = "lost " + ", ".join(f"rank {rank} (exit code {code})" for rank, code in failed)
            self.say(f"{launch.outcome}: dropping device(s) {culprits}")
            if not culprits:  # the launcher said nothing we can read: no device to blame
                self._summary()
                raise RunError(f"launch {len(self.launches)} failed without naming a rank: see {self.log_dir}")
            if len(self.launches) > self.max_restarts:
                self._summary()
                raise RunError(f"{self.max_restarts} restarts used up (--max-restarts)")
            healthy = [d for d in healthy if d not in culprits]
            lost += culprits

    def command(self, launch: Launch, log: Path) -> list[str]:
        """The launcher's command for ``launch``: its ranks on its devices, its plan in the script's
        ``{plan}``."""
        plan = str(launch.plan.resolve())
        devices = ["--devices", ",".join(map(str, launch.devices))] if self.gpus else []
        return [
            sys.executable, "-m", "paddle.distributed.launch",
            "--nproc_per_node", str(len(launch.devices)), *devices,
            "--log_dir", str(log),
            *[a.replace("{plan}", plan) for a in self.script],
        ]  # fmt: skip

    def _watch(self, launch: Launch, may_grow: bool) -> tuple[list[tuple[int, int]] | None, bool]:
        """Run ``launch`` until it ends: ``(failed ranks and codes, or None, stopped to grow)``."""
        log = self._launch_dir(len(self.launches))
        log.mkdir(parents=True, exist_ok=True)
        command = self.command(launch, log)
        env = {
            **os.environ,
            "AUTODIST_PLAN": str(launch.plan.resolve()),
            PROGRESS_ENV: str((log / "progress").resolve()),
        }
        with open(log / "launcher.out", "w") as out:
            proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
            try:
                while proc.poll() is None:
                    step = self._checkpoint_step()
                    if step != launch.last_checkpoint[0]:
                        launch.last_checkpoint = (step, time.monotonic())
                    if may_grow and step is not None and launch.resumed_at is not None and step > launch.resumed_at:
                        _stop(proc)
                        return None, True
                    time.sleep(POLL_S)
            finally:
                if proc.poll() is None:
                    _stop(proc)
        if proc.returncode == 0:
            return None, False
        report = (log / "launcher.out").read_text(errors="replace")
        return [(int(rank), int(code)) for rank, code in _FAILED_RANK.findall(report)], False

    def _count_recomputed(self, launch: Launch) -> None:
        """Say how far the interrupted ``launch`` got past the checkpoint the next one resumes from."""
        reached = launch.reached(self._launch_dir(len(self.launches)) / "progress")
        checkpoint = self._checkpoint_step() or 0
        if reached is None:
            self.say(f"launch {len(self.launches)}: its loader reported no step; steps trained again not known")
            return
        launch.recomputed = max(0, reached - checkpoint)
        self.say(
            f"launch {len(self.launches)} reached step {reached}, its last checkpoint is at step {checkpoint}: "
            f"{launch.recomputed} step(s) to train again"
        )

    def _launch_dir(self, number: int) -> Path:
        return self.log_dir / f"launch{number}"

    def _checkpoint_step(self) -> int | None:
        if self.checkpoint is None or not (self.checkpoint / METADATA_FILE).exists():
            return None
        try:
            return read_checkpoint(self.checkpoint).step
        except CheckpointError:
            return None

    def _summary(self) -> None:
        interrupted = [launch for launch in self.launches if launch.outcome != "finished"]
        lost_s = sum(launch.ended - max(launch.started, launch.last_checkpoint[1]) for launch in interrupted)
        resumed = [launch.resumed_at for launch in self.launches[1:] if launch.resumed_at is not None]
        self.say(
            f"summary: {len(self.launches)} launch(es) on "
            + " -> ".join(str(len(launch.devices)) for launch in self.launches)
            + f" devices; {lost_s:.1f} s of work lost (run after the last checkpoint of interrupted launches);"
            + f" {sum(launch.recomputed for launch in interrupted)} step(s) trained again; resumed at steps {resumed}"
        )


def _stop(proc: subprocess.Popen) -> None:
    """Stop a launch and everything it started (its own session): SIGTERM, then SIGKILL."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass


def several_nodes(
    nnodes: str, master: str | None, job_id: str, family: Path, nproc: int, max_restarts: int, log_dir: Path,
    script: list[str], gpus: list[int] | None = None,
) -> list[str]:  # fmt: skip
    """The command that runs ``script`` on this node of a job on several machines: Paddle's
    launcher keeps the membership (``--nnodes MIN:MAX`` with ``--master etcd://...``: its elastic
    mode, which restarts every rank when a node leaves or joins) and starts :func:`as_rank` on
    each rank, which runs the script under the family's plan for the job's world size. ``gpus``:
    the GPU ids this node uses (the launcher's ``--devices``).

    >>> several_nodes("2:4", "10.0.0.1:2379", "job", Path("plans"), 1, 3, Path("log"), ["train.py"])
    Traceback (most recent call last):
    ...
    autodist.run.RunError: --nnodes 2:4 needs --master etcd://HOST:PORT: Paddle's launcher keeps an elastic job's members in etcd
    """
    low, _, high = nnodes.partition(":")
    if not (low.isdigit() and (high or low).isdigit() and 0 < int(low) <= int(high or low)):
        raise RunError(f"--nnodes {nnodes}: expected N or MIN:MAX, 1 <= MIN <= MAX")
    elastic = bool(high)
    if elastic and not (master or "").startswith("etcd://"):
        raise RunError(
            f"--nnodes {nnodes} needs --master etcd://HOST:PORT: Paddle's launcher keeps an elastic job's members in etcd"
        )
    if not master:
        raise RunError(f"--nnodes {nnodes} needs --master: node 0's HOST:PORT (or etcd://HOST:PORT)")
    sizes = Family.read(family).sizes
    missing = [n * nproc for n in range(int(low), int(high or low) + 1) if n * nproc not in sizes]
    if missing:
        raise RunError(
            f"the family has no plan for {missing} devices (--nnodes {nnodes} x --nproc-per-node {nproc}), only for "
            f"{sizes}: every rank of a node count runs, so make a plan for each (autodist-plan --devices N)"
        )
    return [
        sys.executable, "-m", "paddle.distributed.launch", "--master", master, "--nnodes", nnodes,
        "--nproc_per_node", str(nproc), *(["--devices", ",".join(map(str, gpus))] if gpus else []),
        "--job_id", job_id, "--log_dir", str(log_dir),
        *(["--elastic_level", "1", "--max_restart", str(max_restarts)] if elastic else []),
        str(Path(__file__).resolve()), AS_RANK, str(family.resolve()), *script,
    ]  # fmt: skip


def as_rank(family: str, script: list[str]) -> int:
    """On each rank of a job on several machines: run ``script`` (this process becomes it)
    under the family's plan for the job's world size, ``{plan}`` in its arguments replaced."""
    world = int(os.environ.get("PADDLE_TRAINERS_NUM", "1"))
    plans = Family.read(family).plans
    if world not in plans:
        print(
            f"autodist-run: error: no plan in {family} for {world} devices (plans for {sorted(plans)})", file=sys.stderr
        )
        return 2
    plan = str(plans[world].resolve())
    os.environ["AUTODIST_PLAN"] = plan
    os.execv(sys.executable, [sys.executable, "-u", *(a.replace("{plan}", plan) for a in script)])


#: The first argument of :func:`as_rank`'s command line (Paddle's launcher runs a script's path).
AS_RANK = "--as-rank"


def _device_ids(parser: argparse.ArgumentParser, text: str) -> list[int]:
    """``0,1,3`` as device ids: distinct non-negative integers, or the parser's error."""
    try:
        ids = [int(part) for part in text.split(",")]
    except ValueError:
        ids = []
    if not ids or min(ids) < 0 or len(set(ids)) != len(ids):
        parser.error(f"--devices {text!r}: give distinct GPU ids, such as 0,1,2,3")
    return ids


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == [AS_RANK] and len(argv) > 2:
        return as_rank(argv[1], argv[2:])
    parser = argparse.ArgumentParser(prog="autodist-run", description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc-per-node", "--nproc_per_node", type=int, help="devices on this node (CPU ranks)")
    parser.add_argument(
        "--devices", "--gpus", help="the GPU ids this node may use, as Paddle's launcher takes them: 0,1,2,3"
    )
    parser.add_argument(
        "--nnodes", default="1", help="machines: N, or MIN:MAX for Paddle's elastic mode (with --master etcd://...)"
    )
    parser.add_argument("--master", help="with --nnodes: node 0's HOST:PORT, or etcd://HOST:PORT (elastic)")
    parser.add_argument("--job-id", default="autodist", help="with --nnodes: the job's name in the launcher's master")
    parser.add_argument("--plans", required=True, help="folder of plans for several device counts (the family)")
    parser.add_argument("--checkpoint", help="the checkpoint folder the script saves to (to resume and to grow)")
    parser.add_argument("--grow", action="store_true", help="take lost devices back at the next checkpoint")
    parser.add_argument("--max-restarts", type=int, default=3)
    parser.add_argument("--log-dir", default="log", help="each launch's logs go to LOG_DIR/launchN")
    parser.add_argument("script", nargs=argparse.REMAINDER, help="the training script and its arguments")
    args = parser.parse_args(argv)
    if not args.script:
        parser.error("give the training script to run")
    gpus = _device_ids(parser, args.devices) if args.devices else None
    if gpus is not None and args.nproc_per_node not in (None, len(gpus)):
        parser.error(f"--nproc-per-node {args.nproc_per_node} and --devices {args.devices} disagree")
    if gpus is None and args.nproc_per_node is None:
        parser.error("give --nproc-per-node N (CPU ranks) or --devices 0,1,... (GPUs)")
    devices = gpus if gpus is not None else list(range(args.nproc_per_node))
    try:
        if args.nnodes != "1":
            command = several_nodes(
                args.nnodes, args.master, args.job_id, Path(args.plans), len(devices), args.max_restarts,
                Path(args.log_dir), args.script, gpus,
            )  # fmt: skip
            print(f"autodist-run: on {args.nnodes} nodes through paddle.distributed.launch", file=sys.stderr)
            return subprocess.call(command)
        supervisor = Supervisor(
            script=args.script,
            family=Family.read(args.plans),
            devices=devices,
            checkpoint=Path(args.checkpoint) if args.checkpoint else None,
            gpus=gpus is not None,
            grow=args.grow,
            max_restarts=args.max_restarts,
            log_dir=Path(args.log_dir),
        )
        return supervisor.run()
    except RunError as err:
        print(f"autodist-run: error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
