"""Signed one-line messages between the job's ranks, and a bounded reception for the listener.

Both channels the ranks open between themselves -- the agreement (agree.py) and the side channel
that lets a loss be read on some ranks only (readable.py) -- talk this way, so that only the
job's ranks take part (a process without the job's key, jobkey.py, can neither ask nor answer)
and a flood of connections costs a bounded amount of memory, descriptors and CPU:

- the connecting side opens with a fresh challenge (:func:`send_challenge`); the listening side
  answers it with its greeting: a fresh nonce of its own and the challenge, signed over both
  (:func:`greeting`), so a greeting recorded on one connection -- in an earlier job too, under the
  same secret -- answers no other; the connecting side sends nothing more until the greeting checks
  out (:func:`greeted`);
- every later message is one line, ``HMAC  payload``, signed under the job's key over the
  channel's protocol name, the message's kind and a context: the nonces of both ends (and a
  round), so a line recorded on one connection fails the check on any other (:func:`seal`,
  :func:`unseal`);
- the listening side keeps a connection that has not sent a signed line for at most
  :data:`PENDING_WAIT_S` and at most :data:`MAX_PENDING` of them at once, the oldest going first,
  also when descriptors run out (:class:`Reception`); every line is capped in bytes.

Example::

    >>> key, nonce = b"k" * 32, b"n" * NONCE_BYTES
    >>> line = seal(key, b"demo 1", "hello", nonce, b'{"x": 1}')
    >>> unseal(key, b"demo 1", "hello", nonce, line)
    b'{"x": 1}'
    >>> unseal(key, b"demo 1", "hello", b"m" * NONCE_BYTES, line) is None   # another connection
    True
    >>> hello = greeting(key, b"demo 1", nonce, b"c" * NONCE_BYTES)   # the answer to challenge c...
    >>> signed_greeting(Heard(nonce, b"c" * NONCE_BYTES, hello), key, b"demo 1")
    True
    >>> signed_greeting(Heard(nonce, b"d" * NONCE_BYTES, hello), key, b"demo 1")   # ...answers no other
    False
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import json
import secrets
import selectors
import socket
import time
from dataclasses import dataclass, field

NONCE_BYTES = 16
#: How long the listening side keeps a connection that has not sent a signed line (a rank sends
#: it as soon as it is greeted), and how many such connections it keeps at once: the oldest goes
#: first. So strangers' connections cost at most MAX_PENDING times a channel's line cap.
PENDING_WAIT_S = 2.0
MAX_PENDING = 16
#: When accept() fails for want of descriptors and no pending connection can be dropped, the
#: listener stops accepting for this long instead of spinning.
ACCEPT_PAUSE_S = 0.05


# -- signed lines ----------------------------------------------------------------------------------


def sign(key: bytes, protocol: bytes, kind: str, context: bytes, payload: bytes) -> bytes:
    message = b"\0".join([protocol, kind.encode(), context, payload])
    return hmac.new(key, message, hashlib.sha256).hexdigest().encode()


def seal(key: bytes, protocol: bytes, kind: str, context: bytes, payload: bytes) -> bytes:
    """One line: the signature, a space, the payload (JSON: no newline in it)."""
    return sign(key, protocol, kind, context, payload) + b" " + payload + b"\n"


def unseal(key: bytes, protocol: bytes, kind: str, context: bytes, line: bytes) -> bytes | None:
    """The payload of a line sealed by :func:`seal` with the same key, protocol, kind and
    context; else None."""
    mac, sep, payload = line.rstrip(b"\n").partition(b" ")
    return payload if sep and hmac.compare_digest(mac, sign(key, protocol, kind, context, payload)) else None


def challenge_line(protocol: bytes, challenge: bytes) -> bytes:
    """The connecting side's first line: the protocol and a fresh challenge."""
    return protocol + b" " + challenge.hex().encode() + b"\n"


def send_challenge(conn: socket.socket, protocol: bytes) -> bytes:
    """Open the conversation on a blocking ``conn``: send a fresh challenge, return it."""
    challenge = secrets.token_bytes(NONCE_BYTES)
    conn.sendall(challenge_line(protocol, challenge))
    return challenge


def greeting(key: bytes, protocol: bytes, nonce: bytes, challenge: bytes) -> bytes:
    """The listening side's answer to ``challenge``: the protocol, its fresh nonce, the challenge,
    and its signature over both."""
    signature = sign(key, protocol, "greeting", nonce + challenge, b"")
    return b" ".join([protocol, nonce.hex().encode(), challenge.hex().encode(), signature]) + b"\n"


def greeting_bytes(protocol: bytes) -> int:
    return len(protocol) + 1 + 2 * NONCE_BYTES + 1 + 2 * NONCE_BYTES + 1 + 64 + 1


@dataclass(frozen=True)
class Heard:
    """A greeting as it came (:func:`read_greeting`), not yet checked under a key."""

    nonce: bytes
    #: The challenge it answers: another connection's, unless the connecting side's own.
    challenge: bytes
    received: bytes


def greeted(conn: socket.socket, key: bytes, protocol: bytes, deadline: float) -> bytes | None:
    """The listening side's nonce, when ``conn`` answers a fresh challenge with its signed
    greeting before ``deadline``: one deadline for the whole greeting, however the bytes trickle in."""
    challenge = send_challenge(conn, protocol)
    heard = read_greeting(conn, protocol, deadline)
    answered = heard is not None and heard.challenge == challenge
    return heard.nonce if answered and heard is not None and signed_greeting(heard, key, protocol) else None


def read_greeting(conn: socket.socket, protocol: bytes, deadline: float) -> Heard | None:
    """The greeting ``conn`` starts with, when it has ``protocol``'s form and came before
    ``deadline``; not yet checked (:func:`signed_greeting` checks it under a key)."""
    size = greeting_bytes(protocol)
    received = b""
    while len(received) < size:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return None
        conn.settimeout(remaining)
        try:
            chunk = conn.recv(size - len(received))
        except TimeoutError:
            return None
        if not chunk:
            return None
        received += chunk
    head, _, _ = received.rstrip(b"\n").rpartition(b" ")
    rest, _, challenge = head.rpartition(b" ")
    name, _, nonce = rest.rpartition(b" ")
    try:
        heard = Heard(bytes.fromhex(nonce.decode("ascii")), bytes.fromhex(challenge.decode("ascii")), received)
    except ValueError:
        return None
    return heard if name == protocol and len(heard.nonce) == len(heard.challenge) == NONCE_BYTES else None


def signed_greeting(heard: Heard, key: bytes, protocol: bytes) -> bool:
    """Whether a greeting :func:`read_greeting` heard was signed under ``key`` (over the
    challenge it carries: the caller checks that it is its own)."""
    return hmac.compare_digest(heard.received, greeting(key, protocol, heard.nonce, heard.challenge))


def strict_json(payload: bytes):
    """JSON without NaN or Infinity (``"call": Infinity`` is malformed, not a number)."""
    return json.loads(payload, parse_constant=_no_constant)


def _no_constant(name: str):
    raise ValueError(f"{name} is not a number here")


# -- reading lines, bounded --------------------------------------------------------------------------


def read_line(conn: socket.socket, buffer: bytearray, max_bytes: int) -> bytes | None:
    """From a non-blocking ``conn``: the first whole line of ``buffer`` and what ``conn`` has
    (taken out of ``buffer``; the rest stays), ``b""`` when it closed (or broke, or sent more
    than ``max_bytes`` without a newline) first, else None (more to come)."""
    if b"\n" not in buffer:
        try:
            chunk = conn.recv(65536)
        except BlockingIOError:
            return None
        except OSError:
            return b""
        if not chunk or len(buffer) + len(chunk) > max_bytes:
            return b""
        buffer += chunk
    end = buffer.find(b"\n")
    if end < 0:
        return None
    line = bytes(buffer[: end + 1])
    del buffer[: end + 1]
    return line


def receive_line(conn: socket.socket, deadline: float, max_bytes: int) -> bytes | None:
    """From a blocking ``conn``: its first line by ``deadline`` (one deadline, however the bytes
    trickle in); None at the deadline; ``b""`` when it closed first; the bytes so far, with no
    newline (no valid line), when it sent more than ``max_bytes`` without one."""
    buffer = bytearray()
    while b"\n" not in buffer:
        conn.settimeout(max(0.001, deadline - time.monotonic()))
        try:
            chunk = conn.recv(65536)
        except TimeoutError:
            return None
        if not chunk:
            return b""
        if len(buffer) + len(chunk) > max_bytes:
            return bytes(buffer) or b"?"
        buffer += chunk
    return bytes(buffer[: buffer.find(b"\n") + 1])


# -- the listening side: greet, and keep few and briefly what has not signed in ---------------------


@dataclass
class Pending:
    """A connection the listener accepted that has not yet sent a signed line: first its
    challenge, answered with a greeting (then :attr:`greeted`), then its first signed line."""

    nonce: bytes
    deadline: float
    buffer: bytearray = field(default_factory=bytearray)
    greeted: bool = False


class Reception:
    """The connections of a non-blocking ``listener`` that have not yet sent their first signed
    line (greeted once they sent their challenge): at most :data:`MAX_PENDING`, each for at most :data:`PENDING_WAIT_S` and
    ``max_bytes``. The caller's loop selects on ``selector`` and hands each ready socket to
    :meth:`ready`."""

    def __init__(self, listener: socket.socket, selector, key: bytes, protocol: bytes, max_bytes: int):
        self.listener, self.selector, self.key, self.protocol = listener, selector, key, protocol
        self.max_bytes = max_bytes
        self.pending: dict[socket.socket, Pending] = {}  # oldest first
        self.paused_until = 0.0
        selector.register(listener, selectors.EVENT_READ)

    def wake(self, deadline: float) -> float:
        """When the caller's select must return at the latest (``deadline``, or earlier for a
        pending connection's deadline or the end of a pause); first drops the expired ones and
        ends a pause that is over."""
        now = time.monotonic()
        if self.paused_until and now >= self.paused_until:
            self.selector.register(self.listener, selectors.EVENT_READ)
            self.paused_until = 0.0
        for conn in [c for c, p in self.pending.items() if p.deadline <= now]:  # too slow: not a rank
            self.drop(conn)
        pause = [self.paused_until] if self.paused_until else []
        return min([deadline, *(p.deadline for p in self.pending.values()), *pause])

    def ready(self, conn) -> tuple[socket.socket, Pending, bytes] | None:
        """For a socket the selector found ready: ``(connection, its Pending, its first line)``
        when a greeted connection sent one (taken out of the reception: the caller owns it,
        registered with the selector no more; ``b""``: it closed or sent too much); None otherwise
        (the listener: a connection accepted; a challenge answered with the greeting, or hung up
        on; or no whole line yet)."""
        if conn is self.listener:
            if not self._accept():
                self.selector.unregister(self.listener)  # out of descriptors, none of ours to free: wait
                self.paused_until = time.monotonic() + ACCEPT_PAUSE_S
            return None
        if conn not in self.pending:  # dropped earlier in this batch
            return None
        pending = self.pending[conn]
        line = read_line(conn, pending.buffer, self.max_bytes if pending.greeted else greeting_bytes(self.protocol))
        if line is None:
            return None
        if not pending.greeted:
            self._greet(conn, pending, line)
            return None
        self.selector.unregister(conn)
        return conn, self.pending.pop(conn), line

    def drop(self, conn: socket.socket) -> None:
        self.selector.unregister(conn)
        del self.pending[conn]
        conn.close()

    def close(self) -> None:
        """Stop listening through the selector and hang up on every pending connection."""
        if self.listener in self.selector.get_map():
            self.selector.unregister(self.listener)
        self.paused_until = 0.0
        for conn in list(self.pending):
            self.drop(conn)

    def _accept(self) -> bool:
        """Accept one connection (greeted once it sends its challenge). False when descriptors ran out and no pending
        connection was left to drop for one."""
        try:
            conn, _ = self.listener.accept()
        except OSError as err:
            if err.errno not in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                return True  # that connection is gone (reset before accepted), or none was waiting
            if not self.pending:
                return False
            self.drop(next(iter(self.pending)))  # the oldest: frees a descriptor
            return True
        if len(self.pending) >= MAX_PENDING:
            self.drop(next(iter(self.pending)))
        try:
            conn.setblocking(False)
        except OSError:
            conn.close()
            return True
        self.selector.register(conn, selectors.EVENT_READ)
        self.pending[conn] = Pending(secrets.token_bytes(NONCE_BYTES), time.monotonic() + PENDING_WAIT_S)
        return True

    def _greet(self, conn: socket.socket, pending: Pending, line: bytes) -> None:
        """Answer the challenge ``line`` with the greeting; hang up on anything else."""
        name, _, challenge_hex = line.rstrip(b"\n").rpartition(b" ")
        try:
            challenge = bytes.fromhex(challenge_hex.decode("ascii"))
        except ValueError:
            challenge = b""
        hello = greeting(self.key, self.protocol, pending.nonce, challenge)
        try:
            ok = name == self.protocol and len(challenge) == NONCE_BYTES and conn.send(hello) == len(hello)
        except OSError:  # a few bytes into an empty socket buffer: only a broken connection fails
            ok = False
        if not ok:
            self.drop(conn)
            return
        pending.greeted = True
