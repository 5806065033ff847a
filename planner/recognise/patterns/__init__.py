"""The pattern library: small graphs of Paddle ops that the matcher looks for.

``parts`` holds the building blocks (:class:`Part`, :class:`PatternBuilder`, ``linear``),
``norm`` / ``attention`` / ``mlp`` the variants of each sub-layer, ``blocks`` their composition
into whole transformer blocks, ``layers`` the single layers around the blocks (embedding, norm,
linear). :mod:`autodist.planner.recognise.match` explains how they are matched.
"""

from autodist.planner.recognise.patterns.attention import ATTENTIONS, Attention
from autodist.planner.recognise.patterns.blocks import Pattern, block_patterns, compute_histogram, mlp_pattern, part_pattern
from autodist.planner.recognise.patterns.layers import EMBEDDING, LINEAR, LINEAR_BIAS, layer_patterns
from autodist.planner.recognise.patterns.mlp import FUSED_SWIGLU, GELU_MLP, MLPS, SWIGLU_OP, SWIGLU_SILU, Mlp
from autodist.planner.recognise.patterns.norm import LAYER_NORM, NORMS, RMS_NORM
from autodist.planner.recognise.patterns.parts import PARAM, PORT, Part, PatternBuilder, linear, residual

__all__ = [
    "ATTENTIONS", "Attention", "EMBEDDING", "FUSED_SWIGLU", "GELU_MLP", "LAYER_NORM", "LINEAR", "LINEAR_BIAS",
    "MLPS", "Mlp", "NORMS", "PARAM", "PORT", "Part", "Pattern", "PatternBuilder", "RMS_NORM", "SWIGLU_OP",
    "SWIGLU_SILU", "block_patterns", "compute_histogram", "layer_patterns", "linear", "mlp_pattern",
    "part_pattern", "residual",
]
