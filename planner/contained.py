"""Paddle run where its crash cannot take the planner down: in a process forked from the planner.

Some Paddle calls the planner makes end the process on inputs Paddle mishandles: a SIGSEGV or an
abort in C++, no Python exception (docs/paddle-notes.md, "SPMD rules"). The planner makes such
calls in a child forked from itself, Paddle already imported (nothing loads again: a fork costs
about 40 ms on a loaded 2-core machine), and a child that dies raises :class:`Crashed` here, which
the caller takes as that check's refusal. Forking after Paddle has run forwards and backwards is
safe on Linux CPU: a child ran SPMD rules and a forward and backward 50 times in a row, none hung
(docs/paddle-notes.md, "Crashes contained"); a child that hangs all the same is killed after its
deadline and counts as a crash. The child's output goes nowhere, so a crash dump from Paddle never
reaches the user's terminal.

:func:`run_forked` runs one call so; ``recognise/rule_worker.py`` keeps one child answering many
SPMD rule calls.

Example::

    >>> import os
    >>> run_forked("a sum", sum, [1, 2, 3])
    6
    >>> try:
    ...     run_forked("a call that kills its process", os.abort)
    ... except Crashed as crash:
    ...     print(crash)
    a call that kills its process crashed (SIGABRT)
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import signal
from multiprocessing.connection import Connection
from typing import Any, Callable

#: How long a forked call may run before it is taken for hung (planning a large model on a loaded
#: machine is slow; a proof runs forwards and backwards).
DEADLINE_SECONDS = 1800.0


class Crashed(Exception):
    """The child running ``what`` died (``exit_code`` < 0: by that signal) or hung (None).

    >>> str(Crashed("Paddle's SPMD rule flatten", -11)), str(Crashed("the proof", None))
    ("Paddle's SPMD rule flatten crashed (SIGSEGV)", 'the proof crashed (no answer in time)')
    """

    def __init__(self, what: str, exit_code: int | None):
        if exit_code is None:
            how = "no answer in time"
        elif exit_code < 0:
            how = signal.Signals(-exit_code).name
        else:
            how = f"exit {exit_code}"
        super().__init__(f"{what} crashed ({how})")


def fork(target: Callable[[Connection], None], name: str, *, daemon: bool = True) -> tuple[Any, Connection]:
    """A child forked to run ``target(connection)``, its output silenced; this side's end of the
    pipe, which reads as closed once the child is gone. A ``daemon`` child dies with this process
    but may not fork children of its own."""
    context = multiprocessing.get_context("fork")
    ours, theirs = context.Pipe()
    child = context.Process(target=_silenced, args=(target, theirs, ours), daemon=daemon, name=name)
    child.start()
    theirs.close()
    return child, ours


def _silenced(target: Callable[[Connection], None], connection: Connection, parents_end: Connection) -> None:
    # What the fork copied from the parent is never collected here: garbage the parent had not yet
    # collected includes Paddle objects whose destructors wait on a condition variable that a
    # parent's thread, absent in the child, waited on. Collected here, the child hung for ever in
    # pthread_cond_destroy (seen at 97 % of a whole make test: an xdist worker waiting on its child).
    gc.freeze()
    # The fork copied the parent's end of the pipe too: held open here, a child reading until the
    # pipe closes would never see it close, and :func:`end` would wait out its 5 s and kill it.
    parents_end.close()
    quiet = os.open(os.devnull, os.O_WRONLY)
    os.dup2(quiet, 1)
    os.dup2(quiet, 2)
    code = 0
    try:
        target(connection)
    except BaseException:
        code = 1
    finally:
        # Leave at once, as the SIGKILL that ended a child before did: multiprocessing's own exit
        # flushes the streams and runs its exit functions, objects this fork copied from a process
        # that may talk over them (a pytest-xdist worker's channel to its controller: with it, 2
        # of 3 whole suites lost a worker, "node down: Not properly terminated", and hung).
        os._exit(code)


def end(child: Any, connection: Connection) -> int | None:
    """End ``child`` (dead, or hung: killed): its exit code, None when it had to be killed."""
    connection.close()
    child.join(5)
    if child.exitcode is None:
        child.kill()
        child.join()
        return None
    return child.exitcode


def run_forked(
    what: str, function: Callable[..., Any], *args: Any, seconds: float = DEADLINE_SECONDS, nests: bool = False
) -> Any:
    """``function(*args)`` in a forked child: its result, or the exception it raised, here;
    :class:`Crashed` when the child dies or runs past ``seconds``. The child's side effects stay
    in the child. A child that ``nests`` may run forked calls of its own (it is no daemon: it is
    ended here however this call ends)."""

    def answer(connection: Connection) -> None:
        try:
            connection.send(("returned", function(*args)))
        except Exception as err:  # raised here as it was there (as its text, if it does not pickle)
            try:
                connection.send(("raised", err))
            except Exception:
                connection.send(("raised", RuntimeError(f"{type(err).__name__}: {err}")))

    child, connection = fork(answer, "autodist-contained", daemon=not nests)
    value: Any
    try:
        kind, value = connection.recv() if connection.poll(seconds) else ("hung", None)
    except (EOFError, OSError):
        kind, value = "died", None
    finally:
        exit_code = end(child, connection)
    if kind == "returned":
        return value
    if kind == "raised":
        raise value
    raise Crashed(what, exit_code)
