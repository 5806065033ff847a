"""Progress of long steps (tracing a large model, a large search) on stderr.

Shown only when stderr is a terminal and the user did not ask for ``--quiet``, so logs, pipes
and CI stay clean. One line per step, rewritten in place while it runs::

    tracing LlamaForCausalLM ... done (2.4 s)

Example::

    >>> progress = Progress(quiet=False)
    >>> with progress.step("tracing the model"):
    ...     pass
    >>> for i in progress.count("matching blocks", range(3)):
    ...     pass
"""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager
from typing import IO, Iterable, Iterator, TypeVar

T = TypeVar("T")

#: Redraw a counter at most this often, so a fast loop is not slowed by the terminal.
REDRAW_S = 0.1


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

    def count(self, what: str, items: Iterable[T], total: int | None = None) -> Iterator[T]:
        """Yield ``items`` while showing ``what 12/40``; ``total`` defaults to ``len(items)``."""
        if total is None and hasattr(items, "__len__"):
            total = len(items)  # type: ignore[arg-type]
        of = f"/{total}" if total is not None else ""
        last = 0.0
        with self.step(what):
            for done, item in enumerate(items, 1):
                now = time.perf_counter()
                if now - last >= REDRAW_S:
                    self._write(f"\r{what} {done}{of} ...")
                    last = now
                yield item

    def _write(self, text: str) -> None:
        if self.enabled:
            self.stream.write(text)
            self.stream.flush()


def _is_terminal(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # closed or not a real file
        return False
