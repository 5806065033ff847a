"""What ``autodist-plan ckpt info PATH`` prints: what a checkpoint holds and the plan it was
saved under, from its metadata alone (no Paddle, no shard data read).

Whether the metadata is signed is shown, not checked: checking needs the saving job's secret,
which ``load_checkpoint`` holds and this command does not (docs/checkpoints.md, "Integrity").

Checkpoint metadata is untrusted input: every string taken from it (class names, FQNs, state
kinds, scheduler fields) goes through :func:`~autodist.schemas.errors.printable`, so no control
character reaches the terminal.

Example::

    >>> meta = read_checkpoint("ckpt")                  # doctest: +SKIP
    >>> print(checkpoint_text(meta, "ckpt"))            # doctest: +SKIP
    checkpoint  ckpt (format 1)
    step        2
    ...
"""

from __future__ import annotations

import math
from typing import Any

import msgspec

from autodist.planner.review.format import collapse, human_bytes, human_count
from autodist.schemas.describe import strategy_text
from autodist.schemas.checkpoint import Checkpoint, SavedScheduler, SavedTensor
from autodist.schemas.errors import printable
from autodist.schemas.vocabulary import DTYPE_BYTES


def checkpoint_data(meta: Checkpoint) -> dict[str, Any]:
    """The summary as plain data (``--json``); strings as the metadata has them (JSON escapes)."""
    return {
        "step": meta.step,
        "world_size": meta.world_size,
        "model": {
            "class_name": meta.model.class_name,
            "parameters": len(meta.params),
            "values": meta.model.num_parameters,
            "param_fingerprint": meta.model.param_fingerprint,
        },
        "plan": None if meta.plan is None else {
            "fingerprint": meta.plan.fingerprint,
            "mesh": {"axes": meta.plan.mesh.axes, "shape": meta.plan.mesh.shape},
            "strategy": {f: getattr(meta.plan.strategy, f) for f in meta.plan.strategy.__struct_fields__},
        },
        "optimizer": None if meta.optimizer is None else {
            "class_name": meta.optimizer.class_name,
            "parameters_with_state": len(meta.optimizer.states),
            "state_kinds": _state_kinds(meta),
        },
        "scheduler": None if meta.scheduler is None else msgspec.to_builtins(meta.scheduler),
        "signature": None if meta.signature is None else {"key_id": meta.signature.key_id},
        "data": {"folder": meta.data, "bytes": sum(meta.files.values()), "files": dict(sorted(meta.files.items()))},
        "params": {fqn: _tensor_data(t) for fqn, t in sorted(meta.params.items())},
    }  # fmt: skip


def checkpoint_text(meta: Checkpoint, path: str) -> str:
    """The summary for a terminal: one line per fact, then the parameters collapsed into
    patterns (``layers.*.mlp.up_proj.weight``) with shape, dtype and number of shards."""
    lines = [
        f"checkpoint  {printable(path)} (format {meta.version})",
        f"step        {meta.step}",
        f"model       {printable(meta.model.class_name)}, {len(meta.params)} parameters "
        f"({human_count(meta.model.num_parameters)} values), fingerprint {meta.model.param_fingerprint[:12]}",
        f"saved by    {meta.world_size} rank{'s' if meta.world_size != 1 else ''}",
    ]
    if meta.plan is None:
        lines.append("plan        none (one device, or a model apply_plan did not distribute)")
    else:
        mesh = f"{' × '.join(meta.plan.mesh.axes)} = {' × '.join(map(str, meta.plan.mesh.shape))}"
        lines.append(f"plan        {meta.plan.fingerprint[:12]}: mesh {mesh}; {strategy_text(meta.plan.strategy)}")
    if meta.optimizer is None:
        lines.append("optimizer   none saved")
    else:
        kinds = ", ".join(printable(k) for k in _state_kinds(meta)) or "no states yet"
        lines.append(
            f"optimizer   {printable(meta.optimizer.class_name)}, states of {len(meta.optimizer.states)} "
            f"parameters: {kinds}"
        )
    if meta.scheduler is not None:
        lines.append(f"scheduler   {_scheduler_text(meta.scheduler)}")
    files = len(meta.files)
    lines.append(
        f"data        {printable(meta.data)}: {files} file{'s' if files != 1 else ''}, {human_bytes(sum(meta.files.values()))}"
    )
    lines.append(f"signed      {_signature_text(meta)}")
    lines.append("parameters")
    rows = collapse({fqn: _tensor_text(t) for fqn, t in meta.params.items()})
    width = max((len(printable(r.pattern)) for r in rows), default=0)
    lines += [f"  {printable(r.pattern):<{width}}  {r.value}" for r in rows]
    return "\n".join(lines) + "\n"


def _signature_text(meta: Checkpoint) -> str:
    if meta.signature is None:
        return "no (saved by a job without a secret, or before format 5): checksums only"
    return (
        f"yes, key id {meta.signature.key_id} (not checked here, which needs the job's secret: "
        f"load_checkpoint checks it)"
    )


def _scheduler_text(saved: SavedScheduler) -> str:
    """``LinearWarmup (last_epoch=5, last_lr=0.1, LinearWarmup_LR=CosineAnnealingDecay (...))``."""
    state = [f"{printable(k)}={printable(str(v))}" for k, v in sorted(saved.state.items())]
    state += [f"{printable(k)}={_scheduler_text(inner)}" for k, inner in sorted(saved.nested.items())]
    return f"{printable(saved.class_name)} ({', '.join(state)})"


def _state_kinds(meta: Checkpoint) -> list[str]:
    if meta.optimizer is None:
        return []
    return sorted({kind for kinds in meta.optimizer.states.values() for kind in kinds})


def _tensor_data(tensor: SavedTensor) -> dict[str, Any]:
    return {"shape": tensor.shape, "dtype": tensor.dtype, "shards": len(tensor.shards)}


def _tensor_text(tensor: SavedTensor) -> str:
    shards = len(tensor.shards)
    size = human_bytes(math.prod(tensor.shape) * DTYPE_BYTES[tensor.dtype])
    return f"{list(tensor.shape)} {tensor.dtype}, {size}, {shards} shard{'s' if shards != 1 else ''}"
