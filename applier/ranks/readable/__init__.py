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
under a key that is the same on every rank (notes.py).
Reading such a scalar on any subset of ranks asks the other ranks of its ``Partial`` group
for their local values over a side channel — a small TCP server thread per rank, whose
address each rank posts once in Paddle's own TCP store when ``apply_plan`` runs — and
combines them (sum, mean, max or min, as the placement says). The other ranks answer from
their thread while their training thread goes on (Paddle releases the GIL in its collectives),
so a reader never waits on the others' loop.

Only the job's ranks can ask or answer: the side channel's messages and posted values are
signed under a key derived from the job's (transport.py says how); every read has one deadline
(``AUTODIST_READ_TIMEOUT``, default 300 s) and ends in a :class:`ReadError`.

The cost. Reading on no rank costs no communication at all: noting a value is a local
reference and a dictionary entry (:func:`stats` counts values noted, reads and values fetched,
and ``tests/loops/test_readable.py`` checks that two steps no rank reads fetch, serve and post
nothing on any rank). One exception, a plan whose forward runs collectives the applier issues
from Python: expert hooks (expert parallelism, or an MoE model under plain dp: applier/modes/expert_dispatch.py),
local views and local token lookups (applier/modes/local_calls.py, applier/modes/vocab_lookup.py). Those are
``dist.reshard`` calls, and Paddle holds Python's GIL while such a call waits for the
other ranks (measured: docs/paddle-notes.md, "Reading a value on some ranks"), so a rank waiting
there for the reader could not answer it from its thread (seen: every rank reading an evaluation
loss under dp2 x mp2 with a local lookup, rank 0 already in the next batch's lookup, its mp peer
still waiting for rank 0's part: both timed out in gloo). Under such a plan
each value is therefore *posted* to the store as it is made: one small store message per noted scalar (one a step
for the Mixtral-style model's loss in tests/loops/test_readable.py), signed (an HMAC of a
hundred bytes), and on a GPU the device-to-host copy of it. The post's counter (store_host.post:
a ``set``, then an ``add``) waits for the store's answer, about 44 ms on loopback whatever the
load (docs/paddle-notes.md): the docstring Llama's loss under dp2 x mp2 with a local lookup notes
two scalars a step, about 90 ms of a 290 ms step on a 2-core machine (docs/benchmarks.md,
"Calibrate's step against the training script's").
Each read of a value not read before on this rank costs one round trip to each other rank of
its group (a few hundred bytes). The one-time costs: a server thread and two store keys (its address, and a
counter saying it is there) per rank at ``apply_plan``, and at exit every rank waits for the others to exit too (one store
counter), so that a rank reading the final loss still finds its peers. The last
:data:`KEEP` noted values are kept per rank: that many one-element tensors (on a GPU, each
takes its allocator's smallest block).

Owned, and optional. What this sets up in the process (the wrapped Paddle methods:
patching.py; the server thread and its port: transport.py; the store keys and the wait at
exit: store.py) belongs to the models apply_plan returned: :func:`close` (``autodist.close``)
(``autodist.applier.apply.close``) undoes all of it once no applied model needs it (Paddle's own methods back, the server stopped,
the exit wait and excepthook removed), and so does the end of the process. ``AUTODIST_READABLE=0``
turns it off before anything is set up: nothing is patched, no thread starts, and a ``Partial``
loss is read as Paddle reads it, which needs every rank of its group to read it (for scripts
that log on every rank; the wrappers' cost: docs/benchmarks.md, "Readable losses").

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
import os
import socket
import sys
import threading
import weakref
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, NoReturn

import numpy as np
import paddle
import paddle.distributed as dist

from autodist.schemas import PlanError

from autodist.applier.ranks.agree import seconds_from
from autodist.applier.ranks.store_host import global_store

from autodist.applier.ranks.readable import patching
from autodist.applier.ranks.readable.notes import DEFAULT_TIMEOUT_S, Key, Notes, ReadError, current, set_current
from autodist.applier.ranks.readable.store import post_address, post_value, wait_for_peers
from autodist.applier.ranks.readable.transport import fetch, serve

__all__ = ["ReadError", "RemoteLoss", "close", "install", "pipeline_losses", "settings", "stats"]

TIMEOUT_ENV = "AUTODIST_READ_TIMEOUT"
#: ``0`` turns the readable losses off (see the module's docstring); ``1`` or unset: on.
SWITCH_ENV = "AUTODIST_READABLE"


@dataclass(frozen=True)
class Settings:
    """How the readable losses run, from the environment (:func:`settings`)."""

    on: bool = True
    #: Seconds a read waits for a peer (``AUTODIST_READ_TIMEOUT``).
    timeout_s: float = DEFAULT_TIMEOUT_S


def settings() -> Settings:
    """``AUTODIST_READABLE`` and ``AUTODIST_READ_TIMEOUT``; a bad value is one ``PlanError``
    naming the variable, which apply_plan raises before it touches anything.

    >>> os.environ[SWITCH_ENV] = "0"; settings().on
    False
    >>> os.environ[SWITCH_ENV] = "no"
    >>> try:
    ...     settings()
    ... except PlanError as err:
    ...     print(err.problems)
    ["AUTODIST_READABLE='no': expected 0 (off) or 1 (on)"]
    >>> del os.environ[SWITCH_ENV]
    """
    switch = os.environ.get(SWITCH_ENV) or "1"
    if switch not in ("0", "1"):
        raise PlanError(f"{SWITCH_ENV}={switch[:40]!r}: expected 0 (off) or 1 (on)", source="environment")
    return Settings(on=switch == "1", timeout_s=seconds_from(TIMEOUT_ENV, DEFAULT_TIMEOUT_S))


@dataclass
class _Open:
    """What this process set up for the models in ``models``: undone by :func:`close`."""

    notes: Notes
    stop: threading.Event
    thread: threading.Thread
    excepthook: Callable
    #: sys.exit as it was (a script's ``sys.exit(1)`` reaches no excepthook: :func:`_exiting` sees it).
    exit: Callable
    models: dict[int, Any] = field(default_factory=dict)  # id(model): its forward pre-hook's handle
    #: How many times this process opened them before: the ranks' counters at the end are per opening.
    generation: int = 0


_OPEN: _Open | None = None
_OPENED = 0  # times opened in this process
_FAILED = False


def install(model: paddle.nn.Layer, key: bytes, post: bool = False, read: Settings = Settings()) -> None:
    """Make noted scalars readable on any rank; count ``model``'s calls for their keys.
    ``key``: the job's key (the agreement's, jobkey.py), the same on every rank: the side
    channel's messages and posted values are signed under a key derived from it.
    ``post``: post every value to the store as it is made (for plans whose ranks wait in
    GIL-holding collectives: a plan with expert hooks, local views or local lookups).
    ``read``: :func:`settings` (off: nothing is set up).

    Called by ``apply_plan`` on every rank of a job of more than one rank. The first call per
    process starts the server, posts its address and patches Paddle's reads; later calls
    (another plan applied in the same process) only count the new model's calls too.
    """
    global _OPEN, _OPENED
    if dist.get_world_size() < 2 or not read.on:
        return
    if _OPEN is None:
        notes = Notes(dist.get_rank(), dist.get_world_size(), key, read.timeout_s)
        notes.store = global_store(notes.rank)  # rank 0 then serves it: warmed up for its exit
        # This rank's own address only (never all interfaces), any free port.
        host = os.environ.get("PADDLE_CURRENT_ENDPOINT", "").rpartition(":")[0] or "127.0.0.1"
        listener = socket.create_server((host, 0))
        stop = threading.Event()
        thread = threading.Thread(target=serve, args=(notes, listener, stop), daemon=True, name="autodist-readable")
        thread.start()
        post_address(notes, host, listener.getsockname()[1])
        set_current(notes)
        patching.patch()
        atexit.register(_at_exit)
        _OPEN = _Open(notes, stop, thread, excepthook=sys.excepthook, exit=sys.exit, generation=_OPENED)
        _OPENED += 1
        sys.excepthook, sys.exit = _failing, _exiting
    if post and _OPEN.notes.post is None:
        _OPEN.notes.post = partial(post_value, _OPEN.notes)
    counted = model.register_forward_pre_hook(lambda layer, args: _OPEN.notes.model_called() if _OPEN else None)
    _OPEN.models[id(model)] = counted
    weakref.finalize(model, _forget, id(model))


def close(model: paddle.nn.Layer | None = None) -> None:
    """Undo what apply_plan set up in this process for reading losses on some ranks (for
    ``model``, or for every applied model): once no applied model needs them, Paddle's own
    Tensor methods are back, the server thread has stopped, the wait at exit and the excepthook
    are gone. The models stay distributed; a loss is then read as Paddle reads it. Call it on
    every rank, as apply_plan: the last close waits (at most the read timeout) until every rank
    closes, since a peer may still be reading this rank's values until it does.

    Example::

        >>> model, opt, loader = apply_plan(model, opt, loader, "plan.json")   # doctest: +SKIP
        >>> autodist.close()                                                    # doctest: +SKIP
    """
    if _OPEN is None:
        return
    for handle in [_OPEN.models.pop(id(model), None)] if model is not None else list(_OPEN.models.values()):
        if handle is not None:
            handle.remove()
    if model is None:
        _OPEN.models.clear()
    if not _OPEN.models:
        wait_for_peers(_OPEN.notes, f"close{_OPEN.generation}")
        _shut()


def _forget(model_id: int) -> None:
    """A model apply_plan returned was collected: it needs nothing more."""
    if _OPEN is not None:
        _OPEN.models.pop(model_id, None)


def _shut() -> None:
    global _OPEN
    opened, _OPEN = _OPEN, None
    if opened is None:
        return
    patching.unpatch()
    if sys.excepthook is _failing:
        sys.excepthook = opened.excepthook
    if sys.exit is _exiting:
        sys.exit = opened.exit
    atexit.unregister(_at_exit)
    opened.stop.set()
    opened.thread.join(timeout=5.0)
    set_current(None)
    # Drop the kept tensors now, while Paddle is whole: left to the interpreter's teardown,
    # they are freed after Paddle's own state and can crash the process at exit.
    with opened.notes.changed:
        opened.notes.values.clear()


def _at_exit() -> None:
    """The end of the job: stay until every rank is exiting (store.wait_for_peers), so a rank
    reading the last loss finds its peers, unless this rank is failing (an uncaught exception,
    or ``sys.exit`` with an error: nobody will read, and a launcher stops the job once this
    rank's exit code says so); then undo everything."""
    if _OPEN is not None and not _FAILED:
        wait_for_peers(_OPEN.notes, f"exit{_OPEN.generation}")
    _shut()


def _failing(*args: Any) -> None:
    """The excepthook while open: note that this rank is failing (so it does not wait at exit),
    then the one it replaced."""
    global _FAILED
    _FAILED = True
    (_OPEN.excepthook if _OPEN is not None else sys.__excepthook__)(*args)


def _exiting(code: str | int | None = None) -> NoReturn:
    """sys.exit while open: an exit with an error (any code but None and 0) is this rank
    failing, as an uncaught exception is (:func:`_failing`); then the sys.exit it replaced.
    (``raise SystemExit(1)`` itself, or a ``sys.exit`` bound before apply_plan, is not seen: at
    exit Python keeps its code from the handlers.)"""
    global _FAILED
    if code not in (None, 0):
        _FAILED = True
    if _OPEN is not None:
        _OPEN.exit(code)
    raise SystemExit(code)  # what sys.exit does, should the one replaced have returned


def stats() -> dict[str, int]:
    """This rank's counts: values ``noted``, ``posted`` to the store (post mode only), ``reads``
    of them, values ``fetched`` from other ranks and ``served`` to them. All zero while closed."""
    notes = current()
    return dict(notes.counts) if notes else {"noted": 0, "posted": 0, "reads": 0, "fetched": 0, "served": 0}


class RemoteLoss:
    """A loss a pipeline's last stage computed, on a rank of another stage: reading it
    (``float``, ``.item()``, ``.numpy()``, ``print``, ``f"{loss:.4f}"``) fetches the value from
    that stage's rank of this rank's pipeline, once; holding it unread costs nothing."""

    def __init__(self, peer: int, key: Key):
        self._peer, self._key = peer, key
        self._value: np.ndarray | None = None

    def numpy(self) -> np.ndarray:
        if self._value is None:
            notes = current()
            if notes is None:
                raise ReadError("reading a pipeline's loss on another stage: the readable losses are closed")
            notes.counts["reads"] += 1
            self._value = fetch(notes, self._peer, self._key, "loss")
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
    notes = current()
    if notes is None:
        return losses
    if holds_last:
        with notes.changed:
            for i, loss in enumerate(losses):
                notes.keep(("pipeline", notes.pipeline_steps, i), {"read": partial(patching.value, loss), "op": "loss"})
            notes.pipeline_steps += 1
        return losses
    step = notes.pipeline_steps
    notes.pipeline_steps += 1
    return [RemoteLoss(last_rank, ("pipeline", step, i)) for i in range(count)]
