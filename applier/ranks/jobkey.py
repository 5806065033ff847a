"""The job's secret: the key that lets a rank tell the job's other ranks from any other process.

The agreement between ranks (agree.py) signs every message with an HMAC under this key, so a
process that does not hold it can neither take part nor pass for rank 0. Paddle's launcher
gives the ranks nothing secret (its environment is the job's layout: ranks, endpoints, master
address, all guessable), so the key comes from one of:

- ``AUTODIST_AGREE_SECRET_FILE``, when set: a file of this user's, mode 0600, holding the same
  random text on every node (at least :data:`MIN_SECRET_BITS` bits of it; export the variable on
  every node before ``paddle.distributed.launch``, which passes its environment on to each rank
  -- and writes it into ./log, readable by every local user: the file's path is harmless there,
  a secret is not). ``AUTODIST_AGREE_SECRET`` (the text itself) still works, with a warning
  saying so;
- else, when every rank runs on one machine (all of ``PADDLE_TRAINER_ENDPOINTS`` on one host):
  a random key rank 0 writes, for each agreement, into a folder only this user can open
  (``$TMPDIR/autodist-<uid>``, mode 0700; ``~/.cache/autodist/keys`` when another user holds
  that name), named after the job's master endpoint, with the port
  the agreement listens on (one the system picked free); the other ranks read both there.
  Other users' processes cannot; this user's own processes can, as they can read the ranks'
  memory anyway.

A job across machines without a secret is refused with a ``PlanError`` naming
the variable: there is no secret to share, and an agreement anyone can join would protect
nothing.

Rank 0 writes the key file also when it has a secret, with a random key of its own that says so
(``<hex> <port> secret``): that key lets no one join (the agreement is signed with the secret's key),
but a rank on the same machine whose secret differs (set on one rank, unset or another on the
other) can tell rank 0 so, signed, at the first greeting, instead of both waiting out the
timeout (:func:`mismatch`, agree.py).

Example::

    >>> import os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "secret")   # mkdtemp: a folder only this user opens
    >>> with open(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
    ...     _ = f.write("0123456789abcdef" * 4)               # secrets.token_hex(32) makes one
    >>> os.environ["AUTODIST_AGREE_SECRET_FILE"] = path
    >>> len(read_key("127.0.0.1:6170"))
    32
    >>> one_host()   # nothing says where the ranks run (no PADDLE_TRAINER_ENDPOINTS)
    False
    >>> del os.environ["AUTODIST_AGREE_SECRET_FILE"]  # the example's secret is not the process's
"""

from __future__ import annotations

import hashlib
import hmac
import math
import os
import re
import secrets
import stat
import tempfile
import warnings
from pathlib import Path
from typing import NamedTuple

from autodist.schemas import PlanError

SECRET_ENV = "AUTODIST_AGREE_SECRET"
#: A file holding the secret: what the README asks for (the launcher logs its environment, not files).
SECRET_FILE_ENV = "AUTODIST_AGREE_SECRET_FILE"
#: The least entropy a secret may have, as :func:`secret_bits` estimates it.
MIN_SECRET_BITS = 96
_SECRET_FILE_MAX_BYTES = 4096
#: A key file is 64 hex digits, the port (and " secret" when rank 0 has one); anything larger is not one of ours.
_KEY_FILE_MAX_BYTES = 256


class KeyFile(NamedTuple):
    """What rank 0 wrote for one agreement on this machine."""

    key: bytes
    #: Whether rank 0 has ``AUTODIST_AGREE_SECRET`` (then ``key`` only tells another secret).
    secret: bool
    #: The port rank 0's agreement listens on.
    port: int


def read_key(master: str) -> bytes | None:
    """The job's key as a rank > 0 finds it: from ``AUTODIST_AGREE_SECRET``, else rank 0's key
    file for the job at ``master`` (None while rank 0 has not written it yet)."""
    secret = _secret()
    if secret:
        return _from_secret(secret)
    _require_one_host()
    try:
        found = _read_key_file(key_file(master))
    except OSError:  # not written yet (or not a plain file): rank 0 writes it before it listens
        return None
    return found.key if found else None


def has_secret() -> bool:
    """Whether this rank is given a secret (``AUTODIST_AGREE_SECRET_FILE`` or ``AUTODIST_AGREE_SECRET``)."""
    return bool(os.environ.get(SECRET_FILE_ENV) or os.environ.get(SECRET_ENV))


def _secret() -> str | None:
    """The job's secret: the text of ``AUTODIST_AGREE_SECRET_FILE`` (a regular file of this user's,
    mode 0600 or stricter), else ``AUTODIST_AGREE_SECRET`` with a warning (Paddle's launcher
    writes its whole environment into ./log, readable by all); None when neither is set. A file
    not this user's alone, both set, or a weak secret (:func:`secret_bits` below
    :data:`MIN_SECRET_BITS`) is one ``PlanError``."""
    path, text = os.environ.get(SECRET_FILE_ENV), os.environ.get(SECRET_ENV)
    if path and text:
        raise PlanError(f"both {SECRET_FILE_ENV} and {SECRET_ENV} are set: unset {SECRET_ENV}", source="environment")
    if path:
        text, where = _read_secret_file(path), f"{SECRET_FILE_ENV}={path}"
    elif text:
        where = SECRET_ENV
        warnings.warn(
            f"autodist: {SECRET_ENV} is in the environment, which python -m paddle.distributed.launch writes into "
            f"./log (backup_env.*.json, envlog.*, mode 0644) where any local user can read it: put the secret in a "
            f"file only you can read and set {SECRET_FILE_ENV} to it instead (README, Security)",
            stacklevel=3,
        )
    else:
        return None
    bits = secret_bits(text)
    if bits < MIN_SECRET_BITS:
        raise PlanError(
            f"{where}: the secret is weak (about {bits:.0f} bits, at least {MIN_SECRET_BITS} needed); make one with "
            f"`python -c 'import secrets; print(secrets.token_hex(32))'`",
            source="environment",
        )
    return text


def _read_secret_file(path: str) -> str:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as err:
        raise PlanError(f"{SECRET_FILE_ENV}={path}: {err.strerror}", source="environment") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
            raise PlanError(
                f"{SECRET_FILE_ENV}={path}: not a file only this user can read (owner uid {info.st_uid}, mode "
                f"{stat.S_IMODE(info.st_mode):o}); `chmod 600 {path}` as its owner",
                source="environment",
            )
        data = os.read(fd, _SECRET_FILE_MAX_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > _SECRET_FILE_MAX_BYTES:
        raise PlanError(f"{SECRET_FILE_ENV}={path}: larger than {_SECRET_FILE_MAX_BYTES} bytes", source="environment")
    return data.decode("utf-8", "replace").strip()


def secret_bits(secret: str) -> float:
    """A generous estimate of the secret's entropy in bits: its length times the lesser of the
    bits per character of its alphabet (hex digits, or the character classes it uses) and of its
    characters' own frequencies (so repeats count little).

    >>> round(secret_bits("0123456789abcdef" * 4))
    256
    >>> round(secret_bits("s3cret"))
    16
    >>> secret_bits("a" * 40)
    0.0
    """
    if not secret:
        return 0.0
    if all(c in "0123456789abcdefABCDEF" for c in secret):
        alphabet = 16
    else:
        classes = [str.islower, str.isupper, str.isdigit]
        alphabet = sum(n for test, n in zip(classes, (26, 26, 10)) if any(test(c) for c in secret))
        alphabet += 33 if any(not (c.islower() or c.isupper() or c.isdigit()) for c in secret) else 0
    counts = [secret.count(c) for c in set(secret)]
    frequency = max(0.0, -sum(n / len(secret) * math.log2(n / len(secret)) for n in counts))
    return len(secret) * min(math.log2(alphabet), frequency)


def new_key(master: str, port: int) -> tuple[bytes, Path | None, bytes | None]:
    """The job's key as rank 0 makes it, its agreement listening on ``port``: from
    ``AUTODIST_AGREE_SECRET``, else a fresh random key. Returns ``(key, the key file to remove
    when done, the file's key)``: the file holds the key itself when there is no secret; with
    one, a random key that only tells another secret (the file is then written where it can be,
    or not at all: ``(key, None, None)``). Either way the file holds ``port``."""
    secret = _secret()
    if secret:
        try:
            path, file_key = _write_key_file(master, port, secret=True)
        except PlanError:  # no private folder here: ranks with another secret wait for the timeout
            return _from_secret(secret), None, None
        return _from_secret(secret), path, file_key
    _require_one_host()
    path, key = _write_key_file(master, port, secret=False)
    return key, path, key


def _write_key_file(master: str, port: int, secret: bool) -> tuple[Path, bytes]:
    path = key_file(master)
    key = secrets.token_bytes(32)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.write(fd, f"{key.hex()} {port}".encode() + (b" secret" if secret else b""))
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as err:
        raise PlanError(
            f"agreement: cannot write the job's key to {path}: {err.strerror or err}; set {SECRET_FILE_ENV}",
            source="environment",
        ) from None
    return path, key


def rank0_key_file(master: str) -> KeyFile | None:
    """What rank 0 wrote for the job at ``master`` on this machine; None when there is no such
    file here (rank 0 on another machine, or not there yet)."""
    try:
        return _read_key_file(key_file(master))
    except (OSError, PlanError):
        return None


def mismatch(peer: str, mine: bool, theirs: bool | None) -> str:
    """Why ``peer`` (``"rank 0"``, ``"rank 3"``) signs with another key than this rank, in one
    line naming the variable; ``mine``, ``theirs``: whether this rank and the peer have
    ``AUTODIST_AGREE_SECRET`` (``theirs`` None: not known, only that its messages do not check
    out under this rank's key).

    >>> print(mismatch("rank 1", True, False))  # doctest: +NORMALIZE_WHITESPACE
    rank 1's messages are not signed with this rank's key: AUTODIST_AGREE_SECRET is set on this rank
    and unset on rank 1; set it to the same text on every node
    """
    if theirs is None:
        why = f"is {SECRET_ENV} set alike on every node (set on one, unset or another on the other?)"
    elif mine and theirs:
        why = f"its {SECRET_ENV} differs from this rank's"
    else:
        where = ("this rank", peer) if mine else (peer, "this rank")
        why = f"{SECRET_ENV} is set on {where[0]} and unset on {where[1]}"
    return f"{peer}'s messages are not signed with this rank's key: {why}; set it to the same text on every node"


def remove_key(path: Path | None, key: bytes | None) -> None:
    """Remove rank 0's key file (whose key is ``key``), unless a later agreement already replaced it."""
    if path is None:
        return
    try:
        found = _read_key_file(path)
        if found is not None and found.key == key:
            path.unlink()
    except OSError:
        pass


def _from_secret(secret: str) -> bytes:
    return hashlib.sha256(b"autodist agreement key\0" + secret.encode()).digest()


def derived_key(purpose: bytes) -> bytes | None:
    """A 32-byte key for ``purpose`` alone, derived from the job's secret
    (``AUTODIST_AGREE_SECRET_FILE`` or ``AUTODIST_AGREE_SECRET``; same checks and warning as the
    agreement's) by HKDF-SHA256 (RFC 5869) with ``purpose`` as its info: keys for two purposes
    tell nothing of each other, nor of the secret or the agreement's key. None when no secret
    is set: rank 0's random key of a one-machine job lives for one agreement, so nothing
    outlasting the job (a checkpoint) can be checked with it.

    >>> import os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "secret")
    >>> with open(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
    ...     _ = f.write("0123456789abcdef" * 4)
    >>> os.environ["AUTODIST_AGREE_SECRET_FILE"] = path
    >>> derived_key(b"autodist checkpoint v1").hex()[:16], derived_key(b"another use").hex()[:16]
    ('648633adb483f270', 'fe086168b3b1ab11')
    >>> del os.environ["AUTODIST_AGREE_SECRET_FILE"]
    >>> derived_key(b"autodist checkpoint v1") is None
    True
    """
    secret = _secret()
    if not secret:
        return None
    extracted = hmac.digest(b"autodist job key", secret.encode(), "sha256")  # HKDF-Extract, a fixed salt
    return hmac.digest(extracted, purpose + b"\x01", "sha256")  # HKDF-Expand, one block


def _hosts() -> set[str]:
    endpoints = [e for e in os.environ.get("PADDLE_TRAINER_ENDPOINTS", "").split(",") if e]
    return {e.rpartition(":")[0] for e in endpoints}


def one_host() -> bool:
    """Whether ``PADDLE_TRAINER_ENDPOINTS`` puts every rank on one host (then the ranks share
    this machine's key file)."""
    return len(_hosts()) == 1


def _require_one_host() -> None:
    """Refuse, naming :data:`SECRET_ENV`, unless every rank runs on one host (:func:`one_host`)."""
    if one_host():
        return
    hosts = _hosts()
    where = (
        "the job's ranks run on several machines (PADDLE_TRAINER_ENDPOINTS)"
        if hosts
        else "PADDLE_TRAINER_ENDPOINTS is not set, so nothing says the job's ranks run on one machine"
    )
    raise PlanError(
        f"agreement: {where}, so they share no secret: set {SECRET_FILE_ENV} to a file only you can read, holding "
        f"the same random text on every node (`umask 077; python -c 'import secrets; print(secrets.token_hex(32))' "
        f"> FILE`, README: Security)",
        source="environment",
    )


def key_file(master: str) -> Path:
    """Where rank 0 writes the key of the job whose master is ``master``: in this user's private
    folder (:func:`key_folders`, the first that is one), made if missing. A folder in the way
    that is not private (another user made ``$TMPDIR/autodist-<uid>`` first, or it is open to
    others) is skipped with a warning naming it: every rank of this user skips it alike."""
    skipped = []
    for folder in key_folders():
        try:
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            info = os.lstat(folder)
        except OSError as err:
            skipped.append(f"{folder} ({err.strerror})")
            continue
        if stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid() and not info.st_mode & 0o077:
            if skipped:
                warnings.warn(f"autodist: the job's key goes to {folder}; skipped {', '.join(skipped)}", stacklevel=2)
            return folder / f"agree-{re.sub(r'[^A-Za-z0-9.-]', '_', master)}.key"
        owner = (
            "another user's"
            if info.st_uid != os.getuid()
            else "open to others"
            if info.st_mode & 0o077
            else "not a folder"
        )
        skipped.append(f"{folder} ({owner})")
    raise PlanError(
        f"agreement: no folder only this user can open for the job's key: {'; '.join(skipped)}; remove one, "
        f"or set {SECRET_FILE_ENV}",
        source="environment",
    )


def key_folders() -> list[Path]:
    """Where the key file may go, in order: ``$TMPDIR/autodist-<uid>``, then
    ``~/.cache/autodist/keys`` (when the first is another user's)."""
    return [Path(tempfile.gettempdir()) / f"autodist-{os.getuid()}", Path.home() / ".cache" / "autodist" / "keys"]


def _read_key_file(path: Path) -> KeyFile | None:
    """What ``path`` holds; None when it is not a key file of ours (wrong type, owner or content)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
            return None
        text = os.read(fd, _KEY_FILE_MAX_BYTES)
    finally:
        os.close(fd)
    hex_key, port, *mark = text.split(b" ") if text.count(b" ") in (1, 2) else [b"", b""]
    try:
        key = bytes.fromhex(hex_key.decode("ascii"))
    except ValueError:
        return None
    if not key or not port.isdigit() or not 0 < int(port) < 65536 or mark not in ([], [b"secret"]):
        return None
    return KeyFile(key, bool(mark), int(port))
