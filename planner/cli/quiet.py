"""``--quiet``: hold back what Paddle, PaddleFormers and the user's model print while planning.

Importing Paddle and PaddleFormers and tracing a model writes lines the planner does not own:
Python warnings (``No ccache found``), PaddleFormers' ``[ WARNING]``/``[ INFO]`` log lines, C++
glog lines. They go to file descriptor 2 from Python and from C++ alike, so :func:`held_stderr`
points descriptor 2 at a temporary file for the duration of the block and drops what was written
there. Our own errors are not written inside the block: they leave it as exceptions and are printed
by the command afterwards. When the block fails with something that is not the user's mistake
(a bug, a crash), the held lines are written back, since they may explain it.

Example::

    >>> with held_stderr(expected=(ValueError,)):
    ...     print("a library's notice", file=sys.stderr)
"""

from __future__ import annotations

import os
import sys
import tempfile
from contextlib import contextmanager
from typing import Iterator


@contextmanager
def held_stderr(expected: tuple[type[BaseException], ...] = ()) -> Iterator[None]:
    """Send descriptor 2 to a temporary file while the block runs; write the held text back only
    if the block raises something not in ``expected``."""
    try:
        saved = os.dup(2)
    except OSError:  # no descriptor 2 (a detached process): nothing to hold
        yield
        return
    replay = False
    with tempfile.TemporaryFile() as held:
        _flush_stderr()
        os.dup2(held.fileno(), 2)
        try:
            yield
        except expected:
            raise
        except BaseException:
            replay = True
            raise
        finally:
            _flush_stderr()
            os.dup2(saved, 2)
            os.close(saved)
            if replay:
                held.seek(0)
                os.write(2, held.read())


def _flush_stderr() -> None:
    """Flush Python's buffer so its text lands on the descriptor it was written for."""
    try:
        sys.stderr.flush()
    except (OSError, ValueError):  # closed or replaced by something without a buffer
        pass
