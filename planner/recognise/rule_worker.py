"""Paddle's SPMD rules asked in a child process: a rule that crashes refuses its op, and the
planner goes on.

Paddle 3.3.1's SPMD rules are C++, and some of them kill the process on arguments they do not
expect: no Python exception, a SIGSEGV (``flatten`` on a size the trace knows only at run time,
``matmul`` on a missing operand: docs/paddle-notes.md, "SPMD rules"). The planner asks them through
:data:`RULES`, one process forked from the planner (Paddle is imported already, so the child loads
nothing) that answers calls over a pipe. When the child dies in a call, that call raises
:class:`RuleCrashed` naming the rule and the signal, and the next call forks a new child. Each
answer is kept by its arguments: a call asked again does not cross the pipe, and a crash is met
once per process. Forking after Paddle has run forwards and backwards is safe on Linux CPU (a
child ran rules and a backward 50 times in a row, no deadlock); a child that does not answer in
:data:`ANSWER_SECONDS` is killed and counted as a crash all the same.

Example::

    >>> answer = RULES.infer("matmul", (0, 1), [([8, 6], [-1, -1], False), ([6, 4], [-1, 0], False)], [False, False])
    >>> answer.outputs
    [((-1, 0), False)]
    >>> answer.inputs[1]
    ((-1, 0), False)
"""

from __future__ import annotations

import multiprocessing
import os
import signal
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Sequence, Union

#: A tensor handed to a rule: its shape, its dims mapping over the mesh, whether it is a partial sum.
Tensor = tuple[Sequence[int], Sequence[int], bool]
#: A layout a rule answers with: the dims mapping and whether it is a partial sum.
Layout = tuple[tuple[int, ...], bool]
Operand = Union[Tensor, list[Tensor]]
Answered = Union[Layout, list[Layout]]

#: How long one answer may take before the child is taken for hung (a loaded machine is slow).
ANSWER_SECONDS = 120.0
#: The exceptions with which a rule refuses its arguments (the op is then taken to need whole
#: inputs); any other exception is a bug and reaches the planner's caller.
REFUSALS = (RuntimeError, ValueError, TypeError, KeyError, IndexError)


class RuleRefused(Exception):
    """The rule raised one of :data:`REFUSALS` for these arguments."""


class RuleCrashed(Exception):
    """The process asking the rule died (or hung): ``str`` says which rule and how.

    >>> str(RuleCrashed("flatten", -11))
    "Paddle's SPMD rule flatten crashed (SIGSEGV)"
    """

    def __init__(self, rule: str, exit_code: int | None):
        how = (
            "no answer in %d s" % ANSWER_SECONDS
            if exit_code is None
            else signal.Signals(-exit_code).name
            if exit_code < 0
            else f"exit {exit_code}"
        )
        super().__init__(f"Paddle's SPMD rule {rule} crashed ({how})")


@dataclass(frozen=True)
class Answer:
    """What a rule says: the layout each operand needs, and each result's."""

    inputs: list[Answered]
    outputs: list[Answered]


def _layouts(attrs: Any) -> list[Answered]:
    return [
        [(tuple(a.dims_mapping), bool(a._partial_dims())) for a in attr]
        if isinstance(attr, list)
        else (tuple(attr.dims_mapping), bool(attr._partial_dims()))
        for attr in attrs
    ]


def _ask(rule: str, mesh: Any, operands: Sequence[Operand], extra: Sequence[Any]) -> Answer:
    """One rule call, in the process that runs it (the child)."""
    from paddle.base import core
    from paddle.distributed.auto_parallel.static.dist_attribute import DistTensorSpec, TensorDistAttr

    def spec(tensor: Tensor) -> DistTensorSpec:
        shape, dims, partial = tensor
        attr = TensorDistAttr()
        attr.process_mesh = mesh
        attr.dims_mapping = list(dims)
        if partial:
            attr._set_partial_dims([0])
        return DistTensorSpec(list(shape), attr)

    specs = [[spec(t) for t in o] if isinstance(o, list) else spec(o) for o in operands]
    inputs, outputs = core.get_phi_spmd_rule(rule).infer_forward(*specs, *extra)
    return Answer(_layouts(inputs), _layouts(outputs))


def _serve(conn: Connection) -> None:
    """The child: answer ``(rule, process ids, operands, extra)`` requests until the pipe closes.
    Its output goes nowhere: a crash dump from Paddle must not reach the user's terminal."""
    import paddle.distributed as dist

    quiet = os.open(os.devnull, os.O_WRONLY)
    os.dup2(quiet, 1)
    os.dup2(quiet, 2)
    meshes: dict[tuple[int, ...], Any] = {}
    while True:
        try:
            rule, ids, operands, extra = conn.recv()
        except EOFError:
            return
        mesh = meshes.setdefault(ids, dist.ProcessMesh(list(ids), dim_names=["mp"]))
        try:
            conn.send(("answer", _ask(rule, mesh, operands, extra)))
        except REFUSALS as err:
            conn.send(("refused", f"{type(err).__name__}: {err}"))
        except Exception as err:  # a bug: the planner's caller reports it
            conn.send(("failed", f"{type(err).__name__}: {err}"))


class RuleWorker:
    """The planner's side: :meth:`infer` asks the child, forking one when there is none."""

    def __init__(self) -> None:
        self._child: Any = None
        self._conn: Connection | None = None
        #: answers (or ``("refused" | "crashed", text)``) by their call's arguments
        self._answers: dict[str, tuple[str, Any]] = {}

    def infer(self, rule: str, ids: Sequence[int], operands: Sequence[Operand], extra: Sequence[Any]) -> Answer:
        """``core.get_phi_spmd_rule(rule).infer_forward(specs..., extra...)`` on a 1-D ``mp``
        mesh of ``ids``. Raises :class:`RuleRefused` or :class:`RuleCrashed`."""
        request = (rule, tuple(ids), list(operands), list(extra))
        key = repr(request)
        if key not in self._answers:
            self._answers[key] = self._call(request)
        kind, value = self._answers[key]
        if kind == "answer":
            return value
        if kind == "refused":
            raise RuleRefused(value)
        if kind == "crashed":
            raise RuleCrashed(rule, value)
        raise RuntimeError(f"Paddle's SPMD rule {rule} failed in the rule worker: {value}")

    def _call(self, request: tuple) -> tuple[str, Any]:
        if self._conn is None:
            self._start()
        assert self._conn is not None
        try:
            self._conn.send(request)
            if self._conn.poll(ANSWER_SECONDS):
                return self._conn.recv()
        except (EOFError, OSError):
            pass
        return "crashed", self._stop()

    def _start(self) -> None:
        context = multiprocessing.get_context("fork")
        self._conn, theirs = context.Pipe()
        self._child = context.Process(target=_serve, args=(theirs,), daemon=True, name="autodist-spmd-rules")
        self._child.start()
        theirs.close()  # so the child's death reads as the end of the pipe here

    def _stop(self) -> int | None:
        """End the child (dead or hung); its exit code, None when it had to be killed."""
        child, conn = self._child, self._conn
        self._child = self._conn = None
        if conn is not None:
            conn.close()
        child.join(5)
        if child.exitcode is None:
            child.kill()
            child.join()
            return None
        return child.exitcode


#: The planner's one rule worker (a child forked on the first call).
RULES = RuleWorker()
