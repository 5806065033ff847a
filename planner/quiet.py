"""What Paddle, networkx and PaddleFormers print while the planner runs, and how it is kept off the
user's screen: the one owner for the command line and for :func:`autodist.plan` from Python.

Importing Paddle and tracing a model write lines the planner does not own and that say nothing
about the user's model: Python warnings (``No ccache found``, networkx's ``The hashes produced for
directed graphs changed``) and C++ glog lines (``W1202 ... Paddle static graph(PIR) not support
input out tensor for now!!!!``). They are noise, in two kinds:

- :data:`NOISE_WARNINGS`, Python warnings, ignored by :func:`ignore_noise_warnings`;
- glog's ``W`` and ``I`` lines, which Paddle's C++ writes to file descriptor 2. The command line
  sets ``GLOG_minloglevel=2`` before Paddle is imported (:func:`silence_library_noise`); from
  Python, Paddle is imported already, so :func:`without_library_noise` holds descriptor 2 while
  planning and writes back every line but those (:func:`is_noise`).

``--quiet`` holds back everything the planning prints (:func:`held_stderr`), noise or not.

Example::

    >>> with held_stderr(expected=(ValueError,)):
    ...     print("a library's notice", file=sys.stderr)
    >>> is_noise("W1202 06:21:48.017689 28640 eager_utils.cc:3584] Paddle static graph(PIR) not support")
    True
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
import warnings
from contextlib import contextmanager
from typing import Callable, Iterator

#: Python warnings of Paddle's import and networkx's graph hashing: nothing about the user's model.
NOISE_WARNINGS = (
    "No ccache found",
    "The hashes produced for directed graphs changed",
    "Setuptools is replacing distutils",  # an import of Paddle's
)
#: A glog line below error level: ``W1202 06:21:48.017689 28640 eager_utils.cc:3584] ...``.
_GLOG_INFO_OR_WARNING = re.compile(rb"[IW]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ [^ \]]+:\d+\] ")


def silence_library_noise() -> None:
    """For the command line, before Paddle is imported: glog below error level off, and the
    noise warnings ignored."""
    os.environ.setdefault("GLOG_minloglevel", "2")
    ignore_noise_warnings()


def ignore_noise_warnings() -> None:
    """Ignore :data:`NOISE_WARNINGS` (in the current ``warnings`` filter state)."""
    for message in NOISE_WARNINGS:
        warnings.filterwarnings("ignore", message=message)


def is_noise(line: bytes | str) -> bool:
    """Whether one line written to descriptor 2 is a glog info or warning line."""
    return bool(_GLOG_INFO_OR_WARNING.match(line.encode() if isinstance(line, str) else line))


@contextmanager
def without_library_noise(expected: tuple[type[BaseException], ...] = ()) -> Iterator[None]:
    """Run the block (a whole planning) as the command line runs it: the noise warnings ignored
    and glog's info and warning lines dropped; everything else written to descriptor 2 (the
    user's model printing, our own warnings) is written back, in order, when the block ends."""
    with warnings.catch_warnings():
        ignore_noise_warnings()
        with held_stderr(expected, keep=lambda line: not is_noise(line)):
            yield


@contextmanager
def held_stderr(
    expected: tuple[type[BaseException], ...] = (), keep: Callable[[bytes], bool] | None = None
) -> Iterator[None]:
    """Send descriptor 2 to a temporary file while the block runs. Afterwards write back the held
    lines ``keep`` accepts (none without ``keep``), or all of them if the block raises something
    not in ``expected`` (a bug or a crash: they may explain it)."""
    try:
        saved = os.dup(2)
    except OSError:  # no descriptor 2 (a detached process): nothing to hold
        yield
        return
    replay_all = False
    with tempfile.TemporaryFile() as held:
        _flush_stderr()
        os.dup2(held.fileno(), 2)
        try:
            yield
        except expected:
            raise
        except BaseException:
            replay_all = True
            raise
        finally:
            _flush_stderr()
            os.dup2(saved, 2)
            os.close(saved)
            if replay_all or keep is not None:
                held.seek(0)
                lines = held.read().splitlines(keepends=True)
                _write_all(2, b"".join(line for line in lines if replay_all or (keep and keep(line))))


def _write_all(fd: int, data: bytes) -> None:
    """``os.write`` until every byte is written (a pipe may take a large write in parts)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _flush_stderr() -> None:
    """Flush Python's buffer so its text lands on the descriptor it was written for."""
    try:
        sys.stderr.flush()
    except (OSError, ValueError):  # closed or replaced by something without a buffer
        pass
