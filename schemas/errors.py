"""The one exception every plan problem is reported with, and the one way plan text is made safe
to print."""

from __future__ import annotations


def printable(text: str) -> str:
    """``text`` with every character that is not printable written as a Python escape, so plan
    text cannot move the cursor, clear a terminal, forge a line or break markup.

    Plans are untrusted input; every human-facing output of a plan string goes through this
    (error messages here, and the planner's review commands through ``review/format.py``).

    Example::

        >>> printable("layers.0\\x1b]0;owned\\x07\\nnext")
        'layers.0\\\\x1b]0;owned\\\\x07\\\\nnext'
        >>> printable("dp × mp")
        'dp × mp'
    """
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else _escape(c) for c in text)


def _escape(char: str) -> str:
    """``"\\n"`` -> ``\\n``; other characters as ``\\xNN``, ``\\uNNNN`` or ``\\UNNNNNNNN``."""
    named = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
    if char in named:
        return named[char]
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


class PlanError(ValueError):
    """A plan cannot be used. ``problems`` lists every reason, one readable line each.

    Problems and source are made printable (:func:`printable`): a plan's text never reaches a
    terminal raw through an error.

    Example::

        >>> err = PlanError(["$.mesh.shape: 2 x 2 = 4 ranks but 3 process ids"], source="plan.json")
        >>> print(err)
        plan.json: invalid plan: $.mesh.shape: 2 x 2 = 4 ranks but 3 process ids
    """

    def __init__(self, problems: list[str] | str, source: str = "plan"):
        problems = [problems] if isinstance(problems, str) else list(problems)
        self.problems = [printable(p) for p in problems]
        self.source = printable(source)
        if len(self.problems) == 1:
            message = f"{self.source}: invalid plan: {self.problems[0]}"
        else:
            lines = "\n".join(f"  - {p}" for p in self.problems)
            message = f"{self.source}: invalid plan, {len(self.problems)} problems:\n{lines}"
        super().__init__(message)
