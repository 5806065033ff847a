"""The one exception the planner reports user-facing problems with."""

from __future__ import annotations


class PlannerError(Exception):
    """A problem the user can fix (a bad target, input spec or degree).

    The CLI prints ``error: <message>`` on stderr, then ``detail`` (indented) when there is one,
    and exits with status 2 without writing any output file.

    Example::

        >>> err = PlannerError("model.py: no factory build_model() and no module-level `model`")
        >>> str(err)
        'model.py: no factory build_model() and no module-level `model`'
    """

    def __init__(self, message: str, detail: str = ""):
        super().__init__(message)
        self.message = message
        #: Extra lines for the user, e.g. the tail of their factory's traceback.
        self.detail = detail
