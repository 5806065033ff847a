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

import contextlib
import functools
import os
import signal
import sys
import traceback
from typing import Callable, Iterator, NoReturn

import click

from autodist.schemas import PlanError, printable
from autodist.schemas.checkpoint import CheckpointError

from autodist.planner.contained import Crashed
from autodist.planner.errors import PlannerError
from autodist.planner.progress import Progress
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


#: In the child :func:`contained_command` runs the command in: the pipe on which it tells each
#: step it starts (:class:`ToldProgress`); None elsewhere.
_STEPS: int | None = None


def contained_command(command: Callable[[], object]) -> NoReturn:
    """Run ``command`` (the whole ``autodist-plan`` command line) in a child forked before Paddle
    is imported, and exit with its status. If Paddle kills it by a signal somewhere the planner
    does not contain the crash itself (tracing runs the user's forward, say), this process says
    so in one ``error:`` line naming the step it was on, and exits 2; the plan is never half
    written (it is saved atomically). Ctrl-C reaches the child, which answers it as click does."""
    global _STEPS
    steps, told = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(steps)
        _STEPS = told
        command()
        sys.exit(0)
    os.close(told)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _, status = os.waitpid(child, 0)
    with os.fdopen(steps) as pipe:
        said = pipe.read().splitlines()
    if os.WIFSIGNALED(status):
        step = f" while {said[-1]}" if said else ""
        crash = Crashed("autodist-plan", -os.WTERMSIG(status))
        OneLineError(f"{crash} in Paddle{step}; nothing was written; please report it with the model").show()
        sys.exit(USAGE_ERROR)
    sys.exit(os.waitstatus_to_exitcode(status))


def quiet_paddle_crashes() -> None:
    """In :func:`contained_command`'s child, with Paddle imported: Paddle's own fatal-signal
    handler off, so a crash ends the child by its signal alone, with no C++ dump on the terminal."""
    if _STEPS is not None:
        import paddle

        paddle.disable_signal_handler()


class ToldProgress(Progress):
    """:class:`Progress` that also tells :func:`contained_command`'s parent each step it starts."""

    @contextlib.contextmanager
    def step(self, what: str) -> Iterator[None]:
        if _STEPS is not None:
            os.write(_STEPS, (" ".join(what.split()) + "\n").encode())
        with super().step(what):
            yield
