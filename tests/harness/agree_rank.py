"""One rank of an agreement-only job: ``python -m harness.agree_rank PLAN_DIGEST [fail|die|freeze]``.

Runs the agreement step of ``apply_plan`` (applier/ranks/agree.py) as it runs there -- its own process,
the job's ``PADDLE_*`` environment, real sockets -- but without Paddle, so a job of two starts in
a fraction of a second: what tests/test_agree_strangers.py puts strangers up against. The rank
brings a record with the given plan digest; after the agreement, while "applying" the plan, it
raises (``fail``), SIGKILLs itself (``die``) or stops for twice the timeout (``freeze``). It
prints one JSON line: what it raised (or None), how long it took (in all, and after the
agreement), its peak RSS and CPU time.

``AGREE_RANK_NOFILE`` (TEST-ONLY) lowers this process's descriptor limit to that many above what
it has open, as a rank of a job short of descriptors.
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import signal
import socket
import sys
import time
from pathlib import Path

from autodist.applier.ranks.agree import Record, agree, applying, timeout_from
from autodist.schemas import PlanError
from harness.launcher import free_ports, launch_ranks

MODEL_DIGEST = "c" * 64


def main(plan_digest: str, after: str | None) -> None:
    spare = os.environ.get("AGREE_RANK_NOFILE")
    if spare:
        in_use = len(os.listdir("/proc/self/fd"))
        resource.setrlimit(resource.RLIMIT_NOFILE, (in_use + int(spare), resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    rank, world = int(os.environ["PADDLE_TRAINER_ID"]), int(os.environ["PADDLE_TRAINERS_NUM"])
    start = time.monotonic()
    error, message, agreed, job = None, "", None, None
    try:
        agreement = agree(Record(rank, "plan.json", plan_digest, MODEL_DIGEST), rank, world, timeout_s=_timeout())
        agreed = time.monotonic()
        job = hashlib.sha256(agreement.job_key).hexdigest()[:16]
        with applying(agreement):
            if after == "fail":
                raise RuntimeError("TEST-ONLY: this rank failed while sharding")
            if after == "die":
                os.kill(os.getpid(), signal.SIGKILL)
            if after == "freeze":
                time.sleep(2 * _timeout())
    except (PlanError, RuntimeError) as exc:
        error, message = type(exc).__name__, str(exc)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    result = {
        "rank": rank,
        # A fingerprint of the key this run signs with after the agreement (never the key itself).
        "job": job,
        "error": error,
        "message": message,
        "seconds": time.monotonic() - start,
        # From the agreement to the end: how long a failure after it took to stop this rank.
        "after_agreement_s": None if agreed is None else time.monotonic() - agreed,
        "maxrss_mb": usage.ru_maxrss / 1024,
        "cpu_s": usage.ru_utime + usage.ru_stime,
    }
    print(json.dumps(result), flush=True)


def launch_agreement(workdir: Path) -> tuple[bool, bool, str]:
    """Run a 2-rank job of this module on loopback, the master's port + 1 (the agreement's old
    default) held by a silent listener when free: ``(both ranks agreed, whether that port was held,
    the report of a failure)``. tests/test_agree_port.py and bench/agree_launches.py run it."""
    (master,) = free_ports(1)
    holder = hold_silently(master + 1)
    try:
        job = launch_ranks(
            2,
            ["-m", "harness.agree_rank", "a" * 64],
            workdir,
            timeout_s=60,
            extra_env={"PADDLE_MASTER": f"127.0.0.1:{master}", "AUTODIST_AGREE_TIMEOUT": "30"},
        )
    finally:
        if holder is not None:
            holder.close()
    lines = [p.stdout.strip().splitlines() for p in job.processes]
    results = [json.loads(out[-1]) if out else None for out in lines]
    agreed = job.ok and all(r is not None and r["error"] is None for r in results)
    return agreed, holder is not None, "" if agreed else f"{job.report()}\n{results}"


def hold_silently(port: int) -> socket.socket | None:
    """A listener on ``port`` that never answers (None if someone else already holds it)."""
    holder = socket.socket()
    try:
        holder.bind(("127.0.0.1", port))
    except OSError:
        holder.close()
        return None
    holder.listen()
    return holder


def _timeout() -> float:
    """As apply_plan takes it: ``AUTODIST_AGREE_TIMEOUT``, else the default (300 s)."""
    return timeout_from(None)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None)
