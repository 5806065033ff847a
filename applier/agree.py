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

The exchange is a plain TCP conversation, one JSON line each way (docs/paddle-notes.md, "The
agreement step"). Rank 0 listens on the job's master port + 1 (or ``AUTODIST_AGREE_PORT``);
every other rank connects, sends its record and waits for the verdict::

    rank r > 0                           rank 0
    connect (retry while refused) ---->  accept, until all world - 1 records or the deadline
                                  <----  "autodist agreement"        (else: not rank 0, retry)
    {"call": n, "record": {...}}  ---->  decide
                                  <----  {"verdict": [problems]}      (to every rank that came)
    "ack" (it holds the verdict)  ---->  wait for every ack (or that rank's socket closing)
    raise or return                      raise or return

The last step is what makes the verdict reach every rank. Rank 0 raising is the job failing:
``paddle.distributed.launch`` stops all other ranks within about a second of the first one
exiting non-zero (docs/paddle-notes.md), and a rank killed before it read the verdict never
reports it, while one that outlives rank 0 unread would report a lost connection instead. So
rank 0 leaves only once each rank that arrived holds the verdict: not after a fixed grace, but
when its acknowledgement arrives, or its connection closes (it died), or -- for a rank alive but
frozen -- after ``timeout_s`` more. A rank > 0 acknowledges only after it has the whole verdict,
and nothing it receives later can replace it.

Every wait is a ``select``/socket timeout on a deadline: nothing polls, except a rank that
arrives before rank 0 listens, which retries the refused connection after 2 ms, doubling up to
50 ms. Rank 0 speaks first because nothing reserves its port: a rank that reached another
program there sends it nothing, hangs up on it after 2 s of silence and tries again (naming the
port at the deadline). Paddle's own stores are not used: its global store blocks, holding the GIL, until every
rank connects -- the hang this step exists to prevent -- and its ``core.TCPStore`` has waits
without deadlines and aborts the process in some failures (docs/paddle-notes.md).

Example::

    >>> record = Record(1, "plan.json", digest(plan_bytes), model_digest)   # doctest: +SKIP
    >>> agree(record, rank=1, world=2, timeout_s=300)                       # doctest: +SKIP
    PlanError: plan: invalid plan: ranks disagree: different plan: rank 0 ... ; rank 1 ...
"""

from __future__ import annotations

import errno
import hashlib
import itertools
import json
import os
import selectors
import socket
import time
from dataclasses import asdict, dataclass, field, replace

from autodist.schemas import PlanError

#: Seconds a rank waits for the others; generous, since ranks reach apply_plan at different
#: times (model building, data loading). ``AUTODIST_AGREE_TIMEOUT`` overrides it.
DEFAULT_TIMEOUT_S = 300.0
TIMEOUT_ENV = "AUTODIST_AGREE_TIMEOUT"
#: The agreement port; default: the job's master port + 1.
PORT_ENV = "AUTODIST_AGREE_PORT"
#: A rank that finds nothing listening yet tries again after this long, doubling up to the max.
RETRY_MIN_S = 0.002
RETRY_MAX_S = 0.05
#: How long a rank waits for rank 0's verdict beyond rank 0's own deadline. A live rank 0
#: answers well within it; it bounds only the wait on a rank 0 that is alive but frozen.
VERDICT_GRACE_S = 10.0
#: The longest message accepted (a record is two digests, a path and the problem lines).
MAX_MESSAGE_BYTES = 1 << 20
#: Rank 0 greets each connection with this line, so a rank that reached another program on
#: the port (which may never answer) notices, hangs up, and tries again, sending it nothing.
GREETING = b"autodist agreement\n"
#: How long a rank waits for the greeting before it hangs up and tries again (harmless if rank
#: 0 was merely slow: it drops the closed connection and accepts the next one).
GREETING_WAIT_S = 2.0
ACK = b"ack\n"
_MAX_RANKS_NAMED = 8

#: The n-th apply_plan call of each rank meets the n-th call of the others.
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
        verdict = record.problems
    elif rank == 0:
        verdict = _host(record, world, next(_CALLS), timeout_s)
    else:
        verdict = _join(record, next(_CALLS), timeout_s)
    if verdict:
        raise PlanError(verdict, source=record.plan_source)


# -- rank 0 gathers the records, decides, and waits until every rank holds the verdict ----------


def _host(record: Record, world: int, call: int, timeout_s: float) -> list[str]:
    host, port = master_endpoint()
    try:
        listener = _listen(host, port, backlog=world)
    except OSError as err:
        raise PlanError(
            f"agreement: rank 0 cannot listen on port {port} ({err.strerror or err}); set {PORT_ENV} "
            "to a free port on every rank",
            source=record.plan_source,
        ) from None
    with listener, selectors.DefaultSelector() as selector:
        peers = _gather(listener, selector, record, world, call, time.monotonic() + timeout_s)
        listener.close()  # a later call's ranks must not reach this one
        records = sorted([record, *peers.values()], key=lambda r: r.rank)
        verdict = verdict_problems(records, _missing(peers, world), world, timeout_s)
        _deliver(selector, peers, verdict, time.monotonic() + timeout_s)
    return verdict


def _listen(host: str, port: int, backlog: int) -> socket.socket:
    """A listening socket on rank 0's own address (loopback when the job is on loopback)."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind((host, port))
        except OSError as err:  # the master's address is not one of this host's (NAT): all of them
            if err.errno != errno.EADDRNOTAVAIL:
                raise
            listener.bind(("", port))
        listener.listen(backlog)
        listener.setblocking(False)
    except OSError:
        listener.close()
        raise
    return listener


def _gather(listener, selector, mine: Record, world: int, call: int, deadline: float) -> dict:
    """Accept ranks and read their records until all ``world - 1`` came or ``deadline`` passed.
    Returns ``{connection: record}`` for the ranks that came."""
    selector.register(listener, selectors.EVENT_READ)
    buffers: dict[socket.socket, bytearray] = {}
    peers: dict[socket.socket, Record] = {}
    while len(peers) < world - 1 and time.monotonic() < deadline:
        for key, _ in selector.select(timeout=max(0.0, deadline - time.monotonic())):
            if key.fileobj is listener:
                try:
                    conn, _ = listener.accept()
                except OSError:
                    continue
                try:
                    conn.sendall(GREETING)  # a few bytes into an empty socket buffer
                except OSError:
                    conn.close()
                    continue
                conn.setblocking(False)
                selector.register(conn, selectors.EVENT_READ)
                buffers[conn] = bytearray()
                continue
            conn = key.fileobj
            line = _read_line(conn, buffers[conn])
            if line is None:
                continue
            selector.unregister(conn)
            del buffers[conn]
            peer = _parse_hello(line, world, call, mine, peers.values())
            if peer is None:  # closed before a whole record, or not one of ours
                conn.close()
            else:
                peers[conn] = peer
    selector.unregister(listener)
    for conn in buffers:  # came, but sent no whole record in time: counted as missing
        selector.unregister(conn)
        conn.close()
    return peers


def _read_line(conn: socket.socket, buffer: bytearray) -> bytes | None:
    """Read what ``conn`` has; the whole line once it has one, ``b""`` when it closed (or broke,
    or sent too much) first, else None (more to come)."""
    try:
        chunk = conn.recv(65536)
    except BlockingIOError:
        return None
    except OSError:
        return b""
    if not chunk or len(buffer) + len(chunk) > MAX_MESSAGE_BYTES:
        return b""
    buffer += chunk
    end = buffer.find(b"\n")
    return bytes(buffer[: end + 1]) if end >= 0 else None


def _parse_hello(line: bytes, world: int, call: int, mine: Record, others) -> Record | None:
    """The record in one rank's first line, or None when it is not a valid one."""
    try:
        hello = json.loads(line)
        record = Record(**hello["record"])
        their_call = int(hello["call"])
    except (ValueError, TypeError, KeyError):
        return None
    if not (isinstance(record.rank, int) and 0 < record.rank < world and isinstance(record.problems, list)):
        return None
    texts = [record.plan_source, record.plan_digest, record.model_digest, *record.problems]
    if not all(isinstance(text, str) for text in texts) or record.rank in {mine.rank, *(r.rank for r in others)}:
        return None
    if their_call != call:  # a rank that called apply_plan another number of times than rank 0
        problem = f"agreement: this is its apply_plan call {their_call + 1}, rank 0's call {call + 1}"
        return replace(record, problems=[*record.problems, problem])
    return record


def _missing(peers: dict, world: int) -> list[int]:
    came = {r.rank for r in peers.values()}
    return [r for r in range(1, world) if r not in came]


def _deliver(selector, peers: dict, verdict: list[str], deadline: float) -> None:
    """Send every rank that came the verdict, then wait until each acknowledged it, its
    connection closed (it died: nothing more to wait for), or ``deadline`` passed (frozen)."""
    message = json.dumps({"verdict": verdict}).encode() + b"\n"
    for conn in peers:
        try:
            conn.setblocking(True)
            conn.settimeout(max(0.001, deadline - time.monotonic()))
            conn.sendall(message)
            conn.setblocking(False)
            selector.register(conn, selectors.EVENT_READ)
        except OSError:
            conn.close()
    buffers = {key.fileobj: bytearray() for key in selector.get_map().values()}
    while buffers and time.monotonic() < deadline:
        for key, _ in selector.select(timeout=max(0.0, deadline - time.monotonic())):
            conn = key.fileobj
            if _read_line(conn, buffers[conn]) is not None:
                selector.unregister(conn)
                del buffers[conn]
                conn.close()
    for conn in buffers:
        selector.unregister(conn)
        conn.close()


def verdict_problems(records: list[Record], missing: list[int], world: int, timeout_s: float) -> list[str]:
    """What every rank reports, from the records that arrived and the ranks that did not.

    Example::

        >>> a = Record(0, "plan.json", "aa" * 32, "cc" * 32)
        >>> b = Record(1, "other.json", "bb" * 32, "cc" * 32)
        >>> print(*verdict_problems([a, b], [], 2, 60))  # doctest: +NORMALIZE_WHITESPACE
        ranks disagree: different plan: rank 0 has plan.json (sha256 aaaaaaaaaaaa...), rank 1 has other.json
        (sha256 bbbbbbbbbbbb...)
    """
    problems = []
    if missing:
        problems.append(
            f"ranks {_ranks(missing)} of {world} did not reach the agreement step within {timeout_s:g} s "
            f"(dead, stuck, or started without this apply_plan call); set {TIMEOUT_ENV} to wait longer"
        )
    plans = _groups(records, lambda r: r.plan_digest)
    if len(plans) > 1:
        problems.append(
            "ranks disagree: different plan: "
            + ", ".join(
                f"{_who(group)} {'has ' + group[0].plan_source if key else 'could not read ' + group[0].plan_source}"
                + (f" (sha256 {key[:12]}...)" if key else "")
                for key, group in plans
            )
        )
    models = _groups(records, lambda r: r.model_digest)
    if len(models) > 1:
        problems.append(
            "ranks disagree: different model: "
            + ", ".join(f"{_who(group)} a model with parameter table sha256 {key[:12]}..." for key, group in models)
        )
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


# -- every other rank sends its record and waits for the verdict ----------------------------------


def _join(record: Record, call: int, timeout_s: float) -> list[str]:
    host, port = master_endpoint()
    deadline = time.monotonic() + timeout_s
    conn, stranger = _connect(host, port, deadline)
    if conn is None:
        why = (
            f"something other than autodist listens on {host}:{port}; set {PORT_ENV} to a free port on every rank"
            if stranger
            else f"nothing listens on {host}:{port}; dead, stuck, or another plan?"
        )
        raise PlanError(
            f"agreement: rank 0 did not reach the agreement step within {timeout_s:g} s ({why}); "
            f"set {TIMEOUT_ENV} to wait longer",
            source=record.plan_source,
        )
    with conn:
        try:
            conn.settimeout(timeout_s)
            conn.sendall(json.dumps({"call": call, "record": asdict(record)}).encode() + b"\n")
            # Rank 0 decides by its own deadline, which is at most timeout_s after it listened.
            verdict = _await_verdict(conn, time.monotonic() + timeout_s + VERDICT_GRACE_S, timeout_s)
        except OSError as exc:  # reset or broken: rank 0 is gone
            verdict = [_lost(exc)]
        try:
            conn.sendall(ACK)  # this rank holds the verdict: rank 0 may leave
        except OSError:
            pass
    return verdict


def _connect(host: str, port: int, deadline: float) -> tuple[socket.socket | None, bool]:
    """A connection to rank 0 that greeted us, retried while refused (rank 0 not listening
    yet) or not greeted, until ``deadline``. Returns (None, whether a stranger answered) when
    none came."""
    wait, stranger = RETRY_MIN_S, False
    while True:
        conn = None
        try:
            conn = socket.create_connection((host, port), timeout=max(0.01, min(1.0, deadline - time.monotonic())))
            if _greeted(conn, min(GREETING_WAIT_S, deadline - time.monotonic())):
                return conn, False
            stranger = True
        except OSError:  # refused: not listening (yet)
            stranger = False
        if conn is not None:
            conn.close()
        if time.monotonic() + wait > deadline:
            return None, stranger
        time.sleep(wait)
        wait = min(2 * wait, RETRY_MAX_S)


def _greeted(conn: socket.socket, wait_s: float) -> bool:
    """Whether ``conn`` starts with rank 0's greeting within ``wait_s``."""
    received = b""
    conn.settimeout(max(0.001, wait_s))
    try:
        while len(received) < len(GREETING):
            chunk = conn.recv(len(GREETING) - len(received))
            if not chunk:
                return False
            received += chunk
    except TimeoutError:
        return False
    return received == GREETING


def _await_verdict(conn: socket.socket, deadline: float, timeout_s: float) -> list[str]:
    """Rank 0's verdict on ``conn``: the problems every rank raises (empty: all agree)."""
    buffer = bytearray()
    while not buffer.endswith(b"\n"):
        conn.settimeout(max(0.001, deadline - time.monotonic()))
        try:
            chunk = conn.recv(65536)
        except TimeoutError:
            return [f"agreement: rank 0 gave no verdict within {timeout_s:g} s (stuck?)"]
        if not chunk:
            return [_lost(ConnectionError("connection closed"))]
        if len(buffer) + len(chunk) > MAX_MESSAGE_BYTES:
            break
        buffer += chunk
    try:
        verdict = json.loads(buffer)["verdict"]
        if isinstance(verdict, list) and all(isinstance(p, str) for p in verdict):
            return verdict
    except (ValueError, TypeError, KeyError):
        pass
    return [
        f"agreement: the agreement port answered with something other than rank 0's verdict "
        f"(another program on it?); set {PORT_ENV} to a free port on every rank"
    ]


def _lost(exc: Exception) -> str:
    detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return (
        "agreement: lost the connection to rank 0 while ranks were agreeing on the plan "
        f"(rank 0 died or was stopped?): {detail}"
    )


# -- where rank 0 listens ---------------------------------------------------------------------------


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
