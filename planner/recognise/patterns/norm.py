"""Normalisation parts: RMSNorm written out in elementwise ops, LayerNorm as Paddle's one op."""

from __future__ import annotations

from autodist.planner.recognise.patterns.parts import PARAM, Part

_NORM_WEIGHT = {"op": PARAM, "norm": True}

#: ``x * rsqrt(mean(x^2) + eps) * w`` (the ``+ eps`` is a constant add the view contracts).
RMS_NORM = Part(
    "rms_norm",
    nodes={
        "pow": "pow",
        "mean": "mean",
        "rsqrt": "rsqrt",
        "normed": "multiply",
        "out": "multiply",
        "weight": _NORM_WEIGHT,
    },
    edges=(
        ("x", "pow"),
        ("pow", "mean"),
        ("mean", "rsqrt"),
        ("rsqrt", "normed"),
        ("x", "normed"),
        ("normed", "out"),
        ("weight", "out"),
    ),
    inputs=("x",),
    output="out",
)

#: ``pd_op.layer_norm(x, weight, bias)``.
LAYER_NORM = Part(
    "layer_norm",
    nodes={"out": "layer_norm", "weight": _NORM_WEIGHT, "bias": _NORM_WEIGHT},
    edges=(("x", "out"), ("weight", "out"), ("bias", "out")),
    inputs=("x",),
    output="out",
)

#: ``pd_op.layer_norm(x, weight)``: a LayerNorm without bias (``nn.LayerNorm(d, bias_attr=False)``,
#: HF DBRX's ``norm_f``, OLMo's), the same layer with one parameter fewer.
LAYER_NORM_NO_BIAS = Part(
    "layer_norm",
    nodes={"out": "layer_norm", "weight": _NORM_WEIGHT},
    edges=(("x", "out"), ("weight", "out")),
    inputs=("x",),
    output="out",
)

NORMS = (RMS_NORM, LAYER_NORM, LAYER_NORM_NO_BIAS)
