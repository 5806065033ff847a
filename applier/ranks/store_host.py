"""Rank 0 hosts Paddle's TCP store: let it exit while its peers hang up.

The crash (Paddle 3.3.1). Paddle's global store (``core.create_or_get_global_tcp_store()``,
which ``init_parallel_env`` creates) is served from a libuv thread in rank 0's process, and that
thread lives until the process ends. When a peer's connection to it closes, the thread logs
``VLOG(5)`` lines ("Remote peer closed the connection.", or a read error), and glog sets up a
``VLOG`` call site the first time it runs, under a lock that is a static C++ object. A peer
closes its connection only when its process exits, so those lines first run at the job's end.
If rank 0 is by then in its C++ static destructors, the lock is gone and glog aborts: rank 0
dies of SIGABRT after its work is done, printing nothing (a core shows
``LibUVClient::readCallback -> google::InitVLOG3__ -> abort``). In our test suite about one
short job in twenty under load; docs/paddle-notes.md, "Rank 0 aborts at exit".

The way round it. Rank 0 opens two connections to its own store and closes them at once: one
cleanly (the thread reads the end of the stream) and one with a reset (it reads an error), the
two ways a peer's exit reaches it. Both call sites are then set up while the process is whole;
at the job's end the peers' hang-ups log nothing (below glog's level) and take no lock.

When. The store exists from ``dist.init_parallel_env()`` (which the README asks for) or else
from the job's first collective, which Paddle's auto-parallel API makes lazily; so apply_plan
warms up at its start (a store the script made: also a plan refused there is covered) and
again where it makes the store itself (:func:`global_store`, before its first collective).

    >>> warm_up_store_host(rank=1)   # nothing to do anywhere but on the store's host, rank 0
    False

Every exchange with the store waited 40 ms (Paddle 3.3.1 on Linux). Its client writes a request
in several small pieces on a socket without ``TCP_NODELAY``: Nagle's algorithm holds each piece
after the first until the store host acknowledges it, which the host's delayed ACK does after 40 ms.
A ``store.add`` took 45 ms and a ``store.get`` 93 ms on 2 gloo ranks on loopback, on rank 0 as
on rank 1; with ``TCP_NODELAY`` set on the client's socket, 0.3 ms and 0.2 ms. A plan whose
losses are posted (readable/) posts each noted value: 44 ms a value, about 90 ms of a 290 ms
step at dp2 x mp2 (docs/benchmarks.md). :func:`post` and :func:`wait_posted` set it for their
exchanges (:func:`no_delay`) and take it off after: left on, Paddle's own process groups, made
through the same store, failed (their rendezvous needs the delays).

What else goes through the store is here too: where the job's master is (:func:`master_address`),
and a value one rank posts and another waits for until a deadline (:func:`post`, :func:`wait_posted`;
Paddle's ``store.get`` of a key nobody set waits the store's own timeout, 900 s, holding Python's
lock, so nothing calls it before a counter, ``store.add(key, 0)``, which returns at once, says the
key is set).
"""

from __future__ import annotations

import os
import socket
import struct
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

#: ``SO_LINGER`` on, zero seconds: ``close`` sends a reset instead of the end of the stream.
_RESET_ON_CLOSE = struct.pack("ii", 1, 0)


def master_address() -> str:
    """The job's master endpoint ``host:port``: ``PADDLE_MASTER`` (set by Paddle's launcher) or
    else the first of ``PADDLE_TRAINER_ENDPOINTS``, as Paddle's own store finds its master."""
    return os.environ.get("PADDLE_MASTER") or os.environ.get("PADDLE_TRAINER_ENDPOINTS", "").split(",")[0]


#: Whether this process's store thread has had its hang-up lines run (once is enough).
_warmed = False


def warm_up_store_host(rank: int, timeout_s: float = 5.0) -> bool:
    """On rank 0, hang up on Paddle's store twice (cleanly, then with a reset) so that its
    thread's hang-up log lines are set up now, not at exit. Returns whether it connected (now
    or earlier in this process); a store it cannot reach (not made yet, another rank's machine,
    a port it cannot parse) is left alone: the job runs as before, without the guard."""
    global _warmed
    host, _, port = master_address().rpartition(":")
    if rank != 0 or not host or not port.isdigit():
        return False
    if _warmed:
        return True
    try:
        # The store listens on every interface of rank 0's machine: loopback reaches it.
        socket.create_connection(("127.0.0.1", int(port)), timeout=timeout_s).close()
        with socket.create_connection(("127.0.0.1", int(port)), timeout=timeout_s) as conn:
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET_ON_CLOSE)
    except OSError:
        return False
    _warmed = True
    return True


def global_store(rank: int) -> Any:
    """Paddle's global TCP store (made here if the script has not: every rank must call this,
    as rank 0's waits for the others to connect), warmed up on rank 0. A rank > 0 first waits
    until rank 0 listens (:func:`wait_for_store_host`), so Paddle's client does not back off."""
    import paddle  # here: the agreement imports this module, and needs Paddle only across machines

    if rank != 0:
        wait_for_store_host()
    store = paddle.base.core.create_or_get_global_tcp_store()
    warm_up_store_host(rank)
    return store


#: How long a rank > 0 waits for rank 0's store to listen before it leaves the connecting to
#: Paddle, which then retries on its own (every 3 s, until the store's timeout).
STORE_HOST_WAIT_S = 10.0


def wait_for_store_host(timeout_s: float = STORE_HOST_WAIT_S, poll_s: float = 0.02) -> bool:
    """Wait until something listens at the job's master endpoint (:func:`master_address`), for
    at most ``timeout_s``; whether it did. Paddle's client tries to connect once and, refused,
    sleeps 3 s before it tries again (3.3.1, ``tcp_utils.cc``: "Retry to connect ... while the
    server is not yet listening"). Where the store is made by apply_plan, the agreement has
    just released every rank at once, so a rank > 0 nearly always came first: 3 s lost per job.
    A connection opened here is closed at once, as :func:`warm_up_store_host`'s are: the
    store's thread on rank 0 logs a hang-up while its process is whole.

    >>> wait_for_store_host(timeout_s=0.1)   # no job here: nothing to wait for
    False
    """
    host, _, port = master_address().rpartition(":")
    if not host or not port.isdigit():
        return False
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
            return True
        except ConnectionRefusedError:  # nothing listens there yet
            if time.monotonic() > deadline:
                return False
            time.sleep(poll_s)
        except OSError:  # a host it cannot reach or name: Paddle's own client then says so
            return False


#: This process's file descriptors connected to the store's port, once found (:func:`_store_sockets`).
_store_fds: list[int] | None = None


@contextmanager
def no_delay() -> Iterator[int]:
    """``TCP_NODELAY`` on this process's connections to the store while the block runs (module
    docstring), then as before: Paddle's own process groups exchange their addresses through the
    store, and made back to back without the delays they read one another's (docs/paddle-notes.md,
    "gloo: process groups made back to back fail"). Yields how many connections it set.

    >>> with no_delay() as count:   # no store in this process
    ...     count
    0
    """
    sockets = _store_sockets()
    try:
        for sock in sockets:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        yield len(sockets)
    finally:
        for sock in sockets:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 0)
            sock.close()


def _store_sockets() -> list[socket.socket]:
    """Duplicates of this process's TCP connections to the store's port (closing one leaves
    Paddle's open), found among the process's open files (``/proc/self/fd``, Linux; elsewhere
    none) the first time and checked again each time."""
    global _store_fds
    _, _, port = master_address().rpartition(":")
    if not port.isdigit() or not os.path.isdir("/proc/self/fd"):
        return []
    if _store_fds is None:
        _store_fds = [fd for fd in map(int, os.listdir("/proc/self/fd")) if _connected(fd, int(port)) is not None]
    found = [_connected(fd, int(port)) for fd in _store_fds]
    return [sock for sock in found if sock is not None]


def _connected(fd: int, port: int) -> socket.socket | None:
    """A duplicate of ``fd`` if it is a TCP connection to ``port``, else None."""
    try:
        sock = socket.socket(fileno=os.dup(fd))
    except OSError:  # not a socket (or gone)
        return None
    try:
        if sock.type == socket.SOCK_STREAM and sock.getpeername()[1] == port:
            return sock
    except (OSError, IndexError, TypeError):  # not connected, or not TCP
        pass
    sock.close()
    return None


def post(store: Any, name: str, value: bytes) -> None:
    """Set ``name`` to ``value`` in ``store``, then count it (:func:`wait_posted` waits on that)."""
    with no_delay():
        store.set(name, value)
        store.add(f"{name}/posted", 1)


def wait_posted(store: Any, name: str, deadline: float, poll_s: float = 0.01) -> bytes | None:
    """The value posted under ``name`` (:func:`post`), waiting for it until ``deadline``; None
    when none came by then."""
    with no_delay():
        while store.add(f"{name}/posted", 0) < 1:  # before then, the store's get would wait 900 s
            if time.monotonic() > deadline:
                return None
            time.sleep(poll_s)
        return bytes(store.get(name))
