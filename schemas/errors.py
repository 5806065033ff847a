"""The one exception every plan problem is reported with."""

from __future__ import annotations


class PlanError(ValueError):
    """A plan cannot be used. ``problems`` lists every reason, one readable line each.

    Example::

        >>> err = PlanError(["$.mesh.shape: 2 x 2 = 4 ranks but 3 process ids"], source="plan.json")
        >>> print(err)
        plan.json: invalid plan: $.mesh.shape: 2 x 2 = 4 ranks but 3 process ids
    """

    def __init__(self, problems: list[str] | str, source: str = "plan"):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        self.source = source
        if len(self.problems) == 1:
            message = f"{source}: invalid plan: {self.problems[0]}"
        else:
            lines = "\n".join(f"  - {p}" for p in self.problems)
            message = f"{source}: invalid plan, {len(self.problems)} problems:\n{lines}"
        super().__init__(message)
