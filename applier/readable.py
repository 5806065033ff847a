"""A loss is readable on any rank: ``if rank == 0: print(float(loss))`` works under every plan.

The problem. Under data parallelism each rank computes its share of the batch, so a mean loss
is a DistTensor whose placement is ``Partial`` over ``dp``: each rank holds its own shard's
mean, and the global value needs an all-reduce. Paddle does that all-reduce when the value is
read (``float``, ``.item()``, ``.numpy()``, ``print``) — a collective, so a read on rank 0
alone sends rank 0 into an all-reduce the other ranks never join: gloo aborts
(``op.preamble.length <= op.nbytes``), NCCL hangs.

The mechanism. Nothing changes in the forward, the backward or what the model returns. Each
scalar with a ``Partial`` placement made by a reduction (``mean``, ``mean_all``, ``sum``) or
by arithmetic on one (``loss / k``, ``loss.detach()``, ``loss.astype(...)``) is *noted* on
every rank: the rank keeps a reference to its own local value (no copy, no communication),
under a key that is the same on every rank because every rank makes the same values in the same
order: (number of calls of the returned model so far, index of the value since that call).
Reading such a scalar on any subset of ranks asks the other ranks of its ``Partial`` group
for their local values over a side channel — a small TCP server thread per rank, whose
address each rank posts once in Paddle's own TCP store when ``apply_plan`` runs — and
combines them (sum, mean, max or min, as the placement says). The other ranks answer from
their thread while their training thread goes on (Paddle releases the GIL in its collectives),
so a reader never waits on the others' loop.

Only the job's ranks can ask or answer. The side channel talks as the agreement does
(signed.py): each server listens on its rank's own address only (``PADDLE_CURRENT_ENDPOINT``'s
host, never all interfaces) and greets every connection with a fresh nonce; a request and its
answer are lines signed with an HMAC under a key derived from the job's (the agreement's,
jobkey.py) over both ends' nonces, so a process without the key can neither read a value nor
pass for a rank, and a recorded answer fails on any other read. A connection that sends no
signed request gets no thread, is dropped after 2 s or 64 KiB, and at most 16 are kept (the
oldest go first); signed requests are answered by at most :data:`MAX_ANSWERING` threads at once.
A read has one deadline (``AUTODIST_READ_TIMEOUT``, default 300 s), whatever the peer sends,
and ends in a :class:`ReadError`. Posted values (a plan with expert hooks, below) are signed the
same way (over their store key): one a stranger wrote into Paddle's store is refused.

The cost. Reading on no rank costs no communication at all: noting a value is a local
reference and a dictionary entry (:func:`stats` counts values noted, reads and values fetched,
and ``tests/loops/test_readable.py`` checks that two steps no rank reads fetch, serve and post
nothing on any rank). One exception, a plan whose forward runs collectives the applier issues
from Python: expert hooks (expert parallelism, or an MoE model under plain dp: applier/experts.py),
local views and local token lookups (applier/local_view.py, applier/vocab_lookup.py). Those are
``dist.reshard`` calls, and Paddle holds Python's GIL while such a call waits for the
other ranks (measured: docs/paddle-notes.md, "Reading a value on some ranks"), so a rank waiting
there for the reader could not answer it from its thread (seen: every rank reading an evaluation
loss under dp2 x mp2 with a local lookup, rank 0 already in the next batch's lookup, its mp peer
still waiting for rank 0's part: both timed out in gloo). Under such a plan
each value is therefore *posted* to the store as it is made: one small store message per noted scalar (one a step
for the Mixtral-style model's loss in tests/loops/test_readable.py), signed (an HMAC of a
hundred bytes), and on a GPU the device-to-host copy of it.
Each read of a value not read before on this rank costs one round trip to each other rank of
its group (a few hundred bytes). The one-time costs: a server thread and two store keys (its address, and a
counter saying it is there) per rank at ``apply_plan``, and at exit every rank waits for the others to exit too (one store
counter), so that a rank reading the final loss still finds its peers. The last
:data:`KEEP` noted values are kept per rank: that many one-element tensors (on a GPU, each
takes its allocator's smallest block).

What it does not do. A value made on some ranks only (a reduction inside
``if rank == 0:``) has no peers to ask and shifts that rank's keys; such a value cannot be
read correctly anywhere but where all its ranks made it. Non-scalar outputs split over ranks
(the logits under dp) are read as Paddle reads them: on every rank of their mesh.

Example::

    >>> model, opt, loader = apply_plan(model, opt, loader, "plan.json")   # doctest: +SKIP
    >>> loss = F.cross_entropy(model(x), y)          # Partial over dp        # doctest: +SKIP
    >>> if dist.get_rank() == 0:                                             # doctest: +SKIP
    ...     print(float(loss))                       # the global batch's mean loss
"""

from __future__ import annotations

import atexit
import collections
import hashlib
import hmac
import json
import os
import secrets
import selectors
import socket
import sys
import threading
import time
from typing import Any, Callable

import numpy as np
import paddle
import paddle.distributed as dist
from autodist.applier.agree import seconds_from
from autodist.applier.layout import rank_coords
from autodist.applier.signed import NONCE_BYTES, Pending, Reception, greeted, receive_line, seal, strict_json, unseal
from autodist.applier.store_host import global_store

#: How many noted values each rank keeps for readers (the oldest are dropped first).
KEEP = 16384
#: Seconds a reader waits for a peer's value (``AUTODIST_READ_TIMEOUT`` overrides: :func:`read_timeout`).
DEFAULT_TIMEOUT_S = 300.0
TIMEOUT_ENV = "AUTODIST_READ_TIMEOUT"
_STORE_PREFIX = "autodist/readable/"
#: The side channel's messages are signed.py's lines under this name and the job's key (the
#: agreement's, derived for this channel): only the job's ranks can ask or answer.
PROTOCOL = b"autodist readable 1"
#: The longest request or answer accepted (an answer is one scalar: a few hundred bytes).
MAX_MESSAGE_BYTES = 1 << 16
#: At most this many signed requests are answered at once, each by a thread that waits for its
#: value; one more gets an error at once. Unsigned connections get no thread (signed.Reception).
MAX_ANSWERING = 64
#: A noted value's name, the same on every rank that made it: ``("value", model calls, index)``
#: or ``("pipeline", step, micro-batch)``.
Key = tuple
#: The reductions a loss ends in, looked up in ``paddle._C_ops`` by Paddle at each call.
_REDUCTIONS = ("mean", "mean_all", "sum")
#: Tensor methods that keep a noted scalar noted (``loss / k``, ``loss.detach()``, ...).
_ARITHMETIC = (
    "__truediv__", "__rtruediv__", "__mul__", "__rmul__", "__add__", "__radd__", "__sub__", "__rsub__",
    "__neg__", "detach", "clone", "astype", "cast", "scale",
)  # fmt: skip
_COMBINE: dict[str, Callable[[list[np.ndarray]], np.ndarray]] = {
    "kRedSum": lambda parts: np.sum(parts, axis=0),
    "kRedAvg": lambda parts: np.mean(parts, axis=0),
    "kRedMax": lambda parts: np.max(parts, axis=0),
    "kRedMin": lambda parts: np.min(parts, axis=0),
}


class ReadError(RuntimeError):
    """A noted value could not be read (a peer never made it, left, or did not answer)."""


class _Notes:
    """This rank's noted values, by key, and the side channel that serves them."""

    def __init__(self, rank: int, world: int, key: bytes, timeout_s: float = DEFAULT_TIMEOUT_S):
        self.rank, self.world = rank, world
        #: The side channel's key, derived from the job's (jobkey.py, the agreement's).
        self.key = hmac.new(key, PROTOCOL, hashlib.sha256).digest()
        self.answering = 0  # signed requests being answered (bounded by MAX_ANSWERING)
        self.post = False  # post every value to the store as it is made (see install)
        self.calls = 0  # calls of the model apply_plan returned
        self.index = 0  # values noted since the last call
        self.pipeline_steps = 0  # pipeline steps whose losses were published (last stage)
        self.values: collections.OrderedDict[Key, dict] = collections.OrderedDict()
        self.changed = threading.Condition()
        self.counts = {"noted": 0, "posted": 0, "reads": 0, "fetched": 0, "served": 0}
        self.addresses: dict[int, tuple[str, int]] = {}
        self.store: Any = None
        self.timeout_s = timeout_s

    # -- noting ------------------------------------------------------------------------------

    def model_called(self) -> None:
        with self.changed:
            self.calls += 1
            self.index = 0
            self.changed.notify_all()

    def note(self, tensor: paddle.Tensor, op: str) -> None:
        local = tensor._local_value().detach()
        with self.changed:
            key = ("value", self.calls, self.index)
            self.index += 1
            self._keep(key, {"read": local.numpy, "op": op})
        tensor._autodist_read_key = key

    def publish_pipeline_losses(self, losses: list[paddle.Tensor]) -> None:
        with self.changed:
            for i, loss in enumerate(losses):
                self._keep(("pipeline", self.pipeline_steps, i), {"read": lambda loss=loss: _value(loss), "op": "loss"})
            self.pipeline_steps += 1

    def _keep(self, key: Key, entry: dict) -> None:
        if self.post:
            slot = _slot(self.rank, key)
            posted = json.dumps({"key": list(key), **_reply(entry)}).encode()
            self.store.set(slot, seal(self.key, PROTOCOL, "posted", slot.encode(), posted))
            self.counts["posted"] += 1
        self.values[key] = entry
        while len(self.values) > KEEP:
            self.values.popitem(last=False)
        self.counts["noted"] += 1
        self.changed.notify_all()

    def _made_after(self, key: Key) -> bool:
        """True when this rank has gone past ``key`` (it will never make it now)."""
        progress = (self.calls, self.index) if key[0] == "value" else (self.pipeline_steps, 0)
        return progress > tuple(key[1:])

    # -- serving (the server thread) ---------------------------------------------------------

    def wait_for(self, key: Key) -> dict:
        deadline = time.monotonic() + self.timeout_s
        with self.changed:
            while key not in self.values:
                if self._made_after(key):
                    raise ReadError(
                        f"rank {self.rank} has no value {key}: it was dropped (more than {KEEP} values ago) "
                        "or never made here (made inside a branch only some ranks ran?)"
                    )
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ReadError(f"rank {self.rank} did not make value {key} within {self.timeout_s:.0f} s")
                self.changed.wait(min(left, 1.0))
            self.counts["served"] += 1
            return self.values[key]

    def serve(self, listener: socket.socket) -> None:
        """The server thread: greet every connection (signed.Reception: unsigned ones are few,
        brief and get no thread), answer each request signed with the job's key from a thread
        of its own, at most :data:`MAX_ANSWERING` at once; drop anything else."""
        listener.setblocking(False)
        with selectors.DefaultSelector() as selector:
            reception = Reception(listener, selector, self.key, PROTOCOL, MAX_MESSAGE_BYTES)
            while True:
                wake = reception.wake(time.monotonic() + 60.0)
                for ready, _ in selector.select(timeout=max(0.0, wake - time.monotonic())):
                    arrived = reception.ready(ready.fileobj)
                    if arrived is not None:
                        self._take(*arrived)

    def _take(self, conn: socket.socket, greeting: Pending, line: bytes) -> None:
        """A greeted connection's first line: a signed request gets an answering thread; anything
        else (closed, unsigned, malformed) is hung up on."""
        request = _request(unseal(self.key, PROTOCOL, "request", greeting.nonce, line) if line else None)
        if request is None:
            conn.close()
            return
        key, their_nonce = request
        context = greeting.nonce + their_nonce
        with self.changed:
            busy = self.answering >= MAX_ANSWERING
            if not busy:
                self.answering += 1
        if not busy:
            try:
                threading.Thread(target=self._answer, args=(conn, context, key), daemon=True).start()
                return
            except RuntimeError:  # "can't start new thread": out of resources, as busy
                with self.changed:
                    self.answering -= 1
        # answered from here: a few bytes into an empty socket buffer
        self._send(conn, context, {"error": f"rank {self.rank} is answering {MAX_ANSWERING} reads already"})

    def _answer(self, conn: socket.socket, context: bytes, key: Key) -> None:
        try:
            try:
                reply = _reply(self.wait_for(key))
            except Exception as err:  # the reader raises it; this thread ends
                reply = {"error": str(err)}
            self._send(conn, context, reply)
        finally:
            with self.changed:
                self.answering -= 1

    def _send(self, conn: socket.socket, context: bytes, reply: dict) -> None:
        with conn:
            try:
                conn.setblocking(True)
                conn.settimeout(self.timeout_s)
                conn.sendall(seal(self.key, PROTOCOL, "answer", context, json.dumps(reply).encode()))
            except OSError:  # the reader gave up: nothing to tell
                pass

    # -- reading -----------------------------------------------------------------------------

    def fetch(self, peer: int, key: Key, op: str) -> np.ndarray:
        reply = self._posted(peer, key) if self.post else self._asked(peer, key)
        if "error" in reply:
            raise ReadError(f"reading a loss on rank {self.rank}: {reply['error']}")
        if reply["op"] != op:
            raise ReadError(
                f"reading a loss on rank {self.rank}: rank {peer}'s value {key} came from {reply['op']}, "
                f"this rank's from {op}: the ranks made different values (a branch only some ranks ran?)"
            )
        try:
            value = np.frombuffer(bytes.fromhex(reply["hex"]), dtype=reply["dtype"]).reshape(reply["shape"])
        except (ValueError, TypeError) as err:
            raise ReadError(
                f"reading a loss on rank {self.rank}: rank {peer}'s value {key} is malformed: {err}"
            ) from None
        self.counts["fetched"] += 1
        return value

    def _posted(self, peer: int, key: Key) -> dict:
        """The value ``peer`` posted under ``key``, waiting for it to be posted."""
        deadline = time.monotonic() + self.timeout_s
        slot = _slot(peer, key)
        while True:
            reply = _answer(unseal(self.key, PROTOCOL, "posted", slot.encode(), bytes(self.store.get(slot))))
            if reply is None or not isinstance(reply.get("key"), list):
                return {
                    "error": f"rank {peer}'s posted value {key} is not signed with the job's key (another process?)"
                }
            made = tuple(reply.pop("key"))
            if made == tuple(key):
                return reply
            if made > tuple(key):
                return {"error": f"rank {peer} no longer keeps value {key} (overwritten by {made})"}
            if time.monotonic() > deadline:
                return {"error": f"rank {peer} did not make value {key} within {self.timeout_s:.0f} s"}
            time.sleep(0.005)

    def _asked(self, peer: int, key: Key) -> dict:
        """The value ``peer``'s server thread answers for ``key``: one deadline for the whole
        exchange; the answer must be signed over both ends' nonces (no replay, no stranger)."""
        deadline = time.monotonic() + self.timeout_s
        host, port = self.address(peer, deadline)
        where = f"rank {peer} ({host}:{port})"
        try:
            with socket.create_connection((host, port), timeout=self.timeout_s) as conn:
                theirs = greeted(conn, self.key, PROTOCOL, deadline)
                if theirs is None:
                    raise ReadError(
                        f"reading a loss on rank {self.rank}: {where} did not greet as a rank of this job within "
                        f"{self.timeout_s:g} s (another program on its port, or stuck?)"
                    )
                mine = secrets.token_bytes(NONCE_BYTES)
                request = json.dumps({"key": list(key), "nonce": mine.hex()}).encode()
                conn.settimeout(max(0.001, deadline - time.monotonic()))
                conn.sendall(seal(self.key, PROTOCOL, "request", theirs, request))
                line = receive_line(conn, deadline, MAX_MESSAGE_BYTES)
        except OSError as err:
            raise ReadError(f"reading a loss on rank {self.rank}: {where} did not answer ({err})") from err
        if line is None:
            raise ReadError(f"reading a loss on rank {self.rank}: {where} did not answer within {self.timeout_s:g} s")
        reply = _answer(unseal(self.key, PROTOCOL, "answer", theirs + mine, line)) if line else None
        if reply is None:
            raise ReadError(
                f"reading a loss on rank {self.rank}: {where} "
                + ("closed the connection" if not line else "sent something other than its signed answer")
            )
        return reply

    def address(self, peer: int, deadline: float | None = None) -> tuple[str, int]:
        """Where ``peer``'s side channel listens, as it posted in Paddle's store (waiting for it
        until ``deadline``: the store's own ``get`` would wait its 900 s, holding the GIL)."""
        if peer not in self.addresses:
            deadline = time.monotonic() + self.timeout_s if deadline is None else deadline
            while self.store.add(f"{_STORE_PREFIX}{peer}/posted", 0) < 1:
                if time.monotonic() > deadline:
                    raise ReadError(
                        f"reading a loss on rank {self.rank}: rank {peer} posted no address within "
                        f"{self.timeout_s:g} s (it never finished apply_plan, or died)"
                    )
                time.sleep(0.01)
            text = self.store.get(f"{_STORE_PREFIX}{peer}")
            host, _, port = bytes(text[:300]).decode("ascii", "replace").rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ReadError(f"reading a loss on rank {self.rank}: rank {peer}'s posted address is not host:port")
            self.addresses[peer] = (host, int(port))
        return self.addresses[peer]


def _request(payload: bytes | None) -> tuple[Key, bytes] | None:
    """``(key, the reader's nonce)`` from a signed request's payload; None if it is none."""
    if payload is None:
        return None
    try:
        request = strict_json(payload)
        kind, *numbers = request["key"]
        nonce = bytes.fromhex(request["nonce"])
    except Exception:
        return None
    if kind not in ("value", "pipeline") or len(numbers) != 2 or len(nonce) != NONCE_BYTES:
        return None
    if not all(type(n) is int and 0 <= n < 1 << 62 for n in numbers):
        return None
    return (kind, *numbers), nonce


def _answer(payload: bytes | None) -> dict | None:
    """A signed answer's payload: ``{"error": text}`` or the value (:func:`_reply`); None if it is none."""
    if payload is None:
        return None
    try:
        reply = strict_json(payload)
    except Exception:
        return None
    if not isinstance(reply, dict):
        return None
    if isinstance(reply.get("error"), str):
        return reply
    fields = (reply.get("op"), reply.get("dtype"), reply.get("hex"))
    shape = reply.get("shape")
    if not all(isinstance(f, str) for f in fields) or not isinstance(shape, list):
        return None
    return reply if all(type(n) is int and 0 <= n for n in shape) else None


_NOTES: _Notes | None = None


def _reply(entry: dict) -> dict:
    value = np.asarray(entry["read"]())
    return {"op": entry["op"], "dtype": str(value.dtype), "shape": list(value.shape), "hex": value.tobytes().hex()}


def _slot(rank: int, key: Key) -> str:
    """The store key a posted value lives under: one of a bounded set per rank (the first
    number wraps), the full key kept in the value."""
    kind, first, *rest = key
    return f"{_STORE_PREFIX}{rank}/{kind}/{first % 1024}/" + "/".join(map(str, rest))


class RemoteLoss:
    """A loss a pipeline's last stage computed, on a rank of another stage: reading it
    (``float``, ``.item()``, ``.numpy()``, ``print``, ``f"{loss:.4f}"``) fetches the value from
    that stage's rank of this rank's pipeline, once; holding it unread costs nothing."""

    def __init__(self, peer: int, key: Key):
        self._peer, self._key = peer, key
        self._value: np.ndarray | None = None

    def numpy(self) -> np.ndarray:
        if self._value is None:
            assert _NOTES is not None
            _NOTES.counts["reads"] += 1
            self._value = _NOTES.fetch(self._peer, self._key, "loss")
        return self._value.copy()

    def item(self) -> Any:
        return self.numpy().reshape(-1)[0].item()

    def tolist(self) -> Any:
        return self.numpy().tolist()

    def __float__(self) -> float:
        return float(self.item())

    def __format__(self, spec: str) -> str:
        return format(self.item(), spec)

    def __repr__(self) -> str:
        return f"RemoteLoss({self.item()!r}, from rank {self._peer})"


def pipeline_losses(losses: list[paddle.Tensor], holds_last: bool, last_rank: int, count: int) -> list[Any]:
    """What a pipeline step returns on every rank: on the last stage ``losses`` (published to
    the other stages' ranks, which fetch them only when they read them), elsewhere ``count``
    :class:`RemoteLoss` handles on ``last_rank``. Without :func:`install` (one rank), ``losses``."""
    notes = _NOTES
    if notes is None:
        return losses
    if holds_last:
        notes.publish_pipeline_losses(losses)
        return losses
    step = notes.pipeline_steps
    notes.pipeline_steps += 1
    return [RemoteLoss(last_rank, ("pipeline", step, i)) for i in range(count)]


def stats() -> dict[str, int]:
    """This rank's counts: values ``noted``, ``posted`` to the store (plans with expert hooks only),
    ``reads`` of them, values ``fetched`` from other ranks and ``served`` to them. All zero
    before :func:`install`."""
    return dict(_NOTES.counts) if _NOTES else {"noted": 0, "posted": 0, "reads": 0, "fetched": 0, "served": 0}


def read_timeout() -> float:
    """Seconds a read waits (``AUTODIST_READ_TIMEOUT``, else :data:`DEFAULT_TIMEOUT_S`): a bad
    value is one ``PlanError`` naming the variable, which apply_plan raises before it touches
    anything (agree.seconds_from, as for ``AUTODIST_AGREE_TIMEOUT``)."""
    return seconds_from(TIMEOUT_ENV, DEFAULT_TIMEOUT_S)


def install(model: paddle.nn.Layer, key: bytes, post: bool = False, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Make noted scalars readable on any rank; count ``model``'s calls for their keys.
    ``key``: the job's key (the agreement's, jobkey.py), the same on every rank: the side
    channel's messages and posted values are signed under a key derived from it.
    ``post``: post every value to the store as it is made (for plans whose ranks wait in
    GIL-holding collectives: a plan with expert hooks). ``timeout_s``: how long a read waits
    (:func:`read_timeout`), fixed by the first call.

    Called by ``apply_plan`` on every rank of a job of more than one rank. The first call per
    process starts the server, posts its address and patches Paddle's reads; later calls
    (another plan applied in the same process) only count the new model's calls too.
    """
    global _NOTES
    if dist.get_world_size() < 2:
        return
    if _NOTES is None:
        notes = _Notes(dist.get_rank(), dist.get_world_size(), key, timeout_s)
        notes.store = global_store(notes.rank)  # rank 0 then serves it: warmed up for its exit
        # This rank's own address only (never all interfaces), any free port.
        host = os.environ.get("PADDLE_CURRENT_ENDPOINT", "").rpartition(":")[0] or "127.0.0.1"
        server = socket.create_server((host, 0))
        threading.Thread(target=notes.serve, args=(server,), daemon=True, name="autodist-readable").start()
        notes.store.set(f"{_STORE_PREFIX}{notes.rank}", f"{host}:{server.getsockname()[1]}".encode())
        notes.store.add(f"{_STORE_PREFIX}{notes.rank}/posted", 1)  # a reader's wait for it has a deadline
        _NOTES = notes
        _patch()
        atexit.register(_wait_for_peers_at_exit)
        sys.excepthook = _failing(sys.excepthook)
    _NOTES.post = _NOTES.post or post
    model.register_forward_pre_hook(lambda layer, args: _NOTES.model_called() if _NOTES else None)


# -- what is noted, and how a read finds it ---------------------------------------------------------


def _is_partial_scalar(value: Any) -> bool:
    return (
        isinstance(value, paddle.Tensor)
        and value.is_dist()
        and value._is_initialized()
        and int(np.prod(value.shape)) == 1
        and any(p.is_partial() for p in value.placements)
    )


def _noting(function: Callable, op: str) -> Callable:
    def noted(*args: Any, **kwargs: Any) -> Any:
        out = function(*args, **kwargs)
        if _NOTES is not None and _is_partial_scalar(out):
            _NOTES.note(out, op)
        return out

    noted.__wrapped__ = function  # type: ignore[attr-defined]
    return noted


def _value(tensor: paddle.Tensor) -> np.ndarray:
    """A tensor's value on this rank: combined when it is a noted scalar, this rank's local
    value of a DistTensor otherwise (a replicated one), or the dense tensor's."""
    combined = _global_value(tensor)
    if combined is not None:
        return combined
    return (tensor._local_value() if tensor.is_dist() else tensor).numpy()


def _global_value(tensor: paddle.Tensor) -> np.ndarray | None:
    """The value of a noted scalar, combined from its group's ranks; None if not noted."""
    key = getattr(tensor, "_autodist_read_key", None)
    if key is None or _NOTES is None:
        return None
    cached = getattr(tensor, "_autodist_read_value", None)
    if cached is not None:
        return cached
    notes = _NOTES
    notes.counts["reads"] += 1
    entry = notes.values.get(key)
    if entry is None:
        raise ReadError(f"rank {notes.rank} no longer keeps value {key} (more than {KEEP} values ago)")
    placements = tensor.placements
    partial = [d for d, p in enumerate(placements) if p.is_partial()]
    kinds = {placements[d].reduce_type().name for d in partial}
    if len(kinds) != 1 or next(iter(kinds)) not in _COMBINE:
        raise ReadError(f"cannot combine a loss partial over several reductions {sorted(kinds)}")
    parts = [
        np.asarray(entry["read"]()) if peer == notes.rank else notes.fetch(peer, key, entry["op"])
        for peer in _group(tensor.process_mesh, partial, notes.rank)
    ]
    value = _COMBINE[next(iter(kinds))](parts).astype(parts[0].dtype).reshape(tensor.shape)
    tensor._autodist_read_value = value
    return value


def _group(mesh: dist.ProcessMesh, dims: list[int], rank: int) -> list[int]:
    """The ranks of ``mesh`` that share ``rank``'s coordinates on every dim but ``dims``.

    >>> _group(dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"]), [0], rank=3)
    [1, 3]
    """
    ids = np.array(mesh.process_ids).reshape(mesh.shape)
    where = rank_coords(ids, rank)
    assert where is not None  # a noted value's mesh holds the rank that made it
    index = tuple(slice(None) if d in dims else where[d] for d in range(ids.ndim))
    return [int(r) for r in np.ravel(ids[index])]


# -- Paddle's reads, and the ops that make a loss ------------------------------------------------------


def _reading(original: Callable, convert: Callable[[np.ndarray, tuple, dict], Any]) -> Callable:
    def read(self: paddle.Tensor, *args: Any, **kwargs: Any) -> Any:
        value = _global_value(self)
        return original(self, *args, **kwargs) if value is None else convert(value, args, kwargs)

    read.__wrapped__ = original  # type: ignore[attr-defined]
    return read


def _as_string(value: np.ndarray, args: tuple, kwargs: dict) -> str:
    from paddle.tensor.to_string import tensor_to_string

    return tensor_to_string(paddle.to_tensor(value))


_READS: dict[str, Callable[[np.ndarray, tuple, dict], Any]] = {
    "numpy": lambda v, a, k: v.copy(),
    "__array__": lambda v, a, k: v.astype(a[0]) if a and a[0] is not None else v.copy(),
    "item": lambda v, a, k: v.reshape(-1)[a[0] if a else 0].item(),
    "tolist": lambda v, a, k: v.tolist(),
    "__float__": lambda v, a, k: float(v.reshape(-1)[0]),
    "__int__": lambda v, a, k: int(v.reshape(-1)[0]),
    "__bool__": lambda v, a, k: bool(v.reshape(-1)[0]),
    "__format__": lambda v, a, k: v.reshape(-1)[0].item().__format__(*a) if not v.shape else object.__format__(v, *a),
    "__str__": _as_string,
    "__repr__": _as_string,
}


def _patch() -> None:
    for name, convert in _READS.items():
        setattr(paddle.Tensor, name, _reading(getattr(paddle.Tensor, name), convert))
    for name in _ARITHMETIC:
        setattr(paddle.Tensor, name, _noting(getattr(paddle.Tensor, name), name.strip("_")))
    for name in _REDUCTIONS:
        setattr(paddle._C_ops, name, _noting(getattr(paddle._C_ops, name), name))


def _wait_for_peers_at_exit() -> None:
    """Stay until every rank is exiting, so a rank reading the last loss finds its peers, and no
    longer than the read timeout (a peer that died never counts itself). Skipped after an
    uncaught exception (the job is failing; nobody will read)."""
    notes = _NOTES
    if notes is None:
        return
    try:
        if not _FAILED:
            _wait_for_peers(notes)
    finally:
        # Drop the kept tensors now, while Paddle is whole: left to the interpreter's teardown,
        # they are freed after Paddle's own state and can crash the process at exit.
        with notes.changed:
            notes.values.clear()


def _wait_for_peers(notes: _Notes) -> None:
    deadline = time.monotonic() + notes.timeout_s
    try:
        _arrive(notes, "exit", deadline, wait=True)
        # Paddle's store is served from rank 0's process: rank 0 leaves last, once no peer will ask
        # the store anything more. A peer's poll served while rank 0's process was finalising
        # crashed rank 0 (SIGSEGV at the end of a job, seen in full-suite runs).
        _arrive(notes, "left", deadline, wait=notes.rank == 0)
    except Exception:  # rank 0, the store's host, has gone: nobody is left to read from us
        pass


def _arrive(notes: _Notes, name: str, deadline: float, wait: bool) -> None:
    """Count this rank in the store counter ``name``; with ``wait``, stay until every rank has
    been counted or the deadline passes."""
    key = f"{_STORE_PREFIX}{name}"
    notes.store.add(key, 1)
    while wait and notes.store.add(key, 0) < notes.world and time.monotonic() < deadline:
        time.sleep(0.02)


_FAILED = False


def _failing(excepthook: Callable) -> Callable:
    """``excepthook``, after noting that this rank is failing (so it does not wait at exit)."""

    def hook(*args: Any) -> None:
        global _FAILED
        _FAILED = True
        excepthook(*args)

    return hook
