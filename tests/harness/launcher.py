"""Start N Paddle ranks on loopback (gloo), wait with a hard timeout, never leave a process behind.

Two ways to start a job:

* :func:`launch_ranks` starts every rank itself with the ``PADDLE_*`` environment variables
  Paddle's own launcher would set (the fast way: no launcher process, ~2 s for 2 tiny ranks);
* :func:`launch_nodes` starts one ``python -m paddle.distributed.launch`` per simulated node,
  all on 127.0.0.1, for the multi-node case.

Every child runs in its own session (process group), so a timeout or a failure kills the rank
*and* whatever it started. Output goes to files, not pipes, so a chatty rank cannot block.

Example::

    >>> job = launch_ranks(2, ["-m", "harness.rank_main", "job.json"], workdir=tmp)  # doctest: +SKIP
    >>> job.raise_for_failure()                                                     # doctest: +SKIP
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
TESTS_DIR = REPO_ROOT / "tests"

#: Ranks > 0 that reach the TCP store before rank 0 listens back off ~3 s (docs/paddle-notes.md, "Collectives on the CPU wheel").
RANK_START_DELAY_S = 0.5
#: After the first rank fails, how long the others get to fail on their own (a bad plan must
#: fail on *every* rank) before they are killed as hung.
FAILURE_GRACE_S = 15.0
STDERR_TAIL_CHARS = 4000
#: apply_plan's agreement port (applier/ranks/agree.py) when set; the jobs here leave it unset, as users
#: do (rank 0 then listens on a port the system picks free); the stranger tests set it.
AGREE_PORT_ENV = "AUTODIST_AGREE_PORT"


@dataclass
class ProcessResult:
    """One finished (or killed) child: a rank, or a per-node launcher."""

    name: str
    returncode: int | None  # None: killed by us (timeout, or hung after another rank failed)
    stdout: str
    stderr: str
    seconds: float

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    def describe(self) -> str:
        status = "killed (hung)" if self.returncode is None else f"exit code {self.returncode}"
        tail = self.stderr[-STDERR_TAIL_CHARS:].strip() or "(stderr empty)"
        return f"--- {self.name}: {status} after {self.seconds:.1f} s; stderr tail:\n{tail}"


@dataclass
class JobResult:
    processes: list[ProcessResult]
    timed_out: bool
    seconds: float

    @property
    def ok(self) -> bool:
        return not self.timed_out and all(p.ok for p in self.processes)

    def report(self) -> str:
        head = f"job {'TIMED OUT' if self.timed_out else 'finished'} after {self.seconds:.1f} s"
        return "\n".join([head] + [p.describe() for p in self.processes if not p.ok])

    def raise_for_failure(self) -> None:
        """AssertionError with every failed process's stderr tail, so a failure is never hidden."""
        if not self.ok:
            raise AssertionError(self.report())


def free_ports(count: int) -> list[int]:
    """``count`` distinct free TCP ports on 127.0.0.1 (all held open together while picking)."""
    with ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(count)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


def base_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment every child gets: tests/ importable, one thread per rank (2-core box)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS_DIR), env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    # A rank that dies of a signal (SIGSEGV, SIGABRT in Paddle's C++) prints every thread's
    # Python stack to its stderr: the report then says where it was, not only its exit code.
    env["PYTHONFAULTHANDLER"] = "1"
    # An empty CUDA_VISIBLE_DEVICES breaks Paddle's launcher on the CPU wheel (docs/paddle-notes.md,
    # "Collectives on the CPU wheel").
    if env.get("CUDA_VISIBLE_DEVICES") == "":
        del env["CUDA_VISIBLE_DEVICES"]
    env.update(extra or {})
    return env


def rank_env(
    rank: int, endpoints: list[str], extra: dict[str, str] | None = None, backend: str = "gloo"
) -> dict[str, str]:
    """What ``paddle.distributed.launch`` would set for ``rank`` of a job on ``endpoints``:
    gloo on CPU; with ``backend="nccl"`` each rank also gets its own GPU (rank i -> GPU i)."""
    env = {
        "PADDLE_TRAINER_ID": str(rank),
        "PADDLE_TRAINERS_NUM": str(len(endpoints)),
        "PADDLE_TRAINER_ENDPOINTS": ",".join(endpoints),
        "PADDLE_CURRENT_ENDPOINT": endpoints[rank],
        # One simulated node: the rank is also the rank in the node (PaddleFormers'
        # TrainingArguments refuses a distributed job without it).
        "PADDLE_RANK_IN_NODE": str(rank),
        "PADDLE_DISTRI_BACKEND": backend,
    }
    if backend == "nccl":
        env["FLAGS_selected_gpus"] = str(rank)
    return base_env({**env, **(extra or {})})


def launch_ranks(
    nranks: int,
    args: list[str],
    workdir: Path,
    timeout_s: float = 180.0,
    extra_env: dict[str, str] | None = None,
    backend: str = "gloo",
    failure_grace_s: float = FAILURE_GRACE_S,
    retry_rendezvous: bool = False,
) -> JobResult:
    """Run ``python *args`` as ``nranks`` gloo ranks on loopback; wait for all of them.

    ``nranks == 1`` runs a plain single process with no distributed environment at all (the
    single-device reference). ``retry_rendezvous``: for a job expected to succeed, start it once
    more (fresh ports, ``workdir/retry``) if it died in gloo's rendezvous
    (:func:`lost_at_rendezvous`), and say so on stderr.
    """
    if nranks == 1:
        envs = [base_env(extra_env)]
    else:
        endpoints = [f"127.0.0.1:{p}" for p in free_ports(nranks)]
        envs = [rank_env(r, endpoints, extra_env, backend) for r in range(nranks)]
    commands = [[sys.executable, *args] for _ in range(nranks)]
    job = _run_all([f"rank {r}" for r in range(nranks)], commands, envs, workdir, timeout_s, failure_grace_s)
    if retry_rendezvous and lost_at_rendezvous(job):
        print(
            f"launch_ranks: started again, the first start died in gloo's rendezvous:\n{job.report()}", file=sys.stderr
        )
        return launch_ranks(nranks, args, workdir / "retry", timeout_s, extra_env, backend, failure_grace_s)
    return job


#: How a rank dies when gloo gives up connecting to its peers (``pair.cc``: a refused
#: connection, or a timeout waiting for one): C++ ``terminate``, SIGABRT.
_GLOO_ABORT = "terminate called after throwing an instance of 'gloo::"
#: Gloo's rendezvous happens at a job's first collective, within seconds of its start.
RENDEZVOUS_S = 30.0


def lost_at_rendezvous(job: JobResult) -> bool:
    """Whether ``job`` died in gloo's rendezvous, as a loaded machine makes it now and then: on
    2 cores with a busy loop beside ``make test`` (load 4), rank 0's connection to a peer that
    started late was refused 6 s in (``pair.cc:784 ... Connection refused``) and the peer timed
    out (docs/benchmarks.md, "The whole make test"). Every rank that failed aborted in gloo
    (no Python traceback: an error of autodist's or of the test's is never retried), and the
    job ended early (tests/test_launcher.py).
    """
    failed = [p for p in job.processes if not p.ok]
    return (
        bool(failed)
        and not job.timed_out
        and job.seconds < RENDEZVOUS_S
        and all(p.returncode == -signal.SIGABRT and _GLOO_ABORT in p.stderr for p in failed)
        and not any("Traceback (most recent call last)" in p.stderr for p in job.processes)
    )


def launch_nodes(
    nnodes: int,
    nproc_per_node: int,
    args: list[str],
    workdir: Path,
    timeout_s: float = 240.0,
) -> JobResult:
    """Simulate ``nnodes`` machines: one ``paddle.distributed.launch`` per node, all on loopback,
    meeting at one master port. ``--devices`` and ``CUDA_VISIBLE_DEVICES`` stay unset: both
    break the launcher on the CPU wheel (docs/paddle-notes.md, "Collectives on the CPU wheel"). Each
    launcher writes its ranks' logs
    under ``workdir/log_node<N>``; they are appended to the node's stderr here.
    """
    (master_port,) = free_ports(1)
    commands, names = [], []
    for node in range(nnodes):
        names.append(f"node {node}")
        commands.append(
            [
                sys.executable, "-m", "paddle.distributed.launch",
                "--master", f"127.0.0.1:{master_port}",
                "--nnodes", str(nnodes),
                "--rank", str(node),
                "--nproc_per_node", str(nproc_per_node),
                "--log_dir", str(workdir / f"log_node{node}"),
                *args,
            ]
        )  # fmt: skip
    job = _run_all(names, commands, [base_env() for _ in commands], workdir, timeout_s)
    for node, proc in enumerate(job.processes):
        for log in sorted((workdir / f"log_node{node}").glob("workerlog.*")):
            proc.stderr += f"\n[{log.name}]\n" + log.read_text(errors="replace")
    return job


def _run_all(
    names, commands, envs, workdir: Path, timeout_s: float, failure_grace_s: float = FAILURE_GRACE_S
) -> JobResult:
    workdir.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    procs, files = [], []
    try:
        for i, (name, cmd, env) in enumerate(zip(names, commands, envs)):
            if i:
                time.sleep(RANK_START_DELAY_S)
            stem = workdir / name.replace(" ", "")
            out, err = open(f"{stem}.out", "w+b"), open(f"{stem}.err", "w+b")
            files.append((out, err))
            procs.append(subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=out, stderr=err, start_new_session=True))
        timed_out, killed = _wait(procs, start + timeout_s, failure_grace_s)
    finally:
        for p in procs:  # whatever happened above (even KeyboardInterrupt), nothing survives
            _kill_group(p)
    seconds = time.monotonic() - start
    results = []
    for name, p, (out, err) in zip(names, procs, files):
        results.append(
            ProcessResult(
                name=name,
                returncode=None if p in killed else p.returncode,
                stdout=_read(out),
                stderr=_read(err),
                seconds=seconds,
            )
        )
    return JobResult(results, timed_out, seconds)


def _wait(procs: list[subprocess.Popen], deadline: float, failure_grace_s: float) -> tuple[bool, set]:
    """Poll until all exit, the deadline passes, or the grace after a first failure runs out.
    Returns (timed_out, the processes that had to be killed)."""
    failed_at = None
    while True:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            return False, set()
        now = time.monotonic()
        if failed_at is None and any(c not in (None, 0) for c in codes):
            failed_at = now
        if now > deadline or (failed_at is not None and now > failed_at + failure_grace_s):
            alive = {p for p, c in zip(procs, codes) if c is None}
            for p in alive:
                _kill_group(p)
            return now > deadline, alive
        time.sleep(0.05)


def _kill_group(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()
    # The rank's own children (e.g. the launcher's workers) live in the same group.
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _read(f) -> str:
    f.seek(0)
    text = f.read().decode(errors="replace")
    f.close()
    return text
