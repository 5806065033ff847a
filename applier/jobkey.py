"""The job's secret: the key that lets a rank tell the job's other ranks from any other process.

The agreement between ranks (agree.py) signs every message with an HMAC under this key, so a
process that does not hold it can neither take part nor pass for rank 0. Paddle's launcher
gives the ranks nothing secret (its environment is the job's layout: ranks, endpoints, master
address, all guessable), so the key comes from one of:

- ``AUTODIST_AGREE_SECRET``, when set: the same text on every rank (for a job across machines,
  export it on every node before ``paddle.distributed.launch``, which passes its environment on
  to each rank);
- else, when every rank runs on one machine (all of ``PADDLE_TRAINER_ENDPOINTS`` on one host):
  a random key rank 0 writes, for each agreement, into a folder only this user can open
  (``$TMPDIR/autodist-<uid>``, mode 0700), named after the job's master endpoint; the other
  ranks read it there. Other users' processes cannot; this user's own processes can, as they can
  read the ranks' memory anyway.

A job across machines without ``AUTODIST_AGREE_SECRET`` is refused with a ``PlanError`` naming
the variable: there is no secret to share, and an agreement anyone can join would protect
nothing.

Example::

    >>> import os
    >>> os.environ["AUTODIST_AGREE_SECRET"] = "s3cret"
    >>> len(read_key("127.0.0.1:6170"))
    32
    >>> del os.environ["AUTODIST_AGREE_SECRET"]  # the example's secret is not the process's
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import stat
import tempfile
from pathlib import Path

from autodist.schemas import PlanError

SECRET_ENV = "AUTODIST_AGREE_SECRET"
#: A key file is 64 hex digits; anything larger is not one of ours.
_KEY_FILE_MAX_BYTES = 256


def read_key(master: str) -> bytes | None:
    """The job's key as a rank > 0 finds it: from ``AUTODIST_AGREE_SECRET``, else rank 0's key
    file for the job at ``master`` (None while rank 0 has not written it yet)."""
    secret = os.environ.get(SECRET_ENV)
    if secret:
        return _from_secret(secret)
    _require_one_host()
    try:
        return _read_key_file(key_file(master))
    except OSError:  # not written yet (or not a plain file): rank 0 writes it before it listens
        return None


def new_key(master: str) -> tuple[bytes, Path | None]:
    """The job's key as rank 0 makes it: from ``AUTODIST_AGREE_SECRET``, else a fresh random
    key written to the job's key file. Returns ``(key, file to remove when done, or None)``."""
    secret = os.environ.get(SECRET_ENV)
    if secret:
        return _from_secret(secret), None
    _require_one_host()
    path = key_file(master)
    key = secrets.token_bytes(32)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.write(fd, key.hex().encode())
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as err:
        raise PlanError(
            f"agreement: cannot write the job's key to {path}: {err.strerror or err}; set {SECRET_ENV}",
            source="environment",
        ) from None
    return key, path


def remove_key(path: Path | None, key: bytes) -> None:
    """Remove rank 0's key file, unless a later agreement already replaced it."""
    if path is None:
        return
    try:
        if _read_key_file(path) == key:
            path.unlink()
    except OSError:
        pass


def _from_secret(secret: str) -> bytes:
    return hashlib.sha256(b"autodist agreement key\0" + secret.encode()).digest()


def _require_one_host() -> None:
    """Refuse, naming :data:`SECRET_ENV`, unless ``PADDLE_TRAINER_ENDPOINTS`` puts every rank on
    one host (then the ranks share this machine's key file)."""
    endpoints = [e for e in os.environ.get("PADDLE_TRAINER_ENDPOINTS", "").split(",") if e]
    hosts = {e.rpartition(":")[0] for e in endpoints}
    if len(hosts) == 1:
        return
    where = (
        "the job's ranks run on several machines (PADDLE_TRAINER_ENDPOINTS)"
        if hosts
        else "PADDLE_TRAINER_ENDPOINTS is not set, so nothing says the job's ranks run on one machine"
    )
    raise PlanError(
        f"agreement: {where}, so they share no secret: set {SECRET_ENV} to the same random text on every node "
        f"(e.g. the output of `python -c 'import secrets; print(secrets.token_hex(32))'`)",
        source="environment",
    )


def key_file(master: str) -> Path:
    """Where rank 0 writes the key of the job whose master is ``master`` (when no secret is
    set): in this user's private folder, made if missing."""
    folder = Path(tempfile.gettempdir()) / f"autodist-{os.getuid()}"
    try:
        folder.mkdir(mode=0o700, exist_ok=True)
        info = os.lstat(folder)
    except OSError as err:
        raise PlanError(f"agreement: cannot make {folder} for the job's key: {err.strerror}", "environment") from None
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise PlanError(
            f"agreement: {folder} is not a folder only this user can open (it holds the job's key); remove it, "
            f"or set {SECRET_ENV}",
            source="environment",
        )
    return folder / f"agree-{re.sub(r'[^A-Za-z0-9.-]', '_', master)}.key"


def _read_key_file(path: Path) -> bytes | None:
    """The key in ``path``; None when it is not a key file of ours (wrong type, owner or content)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
            return None
        text = os.read(fd, _KEY_FILE_MAX_BYTES)
    finally:
        os.close(fd)
    try:
        return bytes.fromhex(text.decode("ascii"))
    except ValueError:
        return None
