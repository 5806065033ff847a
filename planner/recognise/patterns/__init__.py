"""The pattern library for single layers outside the repeated blocks: small graphs of Paddle
ops (embedding, norm, linear) matched by subgraph isomorphism (:mod:`..match`).

Blocks need no library: their sub-layers are found from dataflow and checked by Paddle's SPMD
rules (:mod:`autodist.planner.recognise.roles`). ``parts`` holds the building blocks
(:class:`Part`, :class:`PatternBuilder`, ``linear``), ``norm`` the norms, ``layers`` the layer
patterns.
"""

from autodist.planner.recognise.patterns.layers import EMBEDDING, LINEAR, LINEAR_BIAS, layer_patterns
from autodist.planner.recognise.patterns.norm import LAYER_NORM, NORMS, RMS_NORM
from autodist.planner.recognise.patterns.parts import PARAM, PORT, Part, PatternBuilder, linear
from autodist.planner.recognise.patterns.pattern import Pattern, compute_histogram, part_pattern

__all__ = [
    "EMBEDDING",
    "LAYER_NORM",
    "LINEAR",
    "LINEAR_BIAS",
    "NORMS",
    "PARAM",
    "PORT",
    "Part",
    "Pattern",
    "PatternBuilder",
    "RMS_NORM",
    "compute_histogram",
    "layer_patterns",
    "linear",
    "part_pattern",
]
