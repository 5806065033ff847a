"""Fingerprints that tie a plan to one model, computable without Paddle and without tracing."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping


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


@dataclass(frozen=True)
class ParameterDiff:
    """How a model's parameters differ from a plan's, name by name (sorted lists).

    ``renamed`` pairs a vanished planned name with a new model name of the same shape and dtype
    when the pairing is unambiguous; those names are not repeated in ``removed`` or ``added``.
    ``resized`` and ``retyped`` hold ``(fqn, planned, model)`` for the names both sides have.
    """

    removed: list[str] = field(default_factory=list)
    added: list[str] = field(default_factory=list)
    renamed: list[tuple[str, str]] = field(default_factory=list)
    resized: list[tuple[str, list[int], list[int]]] = field(default_factory=list)
    retyped: list[tuple[str, str, str]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.removed or self.added or self.renamed or self.resized or self.retyped)


def parameter_diff(
    planned: Mapping[str, tuple[list[int], str]],
    actual: Mapping[str, tuple[list[int], str]],
    tied: Iterable[str] = (),
) -> ParameterDiff:
    """The one comparison of planned parameters with a model's (``apply_plan`` and
    ``autodist-plan check`` both report it). ``tied`` names are aliases of planned parameters,
    never "added".

    Example::

        >>> planned = {"norm.weight": ([8], "float32"), "fc.weight": ([8, 8], "float32")}
        >>> actual = {"final_norm.weight": ([8], "float32"), "fc.weight": ([8, 4], "float32")}
        >>> diff = parameter_diff(planned, actual)
        >>> diff.renamed, diff.resized, diff.removed, diff.added
        ([('norm.weight', 'final_norm.weight')], [('fc.weight', [8, 8], [8, 4])], [], [])
    """
    entry = {fqn: (list(shape), dtype) for fqn, (shape, dtype) in planned.items()}
    model = {fqn: (list(shape), dtype) for fqn, (shape, dtype) in actual.items()}
    missing = sorted(set(entry) - set(model))
    new = sorted(set(model) - set(entry) - set(tied))
    renamed = _pair_renames(missing, new, entry, model)
    paired_old, paired_new = {o for o, _ in renamed}, {n for _, n in renamed}
    both = sorted(set(entry) & set(model))
    return ParameterDiff(
        removed=[m for m in missing if m not in paired_old],
        added=[a for a in new if a not in paired_new],
        renamed=renamed,
        resized=[(f, entry[f][0], model[f][0]) for f in both if entry[f][0] != model[f][0]],
        retyped=[(f, entry[f][1], model[f][1]) for f in both if entry[f][1] != model[f][1]],
    )


def _pair_renames(missing: list[str], added: list[str], planned: dict, actual: dict) -> list[tuple[str, str]]:
    """Pair a vanished planned name with a new model name of the same shape and dtype when the
    pairing is unambiguous (exactly one candidate each way)."""
    pairs = []
    for old in missing:
        candidates = [new for new in added if actual[new] == planned[old]]
        if len(candidates) == 1:
            twins = [o for o in missing if planned[o] == actual[candidates[0]]]
            if len(twins) == 1:
                pairs.append((old, candidates[0]))
    return pairs
