"""All ranks agree on plan and model before anything is sharded, and on the outcome after, or every rank stops.

A job's ranks can each hold a different checkout: another plan file, a plan with other data
sharding, a model of another size. Each rank's own checks cannot see that, and the first
collective then hangs or fails with a backend timeout that names nothing. So after its local
checks, every rank contributes one small record -- a digest of its plan, a digest of its model's
parameter table, its own problems -- and rank 0 compares them:

- all records equal and no problems: :func:`agree` returns an open :class:`Agreement` and
  sharding starts;
- otherwise every rank raises the same :class:`~autodist.schemas.PlanError`, naming which ranks
  differ and how (different plan, different model, failed validation);
- a rank that never arrives (dead, or stuck before ``apply_plan``) is named after a timeout
  (``timeout_s``, default :data:`DEFAULT_TIMEOUT_S`, or ``AUTODIST_AGREE_TIMEOUT`` seconds);
  a rank that loses rank 0 mid-way says so at once.

Then the ranks apply the plan, each on its own, with the connections kept open; before the
first communication (a pipeline's process groups, or Paddle's store for readable.py) they meet
once more (:meth:`Agreement.settle`, through :func:`applying`): a
rank that raised while applying tells the others, a rank that died is seen by its connection
closing, and every rank raises (the failed one its own error, the others a ``PlanError`` naming
it) instead of waiting in a collective its peer never joins.

The exchange is a plain TCP conversation, one line each way (docs/paddle-notes.md, "The
agreement step"). Rank 0 listens on the job's master address (or ``AUTODIST_AGREE_BIND``), on a
port the system picks free (or ``AUTODIST_AGREE_PORT``, for a firewall), and tells the others
where: on one machine in its key file, with the key (jobkey.py); across machines it posts the port,
signed, in Paddle's store (:class:`_Rank0Port`). No port of the job's is assumed free (the master's
port + 1, the old default, was now and then another job's). Every other rank connects::

    rank r > 0                                rank 0
    connect (retry while refused)  ---->  accept, until all world - 1 records or the deadline
    a fresh challenge              ---->
                                   <----  greeting: a fresh nonce and the challenge, signed
    its record and nonce, signed   ---->  decide
                                   <----  the verdict, signed            (to every rank that came)
    ack, signed                    ---->  wait for every ack (or that rank's connection closing)
    raise, or apply the plan              raise, or apply the plan
    "applied" or its failure       ---->  ...   (the same three steps again: Agreement.settle)

Every message is signed with an HMAC under the job's key (jobkey.py) over both nonces and the
round, so only the job's ranks take part: a record or verdict from any other process, or one
replayed from another connection, another round or another job, fails the check and is dropped.
Rank 0's first verdict also carries the job nonce, fresh at each agreement: what the ranks sign
after the agreement (the readable losses' answers, addresses and posted values) is under
:attr:`Agreement.job_key`, the job's key bound to it, so nothing recorded in one job is accepted
in another, even under the same secret. A greeting answers the rank's own fresh challenge, signed
over it: one recorded in an earlier job (or on another connection) and replayed, even under the
same secret, answers another challenge and is refused at once, in one line, before the rank sends
anything.
A rank sends nothing until rank 0's greeting checks out (a stranger on the port is hung up on
and named at the deadline; a greeting that shows rank 0 signing with another
``AUTODIST_AGREE_SECRET`` is an error at once, told to rank 0 under its key file's key on the
same machine: :func:`_another_secret`, :func:`_secret_notice`), and rank 0 keeps only
connections that send a signed record within 2 s, at most 16 at a time (the oldest goes first,
also when descriptors run out), so a flood of connections costs a bounded amount of memory and
CPU. The signed lines, the greeting and that bounded reception are signed.py's, shared with
readable.py's side channel.

The last step of each round is what makes the verdict reach every rank. Rank 0 raising is the
job failing: ``paddle.distributed.launch`` stops all other ranks within about a second of the
first one exiting non-zero (docs/paddle-notes.md), and a rank killed before it read the verdict
never reports it, while one that outlives rank 0 unread would report a lost connection instead.
So rank 0 leaves only once each rank that arrived holds the verdict: when its acknowledgement
arrives, or its connection closes (it died), or -- for a rank alive but frozen -- after
``timeout_s`` more. A rank > 0 acknowledges only after it has the whole verdict, and nothing it
receives later can replace it.

Every wait is a ``select``/socket timeout on one deadline, whatever the peer sends: nothing
polls, except a rank that arrives before rank 0 listens (or wrote its key), which retries after
2 ms, doubling up to 50 ms, and a rank 0 out of descriptors with no stranger to drop, which
stops accepting for 50 ms (signed.py).

Paddle's own stores carry nothing of the exchange but that port, across machines only, though
exchanging through one would need no listener of our own: its global store blocks, holding the
GIL, until every rank connects -- the hang this step exists to prevent, so across machines a rank
stuck before ``apply_plan`` holds the others in the store's making, as ``init_parallel_env``
would -- and its ``core.TCPStore`` has waits without deadlines and aborts the process in some
failures (docs/paddle-notes.md). Neither authenticates anyone either.

Example::

    >>> record = Record(1, "plan.json", digest(plan_bytes), model_digest)   # doctest: +SKIP
    >>> agreement = agree(record, rank=1, world=2, timeout_s=300)           # doctest: +SKIP
    Traceback (most recent call last):
    ...
    PlanError: plan.json: invalid plan: ranks disagree: different plan: rank 0 has old.json (sha256 ...), ...
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import itertools
import json
import os
import secrets
import selectors
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace

from autodist.applier.ranks.signed import (
    NONCE_BYTES,
    Heard,
    Reception,
    read_greeting,
    read_line,
    receive_line,
    seal,
    send_challenge,
    signed_greeting,
    strict_json,
    unseal,
)
from autodist.applier.ranks.jobkey import (
    SECRET_ENV,
    SECRET_FILE_ENV,
    has_secret,
    key_file,
    mismatch,
    new_key,
    one_host,
    rank0_key_file,
    read_key,
    remove_key,
)
from autodist.applier.ranks.store_host import global_store, master_address, post, wait_posted
from autodist.schemas import PlanError

#: Seconds a rank waits for the others; generous, since ranks reach apply_plan at different
#: times (model building, data loading). ``AUTODIST_AGREE_TIMEOUT`` overrides it.
DEFAULT_TIMEOUT_S = 300.0
TIMEOUT_ENV = "AUTODIST_AGREE_TIMEOUT"
#: The agreement port; default: the job's master port + 1.
PORT_ENV = "AUTODIST_AGREE_PORT"
#: The address rank 0 listens on; default: the job's master address (never all interfaces
#: unless set to 0.0.0.0).
BIND_ENV = "AUTODIST_AGREE_BIND"
#: A rank that finds nothing listening yet tries again after this long, doubling up to the max.
RETRY_MIN_S = 0.002
RETRY_MAX_S = 0.05
#: How long a rank waits for rank 0's verdict beyond rank 0's own deadline. A live rank 0
#: answers well within it; it bounds only the wait on a rank 0 that is alive but frozen.
VERDICT_GRACE_S = 10.0
#: The longest message accepted (a record is two digests, a path and the problem lines).
MAX_MESSAGE_BYTES = 1 << 20
#: How long a rank waits for rank 0's greeting before it hangs up and tries again (harmless if
#: rank 0 was merely slow: it drops the closed connection and accepts the next one).
GREETING_WAIT_S = 2.0
PROTOCOL = b"autodist agreement 3"
_MAX_RANKS_NAMED = 8
_RECORD_FIELDS = {"rank", "plan_source", "plan_digest", "model_digest", "problems"}

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
    return seconds_from(TIMEOUT_ENV, DEFAULT_TIMEOUT_S)


def seconds_from(env: str, default: float) -> float:
    """Seconds from the environment variable ``env``, ``default`` when it is unset or empty; any
    value but a positive finite number is one ``PlanError`` naming the variable (the owner of
    apply_plan's timeouts from the environment: this one's, and readable.py's).

    >>> seconds_from("AUTODIST_NO_SUCH_TIMEOUT", 300.0)
    300.0
    """
    text = os.environ.get(env)
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0 or value == float("inf"):
        raise PlanError(f"{env}={text!r}: expected a positive number of seconds", source="environment")
    return value


def digest(data: bytes) -> str:
    """``sha256`` hex of ``data``.

    >>> digest(b"")[:12]
    'e3b0c44298fc'
    """
    return hashlib.sha256(data).hexdigest()


def agree(record: Record, rank: int, world: int, timeout_s: float) -> Agreement:
    """Meet the other ranks; return an open :class:`Agreement` when all of them bring the same
    plan and model and found no problem, else raise the same :class:`PlanError` on every rank."""
    if world <= 1:
        if record.problems:
            raise PlanError(record.problems, source=record.plan_source)
        return Agreement(b"", rank, world, timeout_s, record.plan_source, [])
    if rank == 0:
        return _host(record, world, next(_CALLS), timeout_s)
    return _join(record, world, next(_CALLS), timeout_s)


@dataclass
class _Link:
    """One authenticated connection: to a rank > 0 (on rank 0), or to rank 0."""

    conn: socket.socket
    rank: int  # the rank at the other end
    #: Both nonces: every message after the record is signed over them and its round.
    nonces: bytes
    #: What was received past the last whole line (a rank's ack and its next report can arrive
    #: in one read).
    buffer: bytearray = field(default_factory=bytearray)

    def context(self, round_: int) -> bytes:
        return self.nonces + round_.to_bytes(4, "big")


class Agreement:
    """The ranks' connections, kept open from the agreement until they settle."""

    def __init__(
        self,
        key: bytes,
        rank: int,
        world: int,
        timeout_s: float,
        source: str,
        links: list[_Link],
        key_file=None,
        file_key: bytes | None = None,
    ):
        self.key, self.rank, self.world, self.timeout_s, self.source = key, rank, world, timeout_s, source
        self.links, self.key_file, self.file_key = links, key_file, file_key
        self.settled = False
        #: The job nonce: fresh at every agreement, drawn by rank 0 and sent with its signed
        #: verdict (b"" on one rank). Everything signed after the agreement is under :attr:`job_key`.
        self.job = b""

    @property
    def job_key(self) -> bytes:
        """The job's key bound to this run (:attr:`job`): what the readable losses sign with, so a
        value, address or answer recorded in another job -- even under the same secret -- checks
        out in no other.

        >>> a, b = Agreement(b"k" * 32, 0, 1, 1.0, "plan.json", []), Agreement(b"k" * 32, 0, 1, 1.0, "plan.json", [])
        >>> a.job, b.job = b"1" * 16, b"2" * 16
        >>> a.job_key == b.job_key
        False
        """
        return hmac.new(self.key, b"autodist job\0" + self.job, hashlib.sha256).digest()

    def settle(self, failure: BaseException | None = None) -> None:
        """Meet the other ranks once this rank applied the plan (``failure``: or failed to).
        Return when every rank applied it; else raise one :class:`PlanError` naming the ranks
        that failed, died or froze -- except on a rank that failed itself, which returns
        (telling the others was the point; its own error follows)."""
        if self.settled:
            return
        self.settled = True
        mine = [] if failure is None else [f"rank {self.rank} failed while applying the plan: {_describe(failure)}"]
        try:
            if self.world <= 1:
                verdict = mine
            elif self.rank == 0:
                verdict = _settle_host(self, mine)
            else:
                verdict = _settle_join(self, mine)
        except Exception:  # settling after a failure must not hide the failure
            if failure is None:
                raise
            return
        finally:
            self.close()
        if verdict and failure is None:
            raise PlanError(verdict, source=self.source)

    def close(self) -> None:
        for link in self.links:
            link.conn.close()
        remove_key(self.key_file, self.file_key)
        self.key_file = None


@contextmanager
def applying(agreement: Agreement) -> Iterator[Agreement]:
    """Apply the plan inside: if the body raises, the other ranks hear of it before the error
    propagates; when it ends, every rank settles (unless the body did already, before its
    first collective, with ``agreement.settle()``)."""
    try:
        yield agreement
    except BaseException as exc:
        agreement.settle(failure=exc)
        raise
    agreement.settle()


def _describe(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text}"[:500] if text else type(exc).__name__


# -- rank 0 gathers the records, decides, and waits until every rank holds the verdict ----------


def _host(record: Record, world: int, call: int, timeout_s: float) -> Agreement:
    host, port = master_host(), fixed_port()
    try:
        listener = _listen(os.environ.get(BIND_ENV) or host, port or 0)
    except OSError as err:
        hint = (
            f"{host} is not an address of this machine; set {BIND_ENV} to one (0.0.0.0: all interfaces)"
            if err.errno == errno.EADDRNOTAVAIL
            else f"set {PORT_ENV} to a free port on every rank, or unset it (a port the system picks)"
        )
        raise PlanError(
            f"agreement: rank 0 cannot listen on port {port or 'any'} ({err.strerror or err}); {hint}",
            source=record.plan_source,
        ) from None
    try:
        key, key_file, file_key = new_key(master_address(), listener.getsockname()[1])
        if not port and not one_host():  # the ranks on other machines learn the port from the store
            sealed = seal(key, PROTOCOL, "port", _store_name(call).encode(), str(listener.getsockname()[1]).encode())
            post(global_store(0), _store_name(call), sealed)
    except BaseException:
        listener.close()
        raise
    came: dict[int, tuple[_Link, Record]] = {}
    agreement = Agreement(key, 0, world, timeout_s, record.plan_source, [], key_file, file_key)
    agreement.job = secrets.token_bytes(NONCE_BYTES)
    try:
        with listener, selectors.DefaultSelector() as selector:
            keys = (key, file_key)
            malformed = _gather(listener, selector, keys, came, world, call, time.monotonic() + timeout_s)
            listener.close()  # a later call's ranks must not reach this one
            agreement.links = [link for link, _ in came.values()]
            records = sorted([record, *(r for _, r in came.values())], key=lambda r: r.rank)
            verdict = verdict_problems(records, _missing(came, world), world, timeout_s) + malformed
            _deliver(selector, agreement, 0, verdict, time.monotonic() + timeout_s)
    except BaseException:
        agreement.links = [link for link, _ in came.values()]
        agreement.close()
        raise
    if verdict:
        agreement.close()
        raise PlanError(verdict, source=record.plan_source)
    return agreement


def _listen(host: str, port: int) -> socket.socket:
    """A listening socket on ``host`` (rank 0's own address: loopback when the job is on loopback)."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, port))
        listener.listen(128)
        listener.setblocking(False)
    except OSError:
        listener.close()
        raise
    return listener


def _gather(
    listener, selector, keys: tuple[bytes, bytes | None], came: dict, world: int, call: int, deadline: float
) -> list[str]:
    """Accept connections and read signed records into ``came`` (``{rank: (link, record)}``)
    until all ``world - 1`` ranks came or ``deadline`` passed. ``keys``: the job's key and the
    key file's (None: none written). Returns the problems of records that were signed with the
    job's key but malformed, and of ranks that told, signed with the key file's key, that they
    sign with another key (:func:`_secret_notice`); each counts as a rank that came."""
    key, file_key = keys
    reception = Reception(listener, selector, key, PROTOCOL, MAX_MESSAGE_BYTES)
    malformed: list[str] = []
    try:
        while len(came) + len(malformed) < world - 1 and time.monotonic() < deadline:
            wake = reception.wake(deadline)
            for ready, _ in selector.select(timeout=max(0.0, wake - time.monotonic())):
                arrived = reception.ready(ready.fileobj)
                if arrived is None:
                    continue
                conn, greeted, line = arrived
                payload = unseal(key, PROTOCOL, "record", greeted.nonce, line) if line else None
                if payload is None:  # closed, or not signed with the job's key: not one of its ranks
                    conn.close()
                    notice = _secret_notice(file_key, greeted.nonce, line, world) if file_key and line else None
                    if notice:  # but a rank on this machine, signing with another secret, said so
                        malformed.append(notice)
                    continue
                hello = _parse_hello(payload, world)
                if isinstance(hello, str):
                    malformed.append(hello)
                    conn.close()
                    continue
                their_call, their_nonce, peer = hello
                if their_call != call:  # a rank that called apply_plan another number of times than rank 0
                    problem = f"agreement: this is its apply_plan call {their_call + 1}, rank 0's call {call + 1}"
                    peer = replace(peer, problems=[*peer.problems, problem])
                if peer.rank in came:  # the same rank again (it gave up on a slow greeting): keep the newer
                    came[peer.rank][0].conn.close()
                came[peer.rank] = (_Link(conn, peer.rank, greeted.nonce + their_nonce, greeted.buffer), peer)
    finally:
        reception.close()  # came, but sent no signed record in time: not counted
    return malformed


def _parse_hello(payload: bytes, world: int) -> tuple[int, bytes, Record] | str:
    """``(call, nonce, record)`` from a rank's signed first message, or the problem with it."""
    try:
        hello = strict_json(payload)
        call, nonce, fields = hello["call"], bytes.fromhex(hello["nonce"]), hello["record"]
        if type(call) is not int or not 0 <= call < 1 << 31 or len(nonce) != NONCE_BYTES:
            raise ValueError(f"call {call!r}, a nonce of {len(nonce)} bytes")
        if set(fields) != _RECORD_FIELDS:
            raise ValueError(f"fields {sorted(fields)}")
        record = Record(**fields)
        if type(record.rank) is not int or not 0 < record.rank < world:
            raise ValueError(f"rank {record.rank!r} of {world}")
        texts = [record.plan_source, record.plan_digest, record.model_digest]
        if not isinstance(record.problems, list) or not all(isinstance(t, str) for t in [*texts, *record.problems]):
            raise ValueError("a field that is not text")
    except Exception as err:  # whatever the JSON holds: TypeError, KeyError, RecursionError...
        return (
            f"agreement: a rank sent a malformed record ({_describe(err)}); do all ranks run the same autodist version?"
        )
    return call, nonce, record


def _secret_notice(file_key: bytes, nonce: bytes, line: bytes, world: int) -> str | None:
    """The problem a rank on this machine reports with a line signed under rank 0's key file's
    key (only this user's processes can read it): that it signs with another secret
    (:func:`_refuse_another_secret`); None for any other line."""
    payload = unseal(file_key, PROTOCOL, "another key", nonce, line)
    if payload is None:
        return None
    try:
        notice = strict_json(payload)
        rank, theirs = notice["rank"], notice["secret"]
    except Exception:
        return None
    if type(rank) is not int or not 0 < rank < world or type(theirs) is not bool:
        return None
    return f"agreement: {mismatch(f'rank {rank}', has_secret(), theirs)}"


def _missing(came: dict, world: int) -> list[int]:
    return [r for r in range(1, world) if r not in came]


def _deliver(selector, agreement: Agreement, round_: int, verdict: list[str], deadline: float) -> None:
    """Send every linked rank the verdict (and the job nonce), then wait until each acknowledged
    it, its connection closed (it died: nothing more to wait for), or ``deadline`` passed (frozen)."""
    key, links = agreement.key, agreement.links
    payload = json.dumps({"verdict": verdict, "job": agreement.job.hex()}).encode()
    waiting: list[_Link] = []
    for link in links:
        try:
            link.conn.setblocking(True)
            link.conn.settimeout(max(0.001, deadline - time.monotonic()))
            link.conn.sendall(seal(key, PROTOCOL, "verdict", link.context(round_), payload))
            link.conn.setblocking(False)
        except OSError:
            continue
        waiting.append(link)
    _read_lines(selector, waiting, deadline)  # the acks (or the connections closing)


def _read_lines(selector, links: list[_Link], deadline: float) -> dict[int, bytes]:
    """One line from each of ``links`` (``b""``: its connection closed) until ``deadline``:
    ``{rank: line}`` for the links that gave one."""
    lines: dict[int, bytes] = {}
    for link in links:
        selector.register(link.conn, selectors.EVENT_READ, link)
    try:
        while len(lines) < len(links) and time.monotonic() < deadline:
            ready = [link for link in links if link.rank not in lines and b"\n" in link.buffer]
            if not ready:
                events = selector.select(timeout=max(0.0, deadline - time.monotonic()))
                ready = [key.data for key, _ in events if key.data.rank not in lines]
            for link in ready:
                line = read_line(link.conn, link.buffer, MAX_MESSAGE_BYTES)
                if line is not None:
                    lines[link.rank] = line
    finally:
        for link in links:
            selector.unregister(link.conn)
    return lines


def _settle_host(agreement: Agreement, mine: list[str]) -> list[str]:
    """Rank 0's side of :meth:`Agreement.settle`: every rank's report, then the verdict."""
    deadline = time.monotonic() + agreement.timeout_s
    with selectors.DefaultSelector() as selector:
        for link in agreement.links:
            link.conn.setblocking(False)
        lines = _read_lines(selector, agreement.links, deadline)
        # None: the connection closed, or carried no signed report
        reports = {
            link.rank: _parse_report(unseal(agreement.key, PROTOCOL, "report", link.context(1), lines[link.rank]))
            for link in agreement.links
            if link.rank in lines
        }
        verdict = list(mine)
        for link in sorted(agreement.links, key=lambda link: link.rank):
            if link.rank not in reports:
                verdict.append(
                    f"rank {link.rank} did not finish applying the plan within {agreement.timeout_s:g} s (stuck?); "
                    f"set {TIMEOUT_ENV} to wait longer"
                )
            elif reports[link.rank] is None:
                verdict.append(f"rank {link.rank} lost its connection to rank 0 while applying the plan (died?)")
            else:
                verdict.extend(reports[link.rank] or [])
        _deliver(selector, agreement, 1, verdict, time.monotonic() + agreement.timeout_s)
    return verdict


def _parse_report(payload: bytes | None) -> list[str] | None:
    try:
        problems = strict_json(payload)["problems"] if payload is not None else None
    except Exception:
        return None
    return problems if isinstance(problems, list) and all(isinstance(p, str) for p in problems) else None


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


def _join(record: Record, world: int, call: int, timeout_s: float) -> Agreement:
    host = master_host()
    deadline = time.monotonic() + timeout_s
    conn, nonce, key, found = _connect(host, _Rank0Port(record.rank, call), master_address(), deadline, record)
    if conn is None:
        why = {
            # a rank 0 with another secret is named at its first greeting (_refuse_another_secret)
            "stranger": f"something other than this job's rank 0 listens on {host}:{fixed_port()}: another program "
            f"(set {PORT_ENV} to a free port on every rank, or unset it)",
            "nothing": f"nothing listens on {host}; dead, stuck, or another plan?",
            "no key": f"it wrote no key to {key_file(master_address())}; dead, stuck, or another TMPDIR (every rank "
            f"needs the same, or set {SECRET_FILE_ENV})",
            "no port": f"it posted no signed agreement port in the job's store; dead, stuck, or another {SECRET_ENV}?",
        }[found]
        raise PlanError(
            f"agreement: rank 0 did not reach the agreement step within {timeout_s:g} s ({why}); "
            f"set {TIMEOUT_ENV} to wait longer",
            source=record.plan_source,
        )
    mine = secrets.token_bytes(NONCE_BYTES)
    link = _Link(conn, 0, nonce + mine)
    agreement = Agreement(key, record.rank, world, timeout_s, record.plan_source, [link])
    hello = json.dumps({"call": call, "nonce": mine.hex(), "record": asdict(record)}).encode()
    # Rank 0 decides by its own deadline, at most timeout_s after it listened: one deadline for the
    # whole step, however long finding rank 0 took (a greeting replayed by another process once
    # made a rank wait about twice the timeout).
    verdict = _exchange(agreement, seal(key, PROTOCOL, "record", nonce, hello), 0, deadline + VERDICT_GRACE_S)
    if verdict:
        agreement.close()
        raise PlanError(verdict, source=record.plan_source)
    return agreement


def _settle_join(agreement: Agreement, mine: list[str]) -> list[str]:
    """A rank > 0's side of :meth:`Agreement.settle`: its report, then rank 0's verdict."""
    (link,) = agreement.links
    report = seal(agreement.key, PROTOCOL, "report", link.context(1), json.dumps({"problems": mine}).encode())
    # Rank 0 decides by its own deadline, at most timeout_s after this rank's report can reach it.
    return _exchange(agreement, report, 1, time.monotonic() + agreement.timeout_s + VERDICT_GRACE_S)


def _exchange(agreement: Agreement, message: bytes, round_: int, deadline: float) -> list[str]:
    """Send ``message`` to rank 0, wait for its verdict of this round until ``deadline`` and
    acknowledge it; the first round's verdict also gives the job nonce (``agreement.job``)."""
    (link,) = agreement.links
    waited = deadline - time.monotonic()
    try:
        link.conn.settimeout(max(0.001, waited))
        link.conn.sendall(message)
        verdict, job = _await_verdict(link.conn, agreement.key, link.context(round_), deadline, waited)
        agreement.job = job if round_ == 0 else agreement.job
    except OSError as exc:  # reset or broken: rank 0 is gone
        verdict = [_lost(exc)]
    try:
        link.conn.settimeout(1.0)
        link.conn.sendall(seal(agreement.key, PROTOCOL, "ack", link.context(round_), b"{}"))  # rank 0 may leave
    except OSError:
        pass
    return verdict


def _connect(host: str, ports: _Rank0Port, master: str, deadline: float, record: Record):
    """``(connection, rank 0's nonce, key, "")``: a connection to rank 0 whose greeting is
    signed with the job's key, retried while refused (rank 0 not listening yet) or not greeted,
    until ``deadline``. ``(None, None, None, what was found)`` when none came: "stranger" (a
    greeting that does not check out) if that was ever met -- it says more than the refusals
    after it --, else "nothing" (refused), "no key" (rank 0's key file never appeared) or
    "no port" (rank 0 posted no port in the store).
    A greeting that shows rank 0 signing with another secret (:func:`_another_secret`) is a
    ``PlanError`` at once, after telling rank 0 where it can."""
    wait, found = RETRY_MIN_S, "no key"
    while True:
        key = read_key(master)  # None until rank 0 wrote it (it does once it listens)
        port = ports.find(master, key, deadline) if key is not None else None
        if key is not None and port is None:
            found = "no port" if not one_host() else found
        conn = None
        if key is not None and port is not None:
            try:
                conn = socket.create_connection((host, port), timeout=max(0.01, min(1.0, deadline - time.monotonic())))
                challenge = send_challenge(conn, PROTOCOL)
                heard = read_greeting(conn, PROTOCOL, min(time.monotonic() + GREETING_WAIT_S, deadline))
                if heard is not None and heard.challenge != challenge:
                    conn.close()
                    raise PlanError(
                        f"agreement: the greeting at {host}:{port} answers another connection's challenge: one "
                        "recorded earlier (another job's rank 0, perhaps under the same secret) and replayed, not "
                        f"this run's rank 0; refused (is something else listening there? set {PORT_ENV} to a free port)",
                        source=record.plan_source,
                    )
                if heard is not None and signed_greeting(heard, key, PROTOCOL):
                    return conn, heard.nonce, key, ""
                if heard is not None:
                    _refuse_another_secret(conn, master, key, heard, record)
                found = "stranger"
            except OSError:  # refused: not listening (yet, or any more)
                found = "stranger" if found == "stranger" else "nothing"
            if conn is not None:
                conn.close()
        if time.monotonic() + wait > deadline:
            return None, None, None, found
        time.sleep(wait)
        wait = min(2 * wait, RETRY_MAX_S)


def _refuse_another_secret(conn: socket.socket, master: str, key: bytes, heard: Heard, record: Record) -> None:
    """Raise, naming the secret, when rank 0's greeting ``heard`` shows it signs with another
    secret (:func:`_another_secret`); first tell rank 0 so where this rank can (its key file's
    key): rank 0 reads it as this rank's record and need not wait for the timeout."""
    another = _another_secret(master, key, heard)
    if another is None:
        return
    theirs, file_key = another
    if file_key:
        notice = json.dumps({"rank": record.rank, "secret": has_secret()}).encode()
        _send_quietly(conn, seal(file_key, PROTOCOL, "another key", heard.nonce, notice))
    conn.close()
    raise PlanError(f"agreement: {mismatch('rank 0', has_secret(), theirs)}", source=record.plan_source)


def _another_secret(master: str, key: bytes, heard: Heard) -> tuple[bool | None, bytes | None] | None:
    """What a greeting of this protocol at rank 0's agreement endpoint (as the job's launch names
    it), not signed under this rank's ``key``, shows: ``(whether rank 0 has AUTODIST_AGREE_SECRET
    (None: not known), the key to tell rank 0 with: its key file's on this machine, else None)``
    when rank 0 signs with another secret; None when it shows nothing of the kind (another program
    on the port, or a key file this rank read before rank 0 replaced it: try again)."""
    mine = has_secret()
    found = rank0_key_file(master)
    if found is None:  # rank 0 on another machine: its greeting under another key is all there is
        return (None, None) if mine else None
    file_key, theirs = found.key, found.secret
    if not theirs and (mine == theirs or not signed_greeting(heard, file_key, PROTOCOL)):
        return None  # neither has a secret (an old key file), or not rank 0's greeting
    return theirs, file_key


def _send_quietly(conn: socket.socket, data: bytes) -> None:
    """Send ``data`` if ``conn`` takes it; a peer that left needs it no more."""
    try:
        conn.sendall(data)
    except OSError:
        pass


def _await_verdict(
    conn: socket.socket, key: bytes, context: bytes, deadline: float, timeout_s: float
) -> tuple[list[str], bytes]:
    """Rank 0's signed verdict on ``conn``: ``(the problems every rank raises (empty: all agree),
    the job nonce it came with)``."""
    line = receive_line(conn, deadline, MAX_MESSAGE_BYTES)
    if line is None:
        return [f"agreement: rank 0 gave no verdict within {timeout_s:.0f} s (stuck, or not rank 0?)"], b""
    if not line:
        return [_lost(ConnectionError("connection closed"))], b""
    try:
        message = strict_json(unseal(key, PROTOCOL, "verdict", context, line) or b"")
        verdict, job = message["verdict"], bytes.fromhex(message["job"])
        if isinstance(verdict, list) and all(isinstance(p, str) for p in verdict) and len(job) == NONCE_BYTES:
            return verdict, job
    except Exception:
        pass
    return [
        "agreement: the connection to rank 0 carried something other than its signed verdict (another "
        f"program on the port, or tampered with?); set {PORT_ENV} to a free port on every rank"
    ], b""


def _lost(exc: Exception) -> str:
    detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return f"agreement: lost the connection to rank 0 (rank 0 died or was stopped?): {detail}"


# -- where rank 0 listens ---------------------------------------------------------------------------


def master_host() -> str:
    """Rank 0's host: the job's master's (:func:`~autodist.applier.ranks.store_host.master_address`)."""
    host, _, port = master_address().rpartition(":")
    if not host or not port.isdigit():
        raise PlanError(
            "agreement: neither PADDLE_MASTER nor PADDLE_TRAINER_ENDPOINTS names rank 0's host:port; "
            "start the job with paddle.distributed.launch or set them",
            source="environment",
        )
    return host


def fixed_port() -> int | None:
    """``AUTODIST_AGREE_PORT`` when set (a port every rank's firewall lets through), else None:
    rank 0 listens on a port the system picks free and tells the others where (:class:`_Rank0Port`).

    >>> os.environ[PORT_ENV] = "70000"
    >>> fixed_port()
    Traceback (most recent call last):
    ...
    autodist.schemas.errors.PlanError: environment: invalid plan: AUTODIST_AGREE_PORT='70000': expected a port, 1 to 65535
    >>> del os.environ[PORT_ENV]
    """
    text = os.environ.get(PORT_ENV)
    if not text:
        return None
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise PlanError(f"{PORT_ENV}={text!r}: expected a port, 1 to 65535", source="environment")
    return int(text)


def _store_name(call: int) -> str:
    return f"autodist/agree/{call}/port"


@dataclass
class _Rank0Port:
    """Where a rank > 0 finds the port rank 0's agreement listens on: ``AUTODIST_AGREE_PORT``;
    else, on one machine, rank 0's key file (jobkey.py); else the job's store, where rank 0
    posted it signed (the store is made here if the script has not: as ``init_parallel_env``
    does, it waits until every rank joined it)."""

    rank: int
    call: int

    def find(self, master: str, key: bytes, deadline: float) -> int | None:
        """The port, or None when rank 0 has not said it yet (or not under ``key``)."""
        port = fixed_port()
        if port:
            return port
        if one_host():
            found = rank0_key_file(master)
            return found.port if found else None
        name = _store_name(self.call)
        sealed = wait_posted(global_store(self.rank), name, deadline)
        if sealed is None:
            return None
        text = unseal(key, PROTOCOL, "port", name.encode(), sealed)
        if text is None:  # only rank 0 posts there: it signs with another secret
            raise PlanError(f"agreement: {mismatch('rank 0', has_secret(), None)}", source="environment")
        return int(text) if text.isdigit() and 0 < int(text) < 65536 else None
