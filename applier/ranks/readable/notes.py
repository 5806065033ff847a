"""The state of the readable losses: this rank's noted values, by key, and the reads of them.

Every rank makes the same values in the same order, so a value's key is the same on every rank:
``("value", model calls so far, index since that call)``, or ``("pipeline", step, micro-batch)``
for a pipeline's losses. A rank keeps its last :data:`KEEP` values (a reference to its local
value: no copy, no communication) and serves them to readers on other ranks (transport.py, or
through Paddle's store in post mode: store.py).

    >>> notes = Notes(rank=1, world=2, key=b"k" * 32)
    >>> with notes.changed:
    ...     notes.keep(("value", 0, 0), {"read": lambda: 1.5, "op": "mean"})
    >>> notes.wait_for(("value", 0, 0))["op"], notes.counts["noted"]
    ('mean', 1)
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import paddle

#: How many noted values each rank keeps for readers (the oldest are dropped first).
KEEP = 16384
#: Seconds a reader waits for a peer's value (``AUTODIST_READ_TIMEOUT`` overrides).
DEFAULT_TIMEOUT_S = 300.0
#: The side channel's messages are signed.py's lines under this name and the job's key (the
#: agreement's, derived for this channel): only the job's ranks can ask or answer.
PROTOCOL = b"autodist readable 2"
#: A noted value's name, the same on every rank that made it: ``("value", model calls, index)``
#: or ``("pipeline", step, micro-batch)``.
Key = tuple


class ReadError(RuntimeError):
    """A noted value could not be read (a peer never made it, left, or did not answer)."""


class Notes:
    """This rank's noted values, by key; what reading them has cost (``counts``)."""

    def __init__(self, rank: int, world: int, key: bytes, timeout_s: float = DEFAULT_TIMEOUT_S):
        self.rank, self.world = rank, world
        #: The side channel's key, derived from the job's (jobkey.py, the agreement's).
        self.key = hmac.new(key, PROTOCOL, hashlib.sha256).digest()
        self.answering = 0  # signed requests being answered (bounded by transport.MAX_ANSWERING)
        #: Posts every value to the store as it is made, in post mode (store.post_value); else None.
        self.post: Callable[[Key, dict], None] | None = None
        self.calls = 0  # calls of the models apply_plan returned
        self.index = 0  # values noted since the last call
        self.pipeline_steps = 0  # pipeline steps whose losses were published (last stage)
        self.values: collections.OrderedDict[Key, dict] = collections.OrderedDict()
        self.changed = threading.Condition()
        self.counts = {"noted": 0, "posted": 0, "reads": 0, "fetched": 0, "served": 0}
        self.addresses: dict[int, tuple[str, int]] = {}
        self.store: Any = None
        self.timeout_s = timeout_s

    def model_called(self) -> None:
        with self.changed:
            self.calls += 1
            self.index = 0
            self.changed.notify_all()

    def note(self, tensor: paddle.Tensor, op: str) -> None:
        """Keep ``tensor``'s local value under the next key; the tensor remembers its key."""
        local = tensor._local_value().detach()
        with self.changed:
            key = ("value", self.calls, self.index)
            self.index += 1
            self.keep(key, {"read": local.numpy, "op": op})
        tensor._autodist_read_key = key

    def keep(self, key: Key, entry: dict) -> None:
        """Keep ``entry`` (``read``: its value, ``op``: what made it) under ``key``; in post mode
        post it to the store too. The caller holds ``changed``."""
        if self.post is not None:
            self.post(key, reply(entry))
            self.counts["posted"] += 1
        self.values[key] = entry
        while len(self.values) > KEEP:
            self.values.popitem(last=False)
        self.counts["noted"] += 1
        self.changed.notify_all()

    def made_after(self, key: Key) -> bool:
        """True when this rank has gone past ``key`` (it will never make it now)."""
        progress = (self.calls, self.index) if key[0] == "value" else (self.pipeline_steps, 0)
        return progress > tuple(key[1:])

    def wait_for(self, key: Key) -> dict:
        """The entry under ``key``, waiting until this rank makes it, at most ``timeout_s``."""
        deadline = time.monotonic() + self.timeout_s
        with self.changed:
            while key not in self.values:
                if self.made_after(key):
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


def reply(entry: dict) -> dict:
    """An entry's value as it travels: ``{"op", "dtype", "shape", "hex"}``."""
    value = np.asarray(entry["read"]())
    return {"op": entry["op"], "dtype": str(value.dtype), "shape": list(value.shape), "hex": value.tobytes().hex()}


def parse_reply(payload: bytes | None) -> dict | None:
    """A signed reply's payload: ``{"error": text}`` or a value (:func:`reply`, with the key it
    was posted under when posted); None if it is neither."""
    from autodist.applier.ranks.signed import strict_json

    if payload is None:
        return None
    try:
        answer = strict_json(payload)
    except Exception:
        return None
    if not isinstance(answer, dict):
        return None
    if isinstance(answer.get("error"), str):
        return answer
    fields = (answer.get("op"), answer.get("dtype"), answer.get("hex"))
    shape = answer.get("shape")
    if not all(isinstance(f, str) for f in fields) or not isinstance(shape, list):
        return None
    return answer if all(type(n) is int and 0 <= n for n in shape) else None


#: This process's notes while its readable losses are open (``autodist.applier.ranks.readable.install``).
_CURRENT: Notes | None = None


def current() -> Notes | None:
    return _CURRENT


def set_current(notes: Notes | None) -> None:
    global _CURRENT
    _CURRENT = notes
