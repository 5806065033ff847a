"""What the readable losses keep in Paddle's TCP store: each rank's side-channel address, the
values a post-mode plan posts as it makes them, and the counters of ranks leaving at the end.

Every value here is signed under the job's key over its store key, so one a stranger writes into
the store is refused; each is read only once posted (store_host.py's :func:`wait_posted`: Paddle's
``store.get`` of a key nobody set waits 900 s), so every wait ends at its own deadline.
"""

from __future__ import annotations

import json
import time

from autodist.applier.ranks.signed import seal, unseal
from autodist.applier.ranks.store_host import post, wait_posted

from autodist.applier.ranks.readable.notes import PROTOCOL, Key, Notes, parse_reply

PREFIX = "autodist/readable/"


def post_address(notes: Notes, host: str, port: int) -> None:
    """Say where this rank's side channel listens, signed over its store key (:func:`address`
    refuses one a stranger wrote there)."""
    where = f"{PREFIX}{notes.rank}"
    post(notes.store, where, seal(notes.key, PROTOCOL, "address", where.encode(), f"{host}:{port}".encode()))


def address(notes: Notes, peer: int, deadline: float) -> tuple[str, int] | str:
    """Where ``peer``'s side channel listens, as it posted, waiting for the post until
    ``deadline``; or why not (a string)."""
    if peer not in notes.addresses:
        where = f"{PREFIX}{peer}"
        sealed = wait_posted(notes.store, where, deadline)
        if sealed is None:
            return f"rank {peer} posted no address within {notes.timeout_s:g} s (it never finished apply_plan, or died)"
        text = unseal(notes.key, PROTOCOL, "address", where.encode(), sealed[:400])
        if text is None:
            return f"rank {peer}'s posted address is not signed with the job's key (another process?)"
        host, _, port = text.decode("ascii", "replace").rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            return f"rank {peer}'s posted address is not host:port"
        notes.addresses[peer] = (host, int(port))
    return notes.addresses[peer]


def slot(rank: int, key: Key) -> str:
    """The store key a posted value lives under: one of a bounded set per rank (the first
    number wraps), the full key kept in the value.

    >>> slot(1, ("value", 1030, 2))
    'autodist/readable/1/value/6/2'
    """
    kind, first, *rest = key
    return f"{PREFIX}{rank}/{kind}/{first % 1024}/" + "/".join(map(str, rest))


def post_value(notes: Notes, key: Key, value: dict) -> None:
    """Post this rank's ``value`` (notes.reply) under ``key``, signed over its slot: one a
    stranger writes into the store is refused (:func:`posted`)."""
    where = slot(notes.rank, key)
    body = json.dumps({"key": list(key), **value}).encode()
    post(notes.store, where, seal(notes.key, PROTOCOL, "posted", where.encode(), body))


def posted(notes: Notes, peer: int, key: Key) -> dict:
    """The value ``peer`` posted under ``key`` (notes.reply), waiting for it to be posted until
    the read's deadline; or ``{"error": why}``."""
    deadline = time.monotonic() + notes.timeout_s
    where = slot(peer, key)
    late = {"error": f"rank {peer} did not make value {key} within {notes.timeout_s:.0f} s"}
    sealed = wait_posted(notes.store, where, deadline, poll_s=0.005)
    if sealed is None:
        return late
    while True:
        reply = parse_reply(unseal(notes.key, PROTOCOL, "posted", where.encode(), sealed))
        if reply is None or not isinstance(reply.get("key"), list):
            return {"error": f"rank {peer}'s posted value {key} is not signed with the job's key (another process?)"}
        made = tuple(reply.pop("key"))
        if made == tuple(key):
            return reply
        if made > tuple(key):
            return {"error": f"rank {peer} no longer keeps value {key} (overwritten by {made})"}
        if time.monotonic() > deadline:
            return late
        time.sleep(0.005)
        sealed = bytes(notes.store.get(where))


def arrive(notes: Notes, name: str, deadline: float, wait: bool) -> None:
    """Count this rank in the store counter ``name``; with ``wait``, stay until every rank has
    been counted or the deadline passes."""
    key = f"{PREFIX}{name}"
    notes.store.add(key, 1)
    while wait and notes.store.add(key, 0) < notes.world and time.monotonic() < deadline:
        time.sleep(0.02)


def wait_for_peers(notes: Notes, name: str) -> None:
    """Stay until every rank is leaving (counted under ``name``, the same on every rank), so
    that a rank reading the last loss finds its peers, no longer than the read timeout (a peer
    that died never counts itself)."""
    deadline = time.monotonic() + notes.timeout_s
    try:
        arrive(notes, name, deadline, wait=True)
        # Paddle's store is served from rank 0's process: rank 0 leaves last, once no peer will ask
        # the store anything more. A peer's poll served while rank 0's process was finalising
        # crashed rank 0 (SIGSEGV at the end of a job, seen in full-suite runs).
        arrive(notes, f"{name}/left", deadline, wait=notes.rank == 0)
    except Exception:  # rank 0, the store's host, has gone: nobody is left to read from us
        pass
