"""``paddle.save`` of a distributed model's state: exact where one rank holds it, else refused.

A habit of single-device scripts is ``paddle.save(model.state_dict(), "model.pdparams")``, often on
rank 0 only. Under a plan the state dict holds distributed tensors, which Paddle 3.3.1 cannot
save: it fails deep inside with ``'DistTensor' object has no attribute '_is_initialized'``, or,
for an optimizer's state, after it has created the file (docs/paddle-notes.md).

:func:`guard_saves` makes ``paddle.save`` (under any of its three names) do one of two things
before it touches the path:

- a distributed tensor every rank holds whole (replicated on every mesh axis, as under plain data
  parallelism) is saved as its local value, which is the whole tensor: the file is one device's;
- anything else holding a distributed tensor (a piece of a split tensor, a pending sum) is refused
  with one ``ValueError`` naming the first such tensor and the rewrite: ``autodist.save_checkpoint``
  on every rank, then ``autodist.export_checkpoint`` for one full ``paddle.save`` file. Gathering
  instead would need every rank, and a save on rank 0 alone would hang the others.

Where the ranks hold parameters no placement describes (each rank's own experts, a pipeline
stage's parameters: ``held_apart``), a state dict saved by one rank misses the others' plain
tensors too, so every save holding a tensor is refused, naming what the rank holds.

    >>> import os, tempfile
    >>> guard_saves(held_apart=None)
    >>> path = os.path.join(tempfile.mkdtemp(), "w.pdparams")
    >>> paddle.save({"w": paddle.ones([2])}, path); os.path.exists(path)  # plain tensors as before
    True
    >>> restore()
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import paddle
import paddle.framework
import paddle.framework.io

#: Where scripts find Paddle's ``save`` (the same function under three names).
_HOMES = (paddle, paddle.framework, paddle.framework.io)
#: Paddle's own ``save``.
_PADDLE_SAVE = paddle.framework.io.save
#: What one rank holds apart from the others (experts, a stage), while a plan says so; or None.
_held_apart: str | None = None
#: The rewrite every refusal names.
_REWRITE = (
    "call autodist.save_checkpoint(model, optimizer, directory) on every rank instead, and "
    "autodist.export_checkpoint(directory, 'model.pdparams') for one full paddle.save file"
)


def guard_saves(held_apart: str | None) -> None:
    """Make ``paddle.save`` save replicated distributed tensors whole and refuse the rest (module
    docstring); ``held_apart`` says what each rank holds on its own, if anything, and refuses
    every save of a tensor. Calling again replaces ``held_apart``; :func:`restore` undoes it."""
    global _held_apart
    _held_apart = held_apart
    for home in _HOMES:
        home.save = _save


def restore() -> None:
    """Paddle's own ``save`` back (``autodist.close``).

    >>> guard_saves(None); restore(); paddle.save is _PADDLE_SAVE
    True
    """
    global _held_apart
    _held_apart = None
    for home in _HOMES:
        home.save = _PADDLE_SAVE


def _save(obj, path, protocol=4, **configs):
    if _held_apart is not None and _first(obj, "", lambda t: True) is not None:
        raise ValueError(
            f"paddle.save under this plan: this rank holds {_held_apart}, so no rank's tensors are "
            f"the model's; {_REWRITE}"
        )
    where = _first(obj, "", lambda t: t.is_dist() and not all(p.is_replicated() for p in t.placements))
    if where is not None:
        raise ValueError(
            f"paddle.save: {where or 'the tensor'} is split (or a pending sum) by autodist's plan, so no rank "
            f"holds it whole; {_REWRITE}"
        )
    return _PADDLE_SAVE(_whole(obj), path, protocol, **configs)


def _first(obj: Any, key: str, wanted: Callable[[paddle.Tensor], bool]) -> str | None:
    """The key path of the first tensor in ``obj`` that is ``wanted`` (dicts, lists and tuples
    looked into), or None.

    >>> _first({"a": [paddle.ones([1])]}, "", lambda t: t.is_dist()) is None
    True
    >>> _first({"a": [paddle.ones([1])]}, "", lambda t: True)
    "'a'[0]"
    """
    if isinstance(obj, paddle.Tensor):
        return key if wanted(obj) else None
    for name, value in _items(obj):
        found = _first(value, f"{key}[{name!r}]" if key else repr(name), wanted)
        if found is not None:
            return found
    return None


def _whole(obj: Any) -> Any:
    """``obj`` with each replicated distributed tensor replaced by its local value, the whole
    tensor (the containers copied, the user's left as they are)."""
    if isinstance(obj, paddle.Tensor):
        return obj._local_value() if obj.is_dist() else obj
    if isinstance(obj, dict):
        return type(obj)((name, _whole(value)) for name, value in obj.items())
    if isinstance(obj, (list, tuple)):
        values = [_whole(value) for value in obj]
        return type(obj)(*values) if hasattr(obj, "_fields") else type(obj)(values)  # a namedtuple too
    return obj


def _items(obj: Any):
    if isinstance(obj, dict):
        return obj.items()
    if isinstance(obj, (list, tuple)):
        return enumerate(obj)
    return ()
