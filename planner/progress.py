"""Progress of long steps (tracing a large model, a large search) on stderr.

Shown only when stderr is a terminal and the user did not ask for ``--quiet``, so logs, pipes
and CI stay clean. One line per step, rewritten in place while it runs::

    tracing LlamaForCausalLM ... done (2.4 s)

Example::

    >>> progress = Progress(quiet=False)
    >>> with progress.step("tracing the model"):
    ...     pass
"""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager
from typing import IO, Iterator


class Progress:
    """Reports steps on ``stream`` (stderr by default) when it is a terminal and not ``quiet``."""

    def __init__(self, quiet: bool = False, stream: IO[str] | None = None):
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = not quiet and _is_terminal(self.stream)

    @contextmanager
    def step(self, what: str) -> Iterator[None]:
        """``what ...`` while the block runs, then ``what ... done (1.2 s)`` (or ``failed``)."""
        start = time.perf_counter()
        self._write(f"\r{what} ...")
        try:
            yield
        except BaseException:
            self._write(f"\r{what} ... failed\n")
            raise
        self._write(f"\r{what} ... done ({time.perf_counter() - start:.1f} s)\n")

    def _write(self, text: str) -> None:
        if self.enabled:
            self.stream.write(text)
            self.stream.flush()


def _is_terminal(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # closed or not a real file
        return False
