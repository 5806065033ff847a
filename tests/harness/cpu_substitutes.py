"""TEST-ONLY stand-ins for collectives Paddle 3.3.1's CPU wheel does not have.

Two of them: :func:`everywhere` (reshards through Replicate) and :func:`blocking_p2p` (the
pipeline schedules' batched P2P as blocking send/recv).

On CPU (gloo), ``dist.reshard`` from Partial to Shard needs ``reduce_scatter`` and from
Shard(i) to Shard(j) needs ``all_to_all``; both kernels throw ``Unimplemented``
(docs/paddle-notes.md, "Collectives on the CPU wheel"). :func:`reshard_via_replicate` takes a detour through Replicate instead:
P -> R (all-reduce) -> S (local slice), S(i) -> R (all-gather) -> S(j). The values, and the
gradients flowing back, are the same; only the communication differs (more bytes). That makes
sequence parallelism and ZeRO stage 1 *numerically* testable on CPU, and says nothing about
their communication cost, which needs a GPU run.

It is used only by the test harness, and only for runs that ask for it
(``TrainRun(reshard="via_replicate")``); autodist itself always calls ``dist.reshard``.

Example::

    >>> with everywhere() as reshard_fn:                                        # doctest: +SKIP
    ...     apply_plan(model, opt, loader, plan, reshard_fn=reshard_fn,
    ...                stand_ins=["reduce_scatter", "all_to_all"])  # else refused on gloo
    ...     train(...)
"""

from __future__ import annotations

from contextlib import contextmanager

import paddle
import paddle.distributed as dist
import paddle.distributed.auto_parallel.api as auto_parallel_api
from paddle.autograd import PyLayer

_paddle_reshard = dist.reshard

#: The collectives this process's detours stood in for, in order: ``(pass, collective)`` with
#: pass ``"forward"`` or ``"backward"`` (a gradient's detour) and collective ``"reduce_scatter"``
#: (a P->S) or ``"all_to_all"`` (an S(i)->S(j)). TEST-ONLY: a test reads it to see which
#: reshards a run asks for, which a GPU would run as those collectives.
STOOD_IN: list[tuple[str, str]] = []


def _needs_detour(src, dst) -> bool:
    if dst.is_shard() and src.is_partial():
        return True
    return dst.is_shard() and src.is_shard() and src.get_dim() != dst.get_dim()


def reshard_via_replicate(tensor, mesh, placements):
    """``dist.reshard(tensor, mesh, placements)`` with every P->S and S(i)->S(j) on a mesh
    axis done as a detour through Replicate, forward and backward (TEST-ONLY, see the module
    docstring). The backward matters: Paddle's own backward of a reshard runs in C++
    (``ReshardGradNode``), so a Partial gradient reaching a forward S->R (sequence parallelism's
    gather before a column-parallel projection, whose input gradient is Partial over mp) would
    call the missing reduce_scatter there; :class:`_ReshardViaReplicate` takes its gradient back
    through the detour in Python instead."""
    differentiable = tensor.is_dist() and not tensor.stop_gradient and paddle.is_grad_enabled()
    if differentiable and tensor.process_mesh == mesh and list(tensor.placements) != list(placements):
        return _ReshardViaReplicate.apply(tensor, mesh, list(placements))
    return _detour(tensor, mesh, placements, "forward")


def _detour(tensor, mesh, placements, direction: str):
    if tensor.is_dist() and tensor.process_mesh == mesh:
        via = [dist.Replicate() if _needs_detour(s, d) else s for s, d in zip(tensor.placements, placements)]
        if via != list(tensor.placements):
            STOOD_IN.extend(
                (direction, "reduce_scatter" if s.is_partial() else "all_to_all")
                for s, d in zip(tensor.placements, placements)
                if _needs_detour(s, d)
            )
            tensor = _paddle_reshard(tensor, mesh, via)
    return _paddle_reshard(tensor, mesh, placements)


class _ReshardViaReplicate(PyLayer):
    """The detour as one differentiable step: its backward reshards the gradient to the input's
    placements through the same detour (a Partial input's gradient is the output's, replicated:
    every summand's derivative is the whole gradient). TEST-ONLY."""

    @staticmethod
    def forward(ctx, tensor, mesh, placements):
        ctx.mesh = mesh
        ctx.placements = [dist.Replicate() if p.is_partial() else p for p in tensor.placements]
        return _detour(tensor, mesh, placements, "forward")

    @staticmethod
    def backward(ctx, grad):
        return _detour(grad, ctx.mesh, ctx.placements, "backward")


@contextmanager
def everywhere():
    """While active, every Python-level ``dist.reshard`` call of this process takes the detour,
    including the ones inside ``dist.shard_optimizer`` (ZeRO stages move gradients and states
    with them). TEST-ONLY; the harness wraps one run (apply and train) in it."""
    dist.reshard = auto_parallel_api.reshard = reshard_via_replicate
    try:
        yield reshard_via_replicate
    finally:
        dist.reshard = auto_parallel_api.reshard = _paddle_reshard


def blocking_isend_irecv(ops):
    """``dist.batch_isend_irecv(ops)`` as blocking ``send``/``recv`` calls (TEST-ONLY).

    gloo times out on Paddle's batched P2P when both directions are in flight
    (docs/paddle-notes.md, "Collectives on the CPU wheel"). Here each op of the batch runs to
    completion in turn, the lower rank of a pair sending first, so two ranks never wait on
    each other's receive. The values are the same; only the overlap of sends and receives is
    lost."""
    me = dist.get_rank()

    def sends_first(op):
        return (op.op in (dist.isend, dist.send)) == (me < op.peer)

    for op in sorted(ops, key=lambda op: not sends_first(op)):
        if op.op in (dist.isend, dist.send):
            dist.send(op.tensor, op.peer, op.group, sync_op=True)
        else:
            dist.recv(op.tensor, op.peer, op.group, sync_op=True)
    return [_Done()]


class _Done:
    def wait(self):
        return True


@contextmanager
def blocking_p2p():
    """While active, Paddle's pipelining schedules exchange activations and gradients through
    :func:`blocking_isend_irecv` (TEST-ONLY; the harness wraps one pipeline run in it)."""
    saved = dist.batch_isend_irecv
    dist.batch_isend_irecv = blocking_isend_irecv
    try:
        yield
    finally:
        dist.batch_isend_irecv = saved
