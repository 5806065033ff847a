"""Clipping by the global norm when ranks hold different parts of the model.

``paddle.nn.ClipGradByGlobalNorm`` scales every gradient by ``clip_norm / max(norm, clip_norm)``,
``norm`` the L2 norm of *all* the model's gradients. Within one mesh Paddle gets it right:
a DistTensor gradient's placements tell how its pieces add up. Two layouts of autodist break
that, because there a rank holds parameters no placement describes:

- expert parallelism: each rank of an ep group holds its own experts, marked Replicate
  (experts.py), so Paddle would count each rank's experts as all of them;
- a pipeline schedule (1F1B, VPP): each rank holds its stages' parameters only, and a weight
  tied across the first and last stage is held on both, each copy with the summed gradient
  (pipeline.py), so Paddle would count it twice.

There :class:`GlobalNormClip` takes the optimizer's clip over (the optimizer keeps none) and
clips before each update with the norm of the whole model:

- a DistTensor gradient's square sum, resharded to Replicate on its own mesh: the whole
  tensor's, a split (mp) gradient's pieces summed, a replicated one counted once;
- an *own* gradient (an expert's) is this rank's alone: summed over the ranks that each hold
  different ones (the ep group);
- a gradient another rank counts (the last stage's copy of a tied weight) is clipped, not counted;
- under a pipeline, the stage's square sum is summed over the ranks of this rank's pipeline
  (one per stage, the same dp/mp coordinate): an all-reduce, which gloo has.

Example (on one device nothing is taken over when the optimizer does not clip by global norm)::

    >>> import paddle
    >>> layer = paddle.nn.Linear(2, 2)
    >>> sgd = paddle.optimizer.SGD(parameters=layer.parameters())
    >>> clip_over_ranks(sgd, sgd) is sgd
    True
"""

from __future__ import annotations

import math
from typing import Any, Iterable

import paddle
import paddle.distributed as dist
from paddle.distributed.auto_parallel.api import dtensor_from_local

from autodist.applier.placement.optimizer import optimizer_parameters


def sum_over(x: paddle.Tensor, mesh: dist.ProcessMesh | None) -> paddle.Tensor:
    """The plain tensors ``x`` of ``mesh``'s ranks summed: an all-reduce (``x`` itself
    without a mesh or on one rank). Through ``dist.reshard`` on the mesh, which creates the
    mesh's communicator among its own ranks (docs/paddle-notes.md, "Expert parallelism")."""
    if mesh is None or len(mesh.process_ids) == 1:
        return x
    whole = dist.reshard(dtensor_from_local(x, mesh, [dist.Partial()]), mesh, [dist.Replicate()])
    return whole._local_value()


def clip_over_ranks(
    optimizer: Any,
    rebuilt: Any,
    own: Iterable[paddle.Tensor] = (),
    own_group: dist.ProcessMesh | None = None,
    not_counted: Iterable[paddle.Tensor] = (),
    pipeline: dist.ProcessMesh | None = None,
) -> Any:
    """``optimizer`` wrapped in a :class:`GlobalNormClip` when ``rebuilt`` (the plain optimizer
    inside it) clips by global norm; else ``optimizer`` itself."""
    if not isinstance(rebuilt._grad_clip, paddle.nn.ClipGradByGlobalNorm):
        return optimizer
    return GlobalNormClip(optimizer, rebuilt, own, own_group, not_counted, pipeline)


class GlobalNormClip:
    """Before each update, clips the gradients by the whole model's global norm (module
    docstring), in place of ``rebuilt``'s ``ClipGradByGlobalNorm``; anything else is the
    wrapped optimizer's.

    ``own``: parameters whose gradient is this rank's alone, summed over ``own_group``;
    ``not_counted``: parameters whose gradient another rank counts; ``pipeline``: the ranks of
    this rank's pipeline, whose stage sums add up to the model's."""

    def __init__(self, optimizer: Any, rebuilt: Any, own, own_group, not_counted, pipeline):
        self._inner = optimizer
        self.clip_norm = float(rebuilt._grad_clip.clip_norm)
        rebuilt._grad_clip = None
        self._clipped = [p for p in optimizer_parameters(rebuilt) if getattr(p, "need_clip", True)]
        self._own, self._own_group = {id(p) for p in own}, own_group
        self._not_counted, self._pipeline = {id(p) for p in not_counted}, pipeline

    def step(self) -> None:
        with paddle.no_grad():
            scale = self.clip_norm / max(self.global_norm(), self.clip_norm)
            for param in self._clipped:
                if param.grad is not None:
                    param.grad.scale_(scale)
        self._inner.step()

    def global_norm(self) -> float:
        """The L2 norm of the whole model's gradients (every rank of the pipeline gets the same)."""
        stage = 0.0
        own = paddle.zeros([], "float32")
        for param in self._clipped:
            grad = param.grad
            if grad is None or id(param) in self._not_counted:
                continue
            square = (grad.astype("float32") ** 2).sum()
            if id(param) in self._own:
                own = own + square._local_value()
            elif square.is_dist():
                whole = dist.reshard(square, square.process_mesh, [dist.Replicate() for _ in square.placements])
                stage += float(whole._local_value())
            else:
                stage += float(square)
        stage += float(sum_over(own, self._own_group))
        if self._pipeline is None:
            return math.sqrt(stage)
        return math.sqrt(float(sum_over(paddle.to_tensor([stage], "float64"), self._pipeline)))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)
