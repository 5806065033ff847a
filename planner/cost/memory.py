"""Memory per rank: model states (parameters, gradients, optimizer states) under ZeRO.

Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models"
(SC 2020), section 3.1: mixed-precision Adam keeps 2 bytes of parameters, 2 of gradients and
K = 12 of optimizer states (fp32 master copy, momentum, variance) per parameter, 16 in all.
Stage 1 splits the optimizer states over the N_d data-parallel ranks, stage 2 the gradients
too, stage 3 the parameters too.

Activation memory lives with the per-block costs (:mod:`autodist.planner.cost.blocks`).

Example::

    >>> s = model_state_bytes(7.5e9, dp=64, stage=0, dtype="bf16", optimizer="adam")
    >>> round(s.total / 1e9, 1)
    120.0
"""

from __future__ import annotations

from dataclasses import dataclass

from autodist.schemas.vocabulary import TRAINING_DTYPES, training_bytes

#: Optimizer-state bytes per parameter (the paper's K). Mixed precision (bf16/fp16) keeps an
#: fp32 master copy (4) on top of the optimizer's own fp32 states; fp32 training needs no copy.
#: Adam-like: momentum + variance (8). SGD: no state of its own (plain SGD as Paddle's
#: ``paddle.optimizer.SGD``), so only the master copy under mixed precision.
_OPTIMIZER_STATE_BYTES = {"adam": 8, "sgd": 0}
_MASTER_COPY_BYTES = {"bf16": 4, "fp16": 4, "fp32": 0}


@dataclass(frozen=True)
class StateBytes:
    """Model-state bytes one rank holds."""

    params: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer


def check_training_setup(dtype: str, optimizer: str) -> None:
    """Raise ValueError naming the bad value when dtype or optimizer is unknown."""
    if dtype not in TRAINING_DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(TRAINING_DTYPES)}")
    if optimizer not in _OPTIMIZER_STATE_BYTES:
        raise ValueError(f"unknown optimizer {optimizer!r}; known: {', '.join(_OPTIMIZER_STATE_BYTES)}")


def optimizer_bytes_per_param(dtype: str, optimizer: str) -> int:
    """The paper's K: 12 for mixed-precision Adam, 8 for fp32 Adam, 4 / 0 for SGD."""
    check_training_setup(dtype, optimizer)
    return _OPTIMIZER_STATE_BYTES[optimizer] + _MASTER_COPY_BYTES[dtype]


def model_state_bytes(num_params: float, dp: int, stage: int, dtype: str, optimizer: str) -> StateBytes:
    """Bytes of parameters, gradients and optimizer states on one rank of a dp group.

    ``num_params`` is what the rank would hold without ZeRO (already divided by mp, for its
    pipeline stage). Stage ``s`` divides the first ``s`` of (optimizer, grads, params) by ``dp``.

    Example (the paper's Figure 1: Psi = 7.5B, N_d = 64)::

        >>> [round(model_state_bytes(7.5e9, 64, s, "fp16", "adam").total / 1e9, 1) for s in range(4)]
        [120.0, 31.4, 16.6, 1.9]
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"sharding stage must be 0..3, got {stage}")
    width = training_bytes(dtype)
    k = optimizer_bytes_per_param(dtype, optimizer)
    return StateBytes(
        params=num_params * width / (dp if stage >= 3 else 1),
        grads=num_params * width / (dp if stage >= 2 else 1),
        optimizer=num_params * k / (dp if stage >= 1 else 1),
    )
