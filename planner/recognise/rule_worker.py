"""Paddle's SPMD rules asked in a child process: a rule that crashes refuses its op, and the
planner goes on.

Paddle 3.3.1's SPMD rules are C++, and some of them kill the process on arguments they do not
expect: no Python exception, a SIGSEGV (``flatten`` on a size the trace knows only at run time,
``matmul`` on a missing operand: docs/paddle-notes.md, "SPMD rules"). The planner asks them through
:data:`RULES`, one child forked from the planner (:mod:`autodist.planner.contained`) that answers
calls over a pipe. When the child dies in a call (or gives no answer in :data:`ANSWER_SECONDS`),
that call raises :class:`RuleCrashed` naming the rule and the signal, and the next call forks a
new child. Each answer is kept by its arguments: a call asked again does not cross the pipe, and a
crash is met once per process.

Example::

    >>> answer = RULES.infer("matmul", (0, 1), [([8, 6], [-1, -1], False), ([6, 4], [-1, 0], False)], [False, False])
    >>> answer.outputs
    [((-1, 0), False)]
    >>> answer.inputs[1]
    ((-1, 0), False)
"""

from __future__ import annotations

from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Sequence, Union

from autodist.planner.contained import Crashed, end, fork

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


class RuleCrashed(Crashed):
    """The process asking the rule died (or hung).

    >>> str(RuleCrashed("flatten", -11))
    "Paddle's SPMD rule flatten crashed (SIGSEGV)"
    """

    def __init__(self, rule: str, exit_code: int | None):
        super().__init__(f"Paddle's SPMD rule {rule}", exit_code)


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
    """The child: answer ``(rule, process ids, operands, extra)`` requests until the pipe closes."""
    import paddle.distributed as dist

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

    def close(self) -> None:
        """End the child (the next call forks another): the driver does after each plan, so no
        child outlives planning in a user's process, holding what it inherited."""
        if self._conn is not None:
            end(self._child, self._conn)
            self._child = self._conn = None

    def _call(self, request: tuple) -> tuple[str, Any]:
        if self._conn is None:
            self._child, self._conn = fork(_serve, "autodist-spmd-rules")
        try:
            self._conn.send(request)
            if self._conn.poll(ANSWER_SECONDS):
                return self._conn.recv()
        except (EOFError, OSError):
            pass
        exit_code = end(self._child, self._conn)  # dead or hung: the next call forks a new one
        self._child = self._conn = None
        return "crashed", exit_code


#: The planner's one rule worker (a child forked on the first call).
RULES = RuleWorker()
