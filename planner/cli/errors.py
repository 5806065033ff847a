"""The one way every ``autodist-plan`` command reports a problem in what the user gave: an
``error: <one line>`` on stderr (plan text escaped), indented detail lines when there are any, and
exit status 2 with no output file written.

Example::

    >>> import click
    >>> from click.testing import CliRunner
    >>> @click.command()
    ... @one_line_errors
    ... def cmd():
    ...     raise PlannerError("model.py: no factory build_model()", detail="line 3\\nline 4")
    >>> result = CliRunner().invoke(cmd)
    >>> result.exit_code, result.output
    (2, 'error: model.py: no factory build_model()\\n  line 3\\n  line 4\\n')
"""

from __future__ import annotations

import functools
import traceback
from typing import Callable

import click

from autodist.schemas import PlanError, printable
from autodist.schemas.checkpoint import CheckpointError

from autodist.planner.errors import PlannerError
from autodist.planner.review.export import ExportError

#: Exit status of every command for bad input (a missing file, an invalid plan, a bad degree, ...).
USAGE_ERROR = 2


class OneLineError(click.ClickException):
    """A problem in what the user gave, on its way out of the CLI: ``error: <message>`` (then any
    detail lines, indented), exit status 2. Every command's errors, click's own included
    (``main.click_errors_in_our_style``), leave this way."""

    exit_code = USAGE_ERROR

    def __init__(self, message: str, detail: str = ""):
        super().__init__(message)
        self.detail = detail

    def show(self, file=None) -> None:
        click.echo(printable(f"error: {' '.join(self.message.split())}"), err=True)
        if self.detail:
            click.echo("\n".join(printable("  " + line) for line in self.detail.splitlines()), err=True)


def one_line_errors(command: Callable) -> Callable:
    """Turn the problems a user can cause into :class:`OneLineError` (one ``error:`` line, exit 2)."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except PlannerError as err:
            raise OneLineError(err.message, err.detail) from None
        except PlanError as err:  # a plan read, or one made that load_plan would refuse (never written)
            raise OneLineError(f"{err.source}: invalid plan: {'; '.join(err.problems)}") from None
        except (ExportError, CheckpointError, OSError) as err:  # a checkpoint's metadata is untrusted text too
            raise OneLineError(str(err)) from None

    return wrapper


def unexpected(err: Exception, target: str) -> OneLineError:
    """A failure inside the planner that is no fault of the user's input (a bug, or Paddle failing
    in a way the planner does not know yet), as one line instead of a traceback: what failed and
    the innermost place it was raised, for a report.

    >>> try:
    ...     {}["x"]
    ... except KeyError as err:
    ...     print(unexpected(err, "model.py").message)  # doctest: +ELLIPSIS
    planning model.py failed inside the planner: KeyError: 'x' (raised at ...); please report it with the model
    """
    frame = traceback.extract_tb(err.__traceback__)[-1] if err.__traceback__ else None
    at = f" (raised at {frame.filename}:{frame.lineno})" if frame else ""
    text = (str(err).strip().splitlines() or [""])[0]
    return OneLineError(
        f"planning {target} failed inside the planner: {type(err).__name__}: {text}{at}; please report it with the model"
    )
