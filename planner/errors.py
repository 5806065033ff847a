"""The one exception the planner reports user-facing problems with."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any


class PlannerError(Exception):
    """A problem the user can fix (a bad target, input spec or degree).

    The CLI prints ``error: <message>`` on stderr, then ``detail`` (indented) when there is one,
    and exits with status 2 without writing any output file.

    Example::

        >>> err = PlannerError("model.py: no factory build_model() and no module-level `model`")
        >>> str(err)
        'model.py: no factory build_model() and no module-level `model`'
    """

    def __init__(self, message: str, detail: str = "", layer: str | None = None):
        super().__init__(message)
        self.message = message
        #: Extra lines for the user, e.g. the tail of their factory's traceback.
        self.detail = detail
        #: The model's layer the problem lies in, when one does ('' the top level): the driver,
        #: which holds the model, names its forward's source line (``driver._located``).
        self.layer = layer


def source_place(function: Callable[..., Any]) -> tuple[str, int]:
    """``(file, first line)`` of ``function``'s source, the file relative to the working directory
    when it lies under it (as the model path the user typed is): a place a plan's notes can hold
    and stay the same bytes in another checkout. Raises OSError or TypeError when there is none.

    >>> file, line = source_place(source_place); file, line > 0
    ('planner/errors.py', True)
    """
    file = Path(inspect.getsourcefile(function) or "")
    lines = inspect.getsourcelines(function)[1]
    try:
        file = file.resolve().relative_to(Path.cwd().resolve())
    except ValueError:
        pass
    return str(file), lines
