"""What the readable losses change in Paddle, and how it is undone.

Noting: the reductions a loss ends in (``paddle._C_ops`` ``mean``, ``mean_all``, ``sum``) and
the Tensor methods that keep a noted scalar noted (``loss / k``, ``loss.detach()``, ...) are
wrapped: a scalar with a ``Partial`` placement they return is noted (notes.py). Reading: the
Tensor methods that read a value (``float``, ``.item()``, ``.numpy()``, ``print``, ...) are
wrapped: a noted scalar's value is combined from its group's ranks (transport.py) instead of
Paddle's all-reduce, which a read on some ranks only would hang in. Nothing else changes.

:func:`patch` wraps them, :func:`unpatch` puts Paddle's own back (the very objects it found):

    >>> import paddle
    >>> own = paddle.Tensor.__float__
    >>> patch(); paddle.Tensor.__float__ is own
    False
    >>> unpatch(); paddle.Tensor.__float__ is own
    True
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable

import numpy as np
import paddle
import paddle.distributed as dist

from autodist.applier.placement.layout import rank_coords

from autodist.applier.ranks.readable.notes import KEEP, ReadError, current
from autodist.applier.ranks.readable.transport import fetch

#: The reductions a loss ends in, looked up in ``paddle._C_ops`` by Paddle at each call.
REDUCTIONS = ("mean", "mean_all", "sum")
#: Tensor methods that keep a noted scalar noted (``loss / k``, ``loss.detach()``, ...).
ARITHMETIC = (
    "__truediv__", "__rtruediv__", "__mul__", "__rmul__", "__add__", "__radd__", "__sub__", "__rsub__",
    "__neg__", "detach", "clone", "astype", "cast", "scale",
)  # fmt: skip
_COMBINE: dict[str, Callable[[list[np.ndarray]], np.ndarray]] = {
    "kRedSum": lambda parts: np.sum(parts, axis=0),
    "kRedAvg": lambda parts: np.mean(parts, axis=0),
    "kRedMax": lambda parts: np.max(parts, axis=0),
    "kRedMin": lambda parts: np.min(parts, axis=0),
}

#: What each patched attribute was before :func:`patch`: ``{(owner, name): Paddle's own}``, and
#: those the owner inherited (put back by deleting the wrapper).
_ORIGINALS: dict[tuple[Any, str], Any] = {}
_INHERITED: set[tuple[Any, str]] = set()


def patch() -> None:
    """Wrap Paddle's reads and the ops that make a loss (once: a second call changes nothing)."""
    if _ORIGINALS:
        return
    for name, convert in READS.items():
        _wrap(paddle.Tensor, name, partial(_reading, convert=convert))
    for name in ARITHMETIC:
        _wrap(paddle.Tensor, name, partial(_noting, op=name.strip("_")))
    for name in REDUCTIONS:
        _wrap(paddle._C_ops, name, partial(_noting, op=name))


def unpatch() -> None:
    """Put back every attribute :func:`patch` wrapped, as it was."""
    for (owner, name), original in _ORIGINALS.items():
        if (owner, name) in _INHERITED:
            delattr(owner, name)
        else:
            setattr(owner, name, original)
    _ORIGINALS.clear()
    _INHERITED.clear()


def patched() -> list[tuple[Any, str]]:
    """The ``(owner, name)`` pairs wrapped now (empty when unpatched)."""
    return list(_ORIGINALS)


def _wrap(owner: Any, name: str, wrapper: Callable[[Any], Any]) -> None:
    original = getattr(owner, name)
    _ORIGINALS[(owner, name)] = original
    if name not in vars(owner):
        _INHERITED.add((owner, name))
    setattr(owner, name, wrapper(original))


# -- noting ----------------------------------------------------------------------------------------


def _is_partial_scalar(value: Any) -> bool:
    return (
        isinstance(value, paddle.Tensor)
        and value.is_dist()
        and value._is_initialized()
        and int(np.prod(value.shape)) == 1
        and any(p.is_partial() for p in value.placements)
    )


def _noting(function: Callable, op: str) -> Callable:
    def noted(*args: Any, **kwargs: Any) -> Any:
        out = function(*args, **kwargs)
        notes = current()
        if notes is not None and _is_partial_scalar(out):
            notes.note(out, op)
        return out

    noted.__wrapped__ = function  # type: ignore[attr-defined]
    return noted


# -- reading ---------------------------------------------------------------------------------------


def value(tensor: paddle.Tensor) -> np.ndarray:
    """A tensor's value on this rank: combined when it is a noted scalar, this rank's local
    value of a DistTensor otherwise (a replicated one), or the dense tensor's."""
    combined = _global_value(tensor)
    if combined is not None:
        return combined
    return (tensor._local_value() if tensor.is_dist() else tensor).numpy()


def _global_value(tensor: paddle.Tensor) -> np.ndarray | None:
    """The value of a noted scalar, combined from its group's ranks; None if not noted."""
    key = getattr(tensor, "_autodist_read_key", None)
    notes = current()
    if key is None or notes is None:
        return None
    cached = getattr(tensor, "_autodist_read_value", None)
    if cached is not None:
        return cached
    notes.counts["reads"] += 1
    entry = notes.values.get(key)
    if entry is None:
        raise ReadError(f"rank {notes.rank} no longer keeps value {key} (more than {KEEP} values ago)")
    placements = tensor.placements
    partial = [d for d, p in enumerate(placements) if p.is_partial()]
    kinds = {placements[d].reduce_type().name for d in partial}
    if len(kinds) != 1 or next(iter(kinds)) not in _COMBINE:
        raise ReadError(f"cannot combine a loss partial over several reductions {sorted(kinds)}")
    parts = [
        np.asarray(entry["read"]()) if peer == notes.rank else fetch(notes, peer, key, entry["op"])
        for peer in _group(tensor.process_mesh, partial, notes.rank)
    ]
    combined = _COMBINE[next(iter(kinds))](parts).astype(parts[0].dtype).reshape(tensor.shape)
    tensor._autodist_read_value = combined
    return combined


def _group(mesh: dist.ProcessMesh, dims: list[int], rank: int) -> list[int]:
    """The ranks of ``mesh`` that share ``rank``'s coordinates on every dim but ``dims``.

    >>> _group(dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"]), [0], rank=3)
    [1, 3]
    """
    ids = np.array(mesh.process_ids).reshape(mesh.shape)
    where = rank_coords(ids, rank)
    assert where is not None  # a noted value's mesh holds the rank that made it
    index = tuple(slice(None) if d in dims else where[d] for d in range(ids.ndim))
    return [int(r) for r in np.ravel(ids[index])]


def _reading(original: Callable, convert: Callable[[np.ndarray, tuple, dict], Any]) -> Callable:
    def read(self: paddle.Tensor, *args: Any, **kwargs: Any) -> Any:
        combined = _global_value(self)
        return original(self, *args, **kwargs) if combined is None else convert(combined, args, kwargs)

    read.__wrapped__ = original  # type: ignore[attr-defined]
    return read


def _as_string(combined: np.ndarray, args: tuple, kwargs: dict) -> str:
    from paddle.tensor.to_string import tensor_to_string

    return tensor_to_string(paddle.to_tensor(combined))


#: The Tensor methods that read a value, and how each reads a combined one.
READS: dict[str, Callable[[np.ndarray, tuple, dict], Any]] = {
    "numpy": lambda v, a, k: v.copy(),
    "__array__": lambda v, a, k: v.astype(a[0]) if a and a[0] is not None else v.copy(),
    "item": lambda v, a, k: v.reshape(-1)[a[0] if a else 0].item(),
    "tolist": lambda v, a, k: v.tolist(),
    "__float__": lambda v, a, k: float(v.reshape(-1)[0]),
    "__int__": lambda v, a, k: int(v.reshape(-1)[0]),
    "__bool__": lambda v, a, k: bool(v.reshape(-1)[0]),
    "__format__": lambda v, a, k: v.reshape(-1)[0].item().__format__(*a) if not v.shape else object.__format__(v, *a),
    "__str__": _as_string,
    "__repr__": _as_string,
}
