"""The readable losses' side channel against a stranger, in one process: only the job's ranks can
ask or answer, every wait ends at one deadline, a flood gets no threads (applier/ranks/readable/,
applier/ranks/signed.py).

A rank's server and a reader are two ``Notes`` of this process with the job's key, talking over
loopback exactly as two ranks do; the stranger is this test, which knows the port and the
protocol but not the key. The real 2-rank job is tests/loops/test_readable_strangers.py.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import numpy as np
import pytest

from autodist.applier.ranks.readable import ReadError
from autodist.applier.ranks.readable.notes import Notes
from autodist.applier.ranks.readable.store import post_value
import autodist.applier.ranks.readable.transport as transport
from autodist.applier.ranks.readable.transport import fetch, serve

KEY, OTHER_JOB = b"k" * 32, b"o" * 32
VALUE_KEY = ("value", 1, 0)
TIMEOUT_S = 1.5


def _serving(key: bytes = KEY, timeout_s: float = TIMEOUT_S) -> tuple[Notes, tuple[str, int]]:
    """A rank's notes holding 1.5 under VALUE_KEY, its server thread on a loopback port."""
    notes = Notes(1, 2, key, timeout_s)
    notes.calls = 1
    with notes.changed:
        notes.keep(VALUE_KEY, {"read": lambda: np.array(1.5, "float32"), "op": "mean"})
    listener = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=serve, args=(notes, listener, threading.Event()), daemon=True).start()
    return notes, listener.getsockname()


def _reader(address: tuple[str, int], key: bytes = KEY, timeout_s: float = TIMEOUT_S) -> Notes:
    notes = Notes(0, 2, key, timeout_s)
    notes.addresses[1] = address
    return notes


def _ask_unsigned(address, request: bytes) -> bytes:
    """What a stranger gets for ``request``: everything the rank sends until it hangs up."""
    with socket.create_connection(address, timeout=5) as conn:
        conn.sendall(request)
        received = b""
        while chunk := conn.recv(65536):
            received += chunk
    return received


def test_a_rank_reads_and_a_stranger_cannot():
    server, address = _serving()
    assert float(fetch(_reader(address), 1, VALUE_KEY, "mean")) == 1.5
    for request in (b'{"key": ["value", 1, 0]}\n', b"0" * 64 + b' {"key": ["value", 1, 0], "nonce": "00"}\n'):
        got = _ask_unsigned(address, request)
        assert b"hex" not in got and b"1.5" not in got, got  # no challenge: hung up on
    with pytest.raises(ReadError, match="did not greet as a rank of this job"):
        fetch(_reader(address, key=OTHER_JOB), 1, VALUE_KEY, "mean")  # another job's rank
    assert server.counts["served"] == 1


def _fake_rank(behave) -> tuple[str, int]:
    """A stranger listening where a rank's address says: ``behave(conn)`` per connection."""
    listener = socket.create_server(("127.0.0.1", 0))

    def run():
        with listener:
            while True:
                conn, _ = listener.accept()
                threading.Thread(target=behave, args=(conn,), daemon=True).start()

    threading.Thread(target=run, daemon=True).start()
    return listener.getsockname()


def test_a_recorded_answer_is_not_taken():
    """A stranger relays one real read and records what the rank sent (greeting and signed
    answer); replayed to the next reader, it fails at once: the greeting answers the first reader's
    challenge, not this one's (and the answer is signed over that reader's nonce)."""
    _, address = _serving()
    recorded = bytearray()

    def relay(conn):
        with conn, socket.create_connection(address) as rank:
            rank.sendall(conn.recv(4096))  # the reader's challenge
            greeting = rank.recv(4096)
            recorded.extend(greeting)
            conn.sendall(greeting)
            rank.sendall(conn.recv(65536))
            answer = rank.recv(65536)
            recorded.extend(answer)
            conn.sendall(answer)

    assert float(fetch(_reader(_fake_rank(relay)), 1, VALUE_KEY, "mean")) == 1.5  # relaying is harmless

    def replay(conn):
        with conn:
            conn.sendall(bytes(recorded))
            conn.recv(65536)

    with pytest.raises(ReadError, match="did not greet as a rank of this job"):
        fetch(_reader(_fake_rank(replay)), 1, VALUE_KEY, "mean")
    assert b"hex" in recorded, "the relay recorded no answer: the test would prove nothing"


def test_a_stranger_cannot_make_a_reader_wait_past_its_timeout():
    """A stranger on a rank's port that says nothing, or trickles a byte every 0.3 s (each
    under a per-read timeout): the reader raises ReadError by its one deadline."""

    def silent(conn):
        time.sleep(10)
        conn.close()

    def trickle(conn):
        with conn:
            for _ in range(40):
                try:
                    conn.sendall(b"a")
                except OSError:  # the reader hung up
                    return
                time.sleep(0.3)

    for behave in (silent, trickle):
        start = time.monotonic()
        with pytest.raises(ReadError, match="did not greet"):
            fetch(_reader(_fake_rank(behave)), 1, VALUE_KEY, "mean")
        assert time.monotonic() - start < TIMEOUT_S + 1.0, behave.__name__


def test_a_flood_of_connections_gets_no_threads_and_reads_go_on():
    """200 strangers' connections, a third sending a 200 kB line with no newline, a third
    malformed lines, a third nothing: no thread per connection, and a rank still reads."""
    _, address = _serving()
    before = threading.active_count()
    conns = []
    for i in range(200):
        conn = socket.create_connection(address, timeout=5)
        conn.setblocking(False)
        try:
            conn.send([b"x" * 200_000, b'{"key": ["value", 1e999, "a"]}\n' * 3, b""][i % 3])
        except OSError:
            pass
        conns.append(conn)
    time.sleep(0.2)
    try:
        assert threading.active_count() <= before + 1, f"{threading.active_count() - before} threads more"
        start = time.monotonic()
        assert float(fetch(_reader(address), 1, VALUE_KEY, "mean")) == 1.5
        assert time.monotonic() - start < 1.0
    finally:
        for conn in conns:
            conn.close()


def test_answering_threads_are_bounded(monkeypatch):
    """Signed requests for values not made yet each wait in a thread, at most MAX_ANSWERING:
    one more gets an error at once; then the waiting ones end at the timeout."""
    monkeypatch.setattr(transport, "MAX_ANSWERING", 2)
    _, address = _serving(timeout_s=1.0)
    errors: list[str] = []

    def read_later():
        try:
            fetch(_reader(address, timeout_s=3.0), 1, ("value", 5, 0), "mean")
        except ReadError as err:
            errors.append(str(err))

    waiting = [threading.Thread(target=read_later) for _ in range(2)]
    for thread in waiting:
        thread.start()
    time.sleep(0.3)
    start = time.monotonic()
    with pytest.raises(ReadError, match="is answering 2 reads already"):
        fetch(_reader(address), 1, ("value", 5, 0), "mean")
    assert time.monotonic() - start < 0.5
    for thread in waiting:
        thread.join(timeout=5)
    assert len(errors) == 2 and all("did not make value" in e for e in errors), errors


class _Store:
    """Paddle's store as applier/ranks/readable/ uses it for posted values: set and get by key."""

    def __init__(self):
        self.data: dict[str, bytes] = {}

    def set(self, key: str, value: bytes) -> None:
        self.data[key] = value

    def get(self, key: str) -> bytes:
        return self.data[key]

    def add(self, key: str, n: int) -> int:
        self.data[key] = str(int(self.data.get(key, b"0")) + n).encode()
        return int(self.data[key])


def test_a_peer_that_posted_no_address_is_a_read_error():
    """A peer that never posted its address (died in apply_plan): the read ends at its
    deadline, not in the store's own wait (900 s, holding the GIL)."""
    reader = Notes(0, 2, KEY, TIMEOUT_S)
    reader.store = _Store()
    start = time.monotonic()
    with pytest.raises(ReadError, match="rank 1 posted no address within"):
        fetch(reader, 1, VALUE_KEY, "mean")
    assert time.monotonic() - start < TIMEOUT_S + 1.0


def test_posted_values_are_signed():
    """Under expert parallelism values go through Paddle's store, which anyone can write:
    a value a stranger wrote there is refused, the rank's own is read."""
    store = _Store()
    rank = Notes(1, 2, KEY, TIMEOUT_S)
    rank.store, rank.calls = store, 1
    rank.post = lambda key, value: post_value(rank, key, value)
    with rank.changed:
        rank.keep(VALUE_KEY, {"read": lambda: np.array(2.5, "float32"), "op": "mean"})
    reader = Notes(0, 2, KEY, TIMEOUT_S)
    reader.store, reader.post = store, lambda key, value: None  # post mode: reads what was posted
    assert float(fetch(reader, 1, VALUE_KEY, "mean")) == 2.5
    (slot,) = [key for key in store.data if not key.endswith("/posted")]  # the value, beside its counter
    forged = {"key": list(VALUE_KEY), "op": "mean", "dtype": "float32", "shape": [], "hex": "00002040"}
    store.data[slot] = json.dumps(forged).encode()
    with pytest.raises(ReadError, match="not signed with the job's key"):
        fetch(reader, 1, VALUE_KEY, "mean")


class _PaddleLikeStore(_Store):
    """A store whose get of a key nobody set waits, as Paddle's does (its 900 s)."""

    def get(self, key: str) -> bytes:
        while key not in self.data:
            time.sleep(0.05)
        return self.data[key]


def test_a_posted_value_never_posted_is_a_read_error_at_its_deadline():
    """Post mode (expert hooks, local views and lookups): before, the read waited in the store's
    own get past AUTODIST_READ_TIMEOUT (with 10 s, still blocked at 120 s)."""
    reader = Notes(0, 2, KEY, TIMEOUT_S)
    reader.store, reader.post = _PaddleLikeStore(), lambda key, value: None
    start = time.monotonic()
    with pytest.raises(ReadError, match=r"rank 1 did not make value \('value', 1, 0\) within 2 s"):
        fetch(reader, 1, VALUE_KEY, "mean")
    assert time.monotonic() - start < TIMEOUT_S + 1.0
