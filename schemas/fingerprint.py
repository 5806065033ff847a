"""Fingerprints that tie a plan to one model, computable without Paddle and without tracing."""

from __future__ import annotations

import hashlib
from typing import Any, Iterable


def dtype_name(dtype: Any) -> str:
    """Paddle's dtype as the plan writes it: ``paddle.float32`` -> ``"float32"``."""
    return str(dtype).removeprefix("paddle.")


def parameter_table(named_parameters: Iterable[tuple[str, Any]]) -> dict[str, tuple[list[int], str]]:
    """``{fqn: (shape, dtype)}`` from ``model.named_parameters()`` (anything with shape/dtype).

    Example::

        >>> import types
        >>> p = types.SimpleNamespace(shape=[4, 8], dtype="paddle.float32")
        >>> parameter_table([("fc.weight", p)])
        {'fc.weight': ([4, 8], 'float32')}
    """
    return {fqn: ([int(d) for d in p.shape], dtype_name(p.dtype)) for fqn, p in named_parameters}


def parameter_fingerprint(table: dict[str, tuple[list[int], str]]) -> str:
    """sha256 over the sorted (FQN, shape, dtype) triples: renames, resizes, added or removed
    parameters all change it, parameter values and definition order do not."""
    digest = hashlib.sha256()
    for fqn in sorted(table):
        shape, dtype = table[fqn]
        digest.update(f"{fqn}|{'x'.join(map(str, shape))}|{dtype}\n".encode())
    return digest.hexdigest()
