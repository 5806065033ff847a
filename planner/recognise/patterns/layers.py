"""Patterns for single layers outside the repeated blocks: token/position embeddings, a final
norm, a linear (the LM head when its output is vocabulary-sized).

Example::

    >>> sorted(p.kind for p in layer_patterns())
    ['embedding', 'embedding_constant_ids', 'layer_norm', 'layer_norm', 'linear_proj', 'linear_proj', 'rms_norm']
"""

from __future__ import annotations

import functools

from autodist.planner.recognise.patterns.pattern import Pattern, part_pattern
from autodist.planner.recognise.patterns.norm import LAYER_NORM, LAYER_NORM_NO_BIAS, RMS_NORM
from autodist.planner.recognise.patterns.parts import PARAM, Part, linear

#: ``embedding(ids, weight)``: a table lookup.
EMBEDDING = Part(
    "embedding",
    nodes={"lookup": "embedding", "weight": {"op": PARAM, "embedding": True}},
    edges=(("ids", "lookup", 0), ("weight", "lookup", 1)),
    inputs=("ids",),
    output="lookup",
)

#: The same with indices fixed at trace time (positions from ``arange``), which fold away.
EMBEDDING_CONSTANT_IDS = Part(
    "embedding_constant_ids",
    nodes={"lookup": "embedding", "weight": {"op": PARAM, "embedding": True}},
    edges=(("weight", "lookup", 1),),
    inputs=(),
    output="lookup",
)

#: A projection that is not part of a block; the analysis decides its role (LM head or none).
LINEAR = linear("proj", "column")
LINEAR_BIAS = linear("proj", "column", bias=True)


@functools.lru_cache(maxsize=1)
def layer_patterns() -> tuple[Pattern, ...]:
    return tuple(
        part_pattern(p)
        for p in (EMBEDDING, EMBEDDING_CONSTANT_IDS, RMS_NORM, LAYER_NORM, LAYER_NORM_NO_BIAS, LINEAR, LINEAR_BIAS)
    )
