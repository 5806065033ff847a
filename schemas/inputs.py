"""Reading an input file the user (or an attacker) names: the one bounded, typed reader.

Every file autodist reads as input goes through :func:`read_input_file`: plans (``load_plan``,
``show``, ``check``, ...), ``--rules`` and ``--cluster`` TOML (through :func:`load_toml`), and
checkpoint metadata. It refuses, quickly and with one line:

- what is not a regular file: a FIFO (reading one would wait for a writer forever), a device
  such as ``/dev/zero`` (endless), a folder, a socket;
- a file larger than the caller's cap (checked before reading, and again while reading, since a
  file may grow);

and :func:`load_toml` adds what a TOML parser does not bound: lines longer than
:data:`MAX_TOML_LINE` (Python's ``tomllib`` takes time quadratic in the parts of a dotted key:
50,000 parts take a minute), nesting deeper than :data:`MAX_TOML_DEPTH` (3,000 nested arrays
overflow its recursion), and integers of more digits than Python converts (a 5,000-digit one is
a ``ValueError`` inside ``tomllib``). The range of each number is its reader's to check.

Every refusal is an :class:`InputFileError` naming the file; callers re-raise it as their own
error type (``PlanError``, ``PlannerError``, ``CheckpointError``).

Example::

    >>> try:
    ...     read_input_file("/dev/zero", what="plan file", max_bytes=1 << 20)
    ... except InputFileError as err:
    ...     print(err)
    /dev/zero: not a regular file (a character device); give a plan file
    >>> import tempfile, os
    >>> with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as f:
    ...     _ = f.write('"blocks.*.fc1" = "colwise"\\n')
    >>> load_toml(f.name, what="rules file")
    {'blocks.*.fc1': 'colwise'}
    >>> os.unlink(f.name)
"""

from __future__ import annotations

import os
import stat
import tomllib
from typing import Any

from autodist.schemas.errors import printable

#: The largest TOML input (rules, cluster files): both are a few dozen lines.
MAX_TOML_BYTES = 1 << 20
#: The longest TOML line: a dotted key (``a.b.c... = 1``) must sit on one line, and ``tomllib``'s
#: time grows with the square of its parts, so this bounds the parse time (about 0.01 s a line).
MAX_TOML_LINE = 1000
#: The deepest nesting of tables and arrays a TOML input may have (rules are flat; a cluster file
#: has two levels).
MAX_TOML_DEPTH = 16

_KINDS = {
    stat.S_ISDIR: "a folder",
    stat.S_ISFIFO: "a FIFO (named pipe)",
    stat.S_ISCHR: "a character device",
    stat.S_ISBLK: "a block device",
    stat.S_ISSOCK: "a socket",
}


class InputFileError(ValueError):
    """An input file cannot be read as one: not a regular file, too large, or malformed. The
    message starts with the file's name (made printable)."""


def read_input_file(path: str | os.PathLike, *, what: str, max_bytes: int, follow_symlinks: bool = True) -> bytes:
    """The bytes of ``path``, a regular file of at most ``max_bytes`` bytes.

    ``what`` names the kind of file in the messages (``"plan file"``). Never blocks on a FIFO
    (it is opened non-blocking and refused by type), never reads more than ``max_bytes + 1``.
    With ``follow_symlinks=False`` a symlink is refused (a checkpoint's metadata: nothing
    outside its folder is read). Raises :class:`InputFileError`.
    """
    name = printable(os.fspath(path))
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0) | (0 if follow_symlinks else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except OSError as err:
        if not follow_symlinks and os.path.islink(path):  # O_NOFOLLOW's ELOOP
            raise InputFileError(f"{name}: a symbolic link; give the {what} itself") from None
        raise InputFileError(f"{name}: cannot read the {what}: {err.strerror or err}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            kind = next((kind for test, kind in _KINDS.items() if test(info.st_mode)), "not a file")
            raise InputFileError(f"{name}: not a regular file ({kind}); give a {what}")
        too_large = f"{name}: larger than {_size(max_bytes)}, the most a {what} may be"
        if info.st_size > max_bytes:
            raise InputFileError(too_large)
        chunks, total = [], 0
        while total <= max_bytes:
            chunk = os.read(fd, min(1 << 20, max_bytes + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
        if total > max_bytes:  # it grew while being read
            raise InputFileError(too_large)
        return b"".join(chunks)
    except OSError as err:
        raise InputFileError(f"{name}: cannot read the {what}: {err.strerror or err}") from None
    finally:
        os.close(fd)


def load_toml(path: str | os.PathLike, *, what: str, max_bytes: int = MAX_TOML_BYTES) -> dict[str, Any]:
    """The tables of a TOML file read with :func:`read_input_file`, within the caps above.

    Raises :class:`InputFileError` naming the file and the problem (``not valid TOML: ...``,
    ``line 3 is longer than 1000 characters``, ``nested deeper than 16 levels``, ...).
    """
    return parse_toml(read_input_file(path, what=what, max_bytes=max_bytes), os.fspath(path), what=what)


def parse_toml(data: bytes, name: str, *, what: str) -> dict[str, Any]:
    """The tables of TOML ``data`` read from the file ``name``, within the caps above (what
    :func:`load_toml` does after reading; for a caller that also needs the text, such as the
    rules file's line numbers)."""
    name = printable(name)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise InputFileError(f"{name}: not a text file (a {what} is TOML in UTF-8)") from None
    for number, line in enumerate(text.splitlines(), 1):
        if len(line) > MAX_TOML_LINE:
            raise InputFileError(f"{name}: line {number} is longer than {MAX_TOML_LINE} characters; is this a {what}?")
    try:
        tables = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise InputFileError(f"{name}: not valid TOML: {err}") from None
    except RecursionError:
        raise InputFileError(f"{name}: nested deeper than {MAX_TOML_DEPTH} levels; is this a {what}?") from None
    except ValueError as err:  # an integer of more digits than Python converts (sys.get_int_max_str_digits)
        raise InputFileError(f"{name}: a number out of range ({err})") from None
    problem = _nesting_problem(tables)
    if problem:
        raise InputFileError(f"{name}: {problem}")
    return tables


def _nesting_problem(tables: dict[str, Any]) -> str:
    """Where decoded TOML nests deeper than :data:`MAX_TOML_DEPTH`, or ''. Iterative, so no
    input can exhaust the stack here. What a number means, and its range, is the reader's to check
    (a cluster file's bandwidth must be a positive, finite number of GB/s)."""
    stack: list[tuple[Any, int, str]] = [(tables, 0, "")]
    while stack:
        value, depth, where = stack.pop()
        if depth > MAX_TOML_DEPTH:
            return f"nested deeper than {MAX_TOML_DEPTH} levels (at {printable(where[:80])}...)"
        if isinstance(value, dict):
            stack.extend((v, depth + 1, f"{where}.{k}" if where else str(k)) for k, v in value.items())
        elif isinstance(value, list):
            stack.extend((v, depth + 1, f"{where}[{i}]") for i, v in enumerate(value))
    return ""


def _size(n: int) -> str:
    """``1048576`` -> ``1 MiB``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:g} {unit}"
        n //= 1024
    return f"{n} B"  # pragma: no cover
