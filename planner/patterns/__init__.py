"""The pattern library: small graphs of Paddle ops that the matcher looks for.

``parts`` holds the building blocks (:class:`Part`, :class:`PatternBuilder`, ``linear``),
``norm`` / ``attention`` / ``mlp`` the variants of each sub-layer, ``blocks`` their composition
into whole transformer blocks. See docs/internals.md for how the matcher uses them.
"""

from .attention import ATTENTIONS, Attention
from .blocks import Pattern, block_patterns, compute_histogram, mlp_pattern, part_pattern
from .mlp import FUSED_SWIGLU, GELU_MLP, MLPS, SWIGLU_OP, SWIGLU_SILU, Mlp
from .norm import LAYER_NORM, NORMS, RMS_NORM
from .parts import PARAM, PORT, Part, PatternBuilder, linear, residual

__all__ = [
    "ATTENTIONS", "Attention", "FUSED_SWIGLU", "GELU_MLP", "LAYER_NORM", "MLPS", "Mlp", "NORMS", "PARAM",
    "PORT", "Part", "Pattern", "PatternBuilder", "RMS_NORM", "SWIGLU_OP", "SWIGLU_SILU", "block_patterns",
    "compute_histogram", "linear", "mlp_pattern", "part_pattern", "residual",
]
