"""All ranks agree on plan and model before anything is sharded, or every rank stops.

A job's ranks can each hold a different checkout: another plan file, a plan with other data
sharding, a model of another size. Each rank's own checks cannot see that, and the first
collective then hangs or fails with a backend timeout that names nothing. So after its local
checks, every rank contributes one small record -- a digest of its plan, a digest of its model's
parameter table, its own problems -- and rank 0 compares them:

- all records equal and no problems: ``agree`` returns and sharding starts;
- otherwise every rank raises the same :class:`~autodist.schemas.PlanError`, naming which ranks
  differ and how (different plan, different model, failed validation);
- a rank that never arrives (dead, or stuck before ``apply_plan``) is named after a timeout
  (``timeout_s``, default :data:`DEFAULT_TIMEOUT_S`, or ``AUTODIST_AGREE_TIMEOUT`` seconds);
  a rank that loses rank 0 mid-way says so at once.

The exchange runs through a small TCP store of Paddle's own (``core.TCPStore``) hosted by rank
0 on its own port, not through a collective and not through Paddle's global store, whose
creation blocks (holding the GIL) until every rank connects -- the very hang this step exists to
prevent (docs/paddle-notes.md, "The agreement step"). Every wait here is a Python loop with a
deadline over calls that return at once.

Example::

    >>> record = local_record(plan_bytes, model, problems=[])        # doctest: +SKIP
    >>> agree(record, rank=1, world=2)                                # doctest: +SKIP
    PlanError: plan: invalid plan: ranks disagree: different plan: rank 0 ... ; rank 1 ...
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import socket
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from autodist.schemas import PlanError

#: Seconds a rank waits for the others; generous, since ranks reach apply_plan at different
#: times (model building, data loading). ``AUTODIST_AGREE_TIMEOUT`` overrides it.
DEFAULT_TIMEOUT_S = 300.0
TIMEOUT_ENV = "AUTODIST_AGREE_TIMEOUT"
#: The agreement store's port; default: the job's master port + 1.
PORT_ENV = "AUTODIST_AGREE_PORT"
#: How often a waiting rank asks the store again.
POLL_S = 0.1
#: How long a rank waits for rank 0's verdict beyond rank 0's own deadline.
VERDICT_GRACE_S = 10.0
_MAX_RANKS_NAMED = 8

#: One store per process, reused by every apply_plan call (the n-th call of each rank meets the
#: n-th call of the others).
_STORE: Any = None
_CALLS = itertools.count()


@dataclass(frozen=True)
class Record:
    """What one rank brings to the agreement."""

    rank: int
    plan_source: str
    #: sha256 of the plan's canonical bytes; "" when the plan could not be read.
    plan_digest: str
    #: sha256 over the model's (FQN, shape, dtype) table.
    model_digest: str
    #: This rank's own problems (its PlanError's lines); empty when it found none.
    problems: list[str] = field(default_factory=list)


def timeout_from(timeout_s: float | None) -> float:
    """The agreement timeout: the argument, else ``AUTODIST_AGREE_TIMEOUT``, else the default."""
    if timeout_s is not None:
        return float(timeout_s)
    text = os.environ.get(TIMEOUT_ENV)
    if not text:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0 or value == float("inf"):
        raise PlanError(f"{TIMEOUT_ENV}={text!r}: expected a positive number of seconds", source="environment")
    return value


def digest(data: bytes) -> str:
    """``sha256`` hex of ``data``.

    >>> digest(b"")[:12]
    'e3b0c44298fc'
    """
    return hashlib.sha256(data).hexdigest()


def agree(record: Record, rank: int, world: int, timeout_s: float) -> None:
    """Meet the other ranks; return when all of them bring the same plan and model and found no
    problem, else raise the same :class:`PlanError` on every rank."""
    if world <= 1:
        if record.problems:
            raise PlanError(record.problems, source=record.plan_source)
        return
    session = f"autodist/agree/{next(_CALLS)}"
    deadline = time.monotonic() + timeout_s
    store = _store(rank, world, deadline, timeout_s, record.plan_source)
    try:
        store.set(f"{session}/record/{rank}", json.dumps(asdict(record)))
        store.add(f"{session}/arrived/{rank}", 1)
        if rank == 0:
            verdict, arrived = _decide(store, session, world, deadline, timeout_s)
            store.set(f"{session}/verdict", json.dumps(verdict))
            store.add(f"{session}/verdict_ready", 1)
            # Rank 0 hosts the store: were it to raise and exit at once, a rank still polling
            # would lose the connection instead of reading the verdict (and Paddle's server can
            # abort tearing down live connections). So it waits, briefly, until each rank that
            # arrived has read the verdict.
            _await_reads(store, session, arrived - 1, time.monotonic() + VERDICT_GRACE_S)
        else:
            verdict = _await_verdict(store, session, deadline + VERDICT_GRACE_S, timeout_s)
            store.add(f"{session}/verdict_read", 1)
    except PlanError:
        raise
    except Exception as exc:  # the store's connection broke: rank 0, which hosts it, is gone
        raise PlanError(
            f"agreement: lost the connection to rank 0 while ranks were agreeing on the plan "
            f"(rank 0 died or was stopped?): {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}",
            source=record.plan_source,
        ) from None
    if verdict:
        raise PlanError(verdict, source=record.plan_source)


# -- rank 0 decides -------------------------------------------------------------------------------


def _decide(store: Any, session: str, world: int, deadline: float, timeout_s: float) -> tuple[list[str], int]:
    """Wait for every rank's record (until ``deadline``) and return the problems all ranks raise
    (empty when they agree and none found a problem) and how many ranks arrived."""
    waiting = set(range(world))
    while True:
        waiting = {r for r in waiting if store.add(f"{session}/arrived/{r}", 0) == 0}
        if not waiting or time.monotonic() > deadline:
            break
        time.sleep(POLL_S)
    records = [
        Record(**json.loads(store.get(f"{session}/record/{r}"))) for r in range(world) if r not in waiting
    ]
    return verdict_problems(records, sorted(waiting), world, timeout_s), len(records)


def verdict_problems(records: list[Record], missing: list[int], world: int, timeout_s: float) -> list[str]:
    """What every rank reports, from the records that arrived and the ranks that did not.

    Example::

        >>> a = Record(0, "plan.json", "aa" * 32, "cc" * 32)
        >>> b = Record(1, "other.json", "bb" * 32, "cc" * 32)
        >>> verdict_problems([a, b], [], 2, 60)
        ['ranks disagree: different plan: rank 0 has plan.json (sha256 aaaaaaaaaaaa...), rank 1 has other.json (sha256 bbbbbbbbbbbb...)']
    """
    problems = []
    if missing:
        problems.append(
            f"ranks {_ranks(missing)} of {world} did not reach the agreement step within {timeout_s:g} s "
            f"(dead, stuck, or started without this apply_plan call); set {TIMEOUT_ENV} to wait longer"
        )
    plans = _groups(records, lambda r: r.plan_digest)
    if len(plans) > 1:
        problems.append("ranks disagree: different plan: " + ", ".join(
            f"{_who(group)} {'has ' + group[0].plan_source if key else 'could not read ' + group[0].plan_source}"
            + (f" (sha256 {key[:12]}...)" if key else "")
            for key, group in plans
        ))
    models = _groups(records, lambda r: r.model_digest)
    if len(models) > 1:
        problems.append("ranks disagree: different model: " + ", ".join(
            f"{_who(group)} a model with parameter table sha256 {key[:12]}..." for key, group in models
        ))
    failed = _groups([r for r in records if r.problems], lambda r: json.dumps(r.problems))
    if len(failed) == 1 and len(failed[0][1]) == len(records) and not problems:
        return list(records[0].problems)  # every rank found the same problems: just those
    for _, group in failed:
        problems.append(f"{_who(group)} failed validation: " + "; ".join(group[0].problems))
    return problems


def _groups(records: list[Record], key) -> list[tuple[str, list[Record]]]:
    groups: dict[str, list[Record]] = {}
    for record in records:
        groups.setdefault(key(record), []).append(record)
    return sorted(groups.items(), key=lambda kv: kv[1][0].rank)


def _who(group: list[Record]) -> str:
    return ("rank " if len(group) == 1 else "ranks ") + _ranks([r.rank for r in group])


def _ranks(ranks: list[int]) -> str:
    shown = ", ".join(map(str, ranks[:_MAX_RANKS_NAMED]))
    return shown + (f" and {len(ranks) - _MAX_RANKS_NAMED} more" if len(ranks) > _MAX_RANKS_NAMED else "")


# -- the other ranks wait for it ------------------------------------------------------------------


def _await_verdict(store: Any, session: str, deadline: float, timeout_s: float) -> list[str]:
    while store.add(f"{session}/verdict_ready", 0) == 0:
        if time.monotonic() > deadline:
            return [f"agreement: rank 0 gave no verdict within {timeout_s:g} s (stuck?)"]
        time.sleep(POLL_S)
    return json.loads(store.get(f"{session}/verdict"))


def _await_reads(store: Any, session: str, readers: int, deadline: float) -> None:
    """Rank 0: wait until ``readers`` ranks have read the verdict, or ``deadline`` passes (a rank
    that reads later still gets a one-line PlanError: the lost connection)."""
    while store.add(f"{session}/verdict_read", 0) < readers and time.monotonic() < deadline:
        time.sleep(POLL_S)


# -- the store --------------------------------------------------------------------------------------


def master_endpoint() -> tuple[str, int]:
    """Rank 0's host and the agreement port: ``PADDLE_MASTER`` (set by Paddle's launcher) or else
    the first of ``PADDLE_TRAINER_ENDPOINTS``, as Paddle's own store finds its master; the port
    is ``AUTODIST_AGREE_PORT`` or that port + 1."""
    endpoint = os.environ.get("PADDLE_MASTER") or os.environ.get("PADDLE_TRAINER_ENDPOINTS", "").split(",")[0]
    host, _, port = endpoint.rpartition(":")
    if not host or not port.isdigit():
        raise PlanError(
            "agreement: neither PADDLE_MASTER nor PADDLE_TRAINER_ENDPOINTS names rank 0's host:port; "
            "start the job with paddle.distributed.launch or set them",
            source="environment",
        )
    agree_port = os.environ.get(PORT_ENV)
    return host, int(agree_port) if agree_port and agree_port.isdigit() else int(port) + 1


def _store(rank: int, world: int, deadline: float, timeout_s: float, source: str) -> Any:
    """This process's agreement store: rank 0 hosts it, the others connect once it listens."""
    global _STORE
    if _STORE is not None:
        return _STORE
    from paddle.base import core

    host, port = master_endpoint()
    # The store's own timeout bounds nothing here (every wait is ours); it must be a whole,
    # positive number of seconds.
    store_timeout = max(1, int(timeout_s + VERDICT_GRACE_S))
    if rank == 0:
        # Paddle aborts the process when its server cannot bind (docs/paddle-notes.md): try first.
        problem = _cannot_bind(port)
        if problem:
            raise PlanError(
                f"agreement: rank 0 cannot listen on port {port} ({problem}); set {PORT_ENV} to a free "
                "port on every rank",
                source=source,
            )
        # No workers to wait for (0): the constructor returns at once (docs/paddle-notes.md).
        _STORE = core.TCPStore(host, port, True, 0, store_timeout)
        return _STORE
    # Paddle's client retries a refused connection forever, holding the GIL: connect only once
    # the port answers, which this loop finds out with a deadline.
    while not _listening(host, port):
        if time.monotonic() > deadline:
            raise PlanError(
                f"agreement: rank 0 did not reach the agreement step within {timeout_s:g} s "
                f"(nothing listens on {host}:{port}; dead, stuck, or another plan?); "
                f"set {TIMEOUT_ENV} to wait longer",
                source=source,
            )
        time.sleep(POLL_S)
    _STORE = core.TCPStore(host, port, False, 0, store_timeout)
    return _STORE


def _cannot_bind(port: int) -> str:
    """Why this process cannot listen on ``port`` (as Paddle's server would: all interfaces,
    SO_REUSEADDR), or "" when it can."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("", port))
        except OSError as err:
            return err.strerror or str(err)
    return ""


def _listening(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False
