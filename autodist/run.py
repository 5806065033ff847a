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
resumed at step 6, grown back), and a summary at the end: the launches, the time lost (from the
last checkpoint of each interrupted launch to the next launch) and the steps trained again (what
they finished after it: the first rank's loader reports each step finished, when the next batch
is asked for or a checkpoint saved with ``loader=``, in ``AUTODIST_RUN_PROGRESS``).

On several machines (``--nnodes N`` or ``MIN:MAX``, ``--master``), membership is Paddle's
launcher's, its elastic mode for a range with etcd (:func:`several_nodes`): the launcher starts
the ranks again by itself when machines leave or join (on the machines left, or on all). Each
rank runs the script under the family's plan for the job's world size (:func:`as_rank`) and
resumes from the last checkpoint; autodist-run on each machine follows the starts there and says
them, why, and the summary (:class:`Machine`). Tested on one machine: two autodist-run processes
on loopback as two machines, with a private etcd for the elastic mode (docs/workflow.md, "On
several machines").

Example::

    >>> family = Family.read("plans/llama_docstring")             # plan_2dev.json, plan_4dev.json, ...
    >>> family.sizes
    [2, 4, 8]
    >>> family.largest(3)[0]     # 3 devices left: the family's largest plan that fits runs 2
    2
"""

from __future__ import annotations

import argparse
import importlib.util
import json
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


def say(line: str) -> None:
    """One event, one line on stderr."""
    print(f"autodist-run: {line}", file=sys.stderr, flush=True)


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
        """The last step this launch finished, from the report of the loader of its first rank on
        this machine (None: no report)."""
        try:
            done = int(progress.read_text())
        except (OSError, ValueError):
            return None
        return (self.resumed_at or 0) + done

    def introduce(self, number: int) -> str:
        """The line that says this launch (the ``number``-th): its ranks, its plan, where it resumed."""
        strategy = strategy_text(load_plan(self.plan).strategy, "short")
        resumed = f", resuming at step {self.resumed_at}" if self.resumed_at is not None else ""
        return f"launch {number}: {len(self.devices)} ranks under {self.plan.name} ({strategy}){resumed}"

    def count_recomputed(self, number: int, progress: Path, checkpoint: int | None) -> str:
        """How far this interrupted launch (the ``number``-th) got past ``checkpoint``, the step the
        next one resumes from: kept in :attr:`recomputed`, and said in a line."""
        reached = self.reached(progress)
        if reached is None:
            return f"launch {number}: its loader reported no step; steps trained again not known"
        self.recomputed = max(0, reached - (checkpoint or 0))
        return (
            f"launch {number} reached step {reached}, its last checkpoint is at step {checkpoint or 0}: "
            f"{self.recomputed} step(s) to train again"
        )

    def saw_checkpoint(self, step: int | None) -> None:
        """Note the checkpoint's step as it is now, and when it was first seen."""
        if step != self.last_checkpoint[0]:
            self.last_checkpoint = (step, time.monotonic())


def summary(launches: list[Launch]) -> str:
    """The end's line: the launches, the time lost, the steps trained again, where each resumed."""
    interrupted = [launch for launch in launches if launch.outcome != "finished"]
    lost_s = sum(launch.ended - max(launch.started, launch.last_checkpoint[1]) for launch in interrupted)
    resumed = [launch.resumed_at for launch in launches[1:] if launch.resumed_at is not None]
    return (
        f"summary: {len(launches)} launch(es) on "
        + " -> ".join(str(len(launch.devices)) for launch in launches)
        + f" devices; {lost_s:.1f} s lost (from the last checkpoint of each interrupted launch to the next launch);"
        + f" {sum(launch.recomputed for launch in interrupted)} step(s) trained again; resumed at steps {resumed}"
    )


def checkpoint_step(folder: Path | None) -> int | None:
    """The step of the complete checkpoint in ``folder`` (None: none, or none readable yet)."""
    if folder is None or not (folder / METADATA_FILE).exists():
        return None
    try:
        return read_checkpoint(folder).step
    except CheckpointError:
        return None


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
    say: Callable[[str], None] = say
    launches: list[Launch] = field(default_factory=list)

    def run(self) -> int:
        healthy, lost = list(self.devices), list[int]()
        while True:
            size, plan_path = self.family.largest(len(healthy))
            if size < len(healthy):
                self.say(
                    f"{len(healthy)} devices, but the family's largest plan that fits is for {size}: running {size}"
                )
            launch = Launch(healthy[:size], plan_path, checkpoint_step(self.checkpoint), time.monotonic())
            self.launches.append(launch)
            self.say(launch.introduce(len(self.launches)))
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
                self.say(summary(self.launches))
                return 0
            culprits = [launch.devices[rank] for rank, _ in failed if rank < len(launch.devices)]
            launch.outcome = "lost " + ", ".join(f"rank {rank} (exit code {code})" for rank, code in failed)
            self.say(f"{launch.outcome}: dropping device(s) {culprits}")
            if not culprits:  # the launcher said nothing we can read: no device to blame
                self.say(summary(self.launches))
                raise RunError(f"launch {len(self.launches)} failed without naming a rank: see {self.log_dir}")
            if len(self.launches) > self.max_restarts:
                self.say(summary(self.launches))
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
                    step = checkpoint_step(self.checkpoint)
                    launch.saw_checkpoint(step)
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
        number = len(self.launches)
        self.say(
            launch.count_recomputed(number, self._launch_dir(number) / "progress", checkpoint_step(self.checkpoint))
        )

    def _launch_dir(self, number: int) -> Path:
        return self.log_dir / f"launch{number}"


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
    script: list[str], gpus: list[int] | None = None, checkpoint: Path | None = None,
) -> Machine:  # fmt: skip
    """This node of a job on several machines: Paddle's launcher keeps the membership
    (``--nnodes MIN:MAX`` with ``--master etcd://...``: its elastic mode, which restarts every
    rank when a node leaves or joins) and starts :func:`as_rank` on each rank, which runs
    ``script`` under the family's plan for the job's world size; :class:`Machine` runs the
    launcher and says each start. ``gpus``: the GPU ids this node uses (the launcher's
    ``--devices``); ``checkpoint``: the folder the script saves to, to say where each start resumed.

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
    if elastic and importlib.util.find_spec("etcd3") is None:
        raise RunError(
            f"--nnodes {nnodes}: Paddle's launcher talks to etcd through the etcd3 package, not installed here "
            "(pip install etcd3, on every machine)"
        )
    sizes = Family.read(family).sizes
    missing = [n * nproc for n in range(int(low), int(high or low) + 1) if n * nproc not in sizes]
    if missing:
        raise RunError(
            f"the family has no plan for {missing} devices (--nnodes {nnodes} x --nproc-per-node {nproc}), only for "
            f"{sizes}: every rank of a node count runs, so make a plan for each (autodist-plan --devices N)"
        )
    command = [
        sys.executable, "-m", "paddle.distributed.launch", "--master", master, "--nnodes", nnodes,
        "--nproc_per_node", str(nproc), *(["--devices", ",".join(map(str, gpus))] if gpus else []),
        "--job_id", job_id, "--log_dir", str(log_dir),
        *(["--elastic_level", "1", "--max_restart", str(max_restarts)] if elastic else []),
        str(Path(__file__).resolve()), AS_RANK, str(family.resolve()), *script,
    ]  # fmt: skip
    return Machine(command, log_dir, checkpoint, elastic_env() if elastic else {}, max_restarts if elastic else 0)


#: Set by autodist-run on a machine of a job on several: the file where the first rank of this
#: machine records each start of the ranks (:func:`as_rank`), for :class:`Machine` to follow.
STARTS_ENV = "AUTODIST_RUN_STARTS"
#: What the launcher of an elastic job needs in its environment, unless the user set it.
#: etcd3 0.12 (its newest release, which Paddle's launcher imports for ``etcd://``) carries
#: protobuf code that protobuf 4 and later load only in their pure-Python implementation (else:
#: "Descriptors cannot be created directly"). And the launcher forks each rank while the etcd
#: client's gRPC threads run: with gRPC's fork handlers, a rank died of SIGABRT before it started
#: ("epoll_wait error: Bad file descriptor", once in about 8 runs here), which the launcher
#: answers by starting every rank again. :func:`as_rank` gives the ranks back the defaults.
ELASTIC_ENV = {"PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION": "python", "GRPC_ENABLE_FORK_SUPPORT": "0"}
#: The names of :data:`ELASTIC_ENV` that autodist-run set (comma-separated), for :func:`as_rank`.
_SET_HERE = "AUTODIST_RUN_SET_ENV"


def elastic_env() -> dict[str, str]:
    """What the launcher of an elastic job gets in its environment beyond this one's."""
    added = {name: value for name, value in ELASTIC_ENV.items() if name not in os.environ}
    return {**added, _SET_HERE: ",".join(added)}


def progress_file(starts: Path, number: int) -> Path:
    """Where the ``number``-th start of the ranks of this machine reports its steps."""
    return starts.with_name(f"progress{number}")


@dataclass
class Machine:
    """autodist-run on one machine of a job on several: Paddle's launcher (``command``) keeps the
    members and starts the ranks again when one fails or, in its elastic mode, when machines
    leave or join. This follows each start of the ranks here, as the first of them records it in
    ``LOG_DIR/starts.jsonl`` (:func:`as_rank`), and says what the one-machine supervisor says: the
    launch and its plan, where it resumed, why the ranks were started again, how far the stopped
    launch got past its last checkpoint, and the summary at the end. A launcher that gave up
    waiting for the job after a rank here failed is started again, to rejoin it."""

    command: list[str]
    log_dir: Path
    checkpoint: Path | None
    env: dict[str, str] = field(default_factory=dict)
    #: How often the launcher is started again when it gave up waiting for the job (below).
    max_restarts: int = 3
    say: Callable[[str], None] = say
    launches: list[Launch] = field(default_factory=list)

    def run(self) -> int:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        starts = (self.log_dir / "starts.jsonl").resolve()
        output = self.log_dir / "launcher.out"
        for earlier in [
            starts,
            output,
            *self.log_dir.glob("progress*"),
        ]:  # an earlier job's, in a log folder used again
            earlier.unlink(missing_ok=True)
        self.say(f"Paddle's launcher runs the ranks of this machine; its output in {output}")
        for attempt in range(self.max_restarts + 1):
            said_before = output.stat().st_size if output.exists() else 0
            returncode = self._launch(starts, output)
            # Paddle 3.3's elastic launcher whose own rank failed counts the machines at once, its
            # status "failed" ending the wait (controllers/master.py, wait_peer_ready): when it
            # counts before its etcd watch has marked it restarting, it finds none, says "peer not
            # ready" and ends, while the other machines wait for it. Started again, it rejoins.
            with open(output, "rb") as f:
                f.seek(said_before)
                gave_up = b"peer not ready" in f.read()
            if returncode == 0 or not gave_up or attempt == self.max_restarts:
                break
            self.say("Paddle's launcher gave up waiting for the job after a rank here failed: starting it again")
        self._follow(starts)
        if self.launches:
            self.launches[-1].ended = time.monotonic()
            self.launches[-1].outcome = "finished" if returncode == 0 else f"exit code {returncode}"
            self.say(summary(self.launches))
        if returncode != 0:
            self.say(f"Paddle's launcher ended with exit code {returncode}: see {output}")
        return returncode

    def _launch(self, starts: Path, output: Path) -> int:
        """Run the launcher until it ends, saying each start of the ranks; its exit code."""
        env = {**os.environ, **self.env, STARTS_ENV: str(starts)}
        with open(output, "a") as out:
            proc = subprocess.Popen(self.command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
            try:
                while proc.poll() is None:
                    self._follow(starts)
                    time.sleep(POLL_S)
            finally:
                if proc.poll() is None:
                    _stop(proc)
        return proc.returncode

    def _follow(self, starts: Path) -> None:
        """Say each start of the ranks recorded since the last look; note the checkpoint."""
        try:
            recorded = [json.loads(line) for line in starts.read_text().splitlines()]
        except (OSError, ValueError):  # none yet, or a line being written
            recorded = []
        step = checkpoint_step(self.checkpoint)
        for start in recorded[len(self.launches) :]:
            launch = Launch(list(range(start["world"])), Path(start["plan"]), step, time.monotonic())
            if self.launches:
                stopped = self.launches[-1]
                stopped.ended, stopped.outcome = launch.started, _why_restarted(stopped, launch)
                self.say(f"the launcher started the ranks again: {stopped.outcome}")
                self.say(stopped.count_recomputed(len(self.launches), progress_file(starts, len(self.launches)), step))
            self.launches.append(launch)
            self.say(launch.introduce(len(self.launches)))
        if self.launches:
            self.launches[-1].saw_checkpoint(step)


def _why_restarted(stopped: Launch, started: Launch) -> str:
    """Why the launcher started the ranks again, as the job's size says it."""
    was, now = len(stopped.devices), len(started.devices)
    if now < was:
        return f"machines left, {was} -> {now} ranks"
    if now > was:
        return f"machines joined, {was} -> {now} ranks"
    return f"a rank failed, {now} ranks again"


def as_rank(family: str, script: list[str]) -> int:
    """On each rank of a job on several machines: run ``script`` (this process becomes it)
    under the family's plan for the job's world size, ``{plan}`` in its arguments replaced. The
    first rank of the machine records the start for :class:`Machine`, and its loader reports
    the steps it finished there."""
    world = int(os.environ.get("PADDLE_TRAINERS_NUM", "1"))
    plans = Family.read(family).plans
    if world not in plans:
        print(
            f"autodist-run: error: no plan in {family} for {world} devices (plans for {sorted(plans)})", file=sys.stderr
        )
        return 2
    plan = str(plans[world].resolve())
    os.environ["AUTODIST_PLAN"] = plan
    for name in filter(None, os.environ.pop(_SET_HERE, "").split(",")):
        os.environ.pop(name, None)
    starts = os.environ.get(STARTS_ENV)
    if starts and os.environ.get("PADDLE_LOCAL_RANK") == "0":
        with open(starts, "a+") as f:
            f.seek(0)
            number = len(f.read().splitlines()) + 1
            f.write(json.dumps({"world": world, "plan": plan}) + "\n")
        os.environ[PROGRESS_ENV] = str(progress_file(Path(starts), number))
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
    parser.add_argument(
        "--checkpoint", help="the checkpoint folder the script saves to (to say where each launch resumed; to grow)"
    )
    parser.add_argument("--grow", action="store_true", help="take lost devices back at the next checkpoint")
    parser.add_argument("--max-restarts", type=int, default=3)
    parser.add_argument(
        "--log-dir", default="log", help="each launch's logs go to LOG_DIR/launchN (on several machines: to LOG_DIR)"
    )
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
    if args.grow and args.nnodes != "1":
        parser.error(
            "--grow is for one machine: on several, Paddle's launcher takes machines back as they join (--nnodes MIN:MAX)"
        )
    checkpoint = Path(args.checkpoint) if args.checkpoint else None
    # SIGTERM ends autodist-run as Ctrl-C does: through the finally that stops the launcher it
    # started (in a session of its own: the launcher stops its ranks when it is stopped).
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        if args.nnodes != "1":
            machine = several_nodes(
                args.nnodes, args.master, args.job_id, Path(args.plans), len(devices), args.max_restarts,
                Path(args.log_dir), args.script, gpus, checkpoint,
            )  # fmt: skip
            return machine.run()
        supervisor = Supervisor(
            script=args.script,
            family=Family.read(args.plans),
            devices=devices,
            checkpoint=checkpoint,
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
