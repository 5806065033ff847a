"""The side channel a reader asks a peer's value over: a small TCP server thread per rank, and
the reader's request.

Only the job's ranks can ask or answer. The channel talks as the agreement does (signed.py):
each server listens on its rank's own address only (``PADDLE_CURRENT_ENDPOINT``'s host, never
all interfaces) and answers every connection's fresh challenge with a greeting signed over it and
a fresh nonce of its own; a request and its answer are lines signed with an HMAC under a key
derived from the job's (the agreement's, jobkey.py) over both ends' nonces, so a process without
the key can neither read a value nor pass for a rank, and a recorded greeting or answer fails on
any other read. A connection that sends no signed request gets no thread, is dropped after 2 s
or 64 KiB, and at most 16 are kept (the oldest go first); signed requests are answered by at
most :data:`MAX_ANSWERING` threads at once. A read has one deadline (``AUTODIST_READ_TIMEOUT``),
whatever the peer sends.
"""

from __future__ import annotations

import json
import secrets
import selectors
import socket
import threading
import time

import numpy as np

from autodist.applier.ranks.signed import (
    NONCE_BYTES,
    Pending,
    Reception,
    greeted,
    receive_line,
    seal,
    strict_json,
    unseal,
)

from autodist.applier.ranks.readable.notes import PROTOCOL, Key, Notes, ReadError, parse_reply, reply
from autodist.applier.ranks.readable.store import address, posted

#: The longest request or answer accepted (an answer is one scalar: a few hundred bytes).
MAX_MESSAGE_BYTES = 1 << 16
#: At most this many signed requests are answered at once, each by a thread that waits for its
#: value; one more gets an error at once. Unsigned connections get no thread (signed.Reception).
MAX_ANSWERING = 64


def fetch(notes: Notes, peer: int, key: Key, op: str) -> np.ndarray:
    """``peer``'s value under ``key``: from its post in the store (post mode) or asked over the
    side channel; raises :class:`ReadError` naming what went wrong."""
    answer = posted(notes, peer, key) if notes.post is not None else ask(notes, peer, key)
    if "error" in answer:
        raise ReadError(f"reading a loss on rank {notes.rank}: {answer['error']}")
    if answer["op"] != op:
        raise ReadError(
            f"reading a loss on rank {notes.rank}: rank {peer}'s value {key} came from {answer['op']}, "
            f"this rank's from {op}: the ranks made different values (a branch only some ranks ran?)"
        )
    try:
        value = np.frombuffer(bytes.fromhex(answer["hex"]), dtype=answer["dtype"]).reshape(answer["shape"])
    except (ValueError, TypeError) as err:
        raise ReadError(f"reading a loss on rank {notes.rank}: rank {peer}'s value {key} is malformed: {err}") from None
    notes.counts["fetched"] += 1
    return value


# -- the reader's side ---------------------------------------------------------------------------


def ask(notes: Notes, peer: int, key: Key) -> dict:
    """The value ``peer``'s server thread answers for ``key``: one deadline for the whole
    exchange; the answer must be signed over both ends' nonces (no replay, no stranger)."""
    deadline = time.monotonic() + notes.timeout_s
    where = address(notes, peer, deadline)
    if isinstance(where, str):
        raise ReadError(f"reading a loss on rank {notes.rank}: {where}")
    host, port = where
    who = f"rank {peer} ({host}:{port})"
    try:
        with socket.create_connection((host, port), timeout=notes.timeout_s) as conn:
            theirs = greeted(conn, notes.key, PROTOCOL, deadline)
            if theirs is None:
                raise ReadError(
                    f"reading a loss on rank {notes.rank}: {who} did not greet as a rank of this job within "
                    f"{notes.timeout_s:g} s (another program on its port, or stuck?)"
                )
            mine = secrets.token_bytes(NONCE_BYTES)
            request = json.dumps({"key": list(key), "nonce": mine.hex()}).encode()
            conn.settimeout(max(0.001, deadline - time.monotonic()))
            conn.sendall(seal(notes.key, PROTOCOL, "request", theirs, request))
            line = receive_line(conn, deadline, MAX_MESSAGE_BYTES)
    except OSError as err:
        raise ReadError(f"reading a loss on rank {notes.rank}: {who} did not answer ({err})") from err
    if line is None:
        raise ReadError(f"reading a loss on rank {notes.rank}: {who} did not answer within {notes.timeout_s:g} s")
    answer = parse_reply(unseal(notes.key, PROTOCOL, "answer", theirs + mine, line)) if line else None
    if answer is None:
        raise ReadError(
            f"reading a loss on rank {notes.rank}: {who} "
            + ("closed the connection" if not line else "sent something other than its signed answer")
        )
    return answer


# -- the server thread ------------------------------------------------------------------------------


def serve(notes: Notes, listener: socket.socket, stop: threading.Event) -> None:
    """The server thread, until ``stop`` is set: greet every connection that sends a challenge
    (signed.Reception: unsigned ones are few, brief and get no thread), answer each request signed
    with the job's key from a thread of its own, at most :data:`MAX_ANSWERING` at once; drop
    anything else."""
    listener.setblocking(False)
    with selectors.DefaultSelector() as selector:
        reception = Reception(listener, selector, notes.key, PROTOCOL, MAX_MESSAGE_BYTES)
        while not stop.is_set():
            wake = min(reception.wake(time.monotonic() + 60.0), time.monotonic() + 0.5)
            for ready, _ in selector.select(timeout=max(0.0, wake - time.monotonic())):
                arrived = reception.ready(ready.fileobj)
                if arrived is not None:
                    _take(notes, *arrived)
        for conn in list(reception.pending):
            reception.drop(conn)
    listener.close()


def _take(notes: Notes, conn: socket.socket, greeting: Pending, line: bytes) -> None:
    """A greeted connection's first line: a signed request gets an answering thread; anything
    else (closed, unsigned, malformed) is hung up on."""
    request = _request(unseal(notes.key, PROTOCOL, "request", greeting.nonce, line) if line else None)
    if request is None:
        conn.close()
        return
    key, their_nonce = request
    context = greeting.nonce + their_nonce
    with notes.changed:
        busy = notes.answering >= MAX_ANSWERING
        if not busy:
            notes.answering += 1
    if not busy:
        try:
            threading.Thread(target=_answer, args=(notes, conn, context, key), daemon=True).start()
            return
        except RuntimeError:  # "can't start new thread": out of resources, as busy
            with notes.changed:
                notes.answering -= 1
    # answered from here: a few bytes into an empty socket buffer
    _send(notes, conn, context, {"error": f"rank {notes.rank} is answering {MAX_ANSWERING} reads already"})


def _answer(notes: Notes, conn: socket.socket, context: bytes, key: Key) -> None:
    try:
        try:
            value = reply(notes.wait_for(key))
        except Exception as err:  # the reader raises it; this thread ends
            value = {"error": str(err)}
        _send(notes, conn, context, value)
    finally:
        with notes.changed:
            notes.answering -= 1


def _send(notes: Notes, conn: socket.socket, context: bytes, value: dict) -> None:
    with conn:
        try:
            conn.setblocking(True)
            conn.settimeout(notes.timeout_s)
            conn.sendall(seal(notes.key, PROTOCOL, "answer", context, json.dumps(value).encode()))
        except OSError:  # the reader gave up: nothing to tell
            pass


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
