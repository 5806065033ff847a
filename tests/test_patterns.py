"""The layer pattern library as data."""

from __future__ import annotations

import pytest

from autodist.planner.recognise.patterns import PatternBuilder, layer_patterns, linear


def test_layer_patterns_have_distinct_op_histograms_or_kinds():
    kinds = sorted(p.kind for p in layer_patterns())
    # a LayerNorm with and without bias, a linear with and without: one kind each, its parameters apart
    assert kinds == [
        "embedding",
        "embedding_constant_ids",
        "layer_norm",
        "layer_norm",
        "linear_proj",
        "linear_proj",
        "rms_norm",
    ]


def test_builder_refuses_an_unbound_input():
    with pytest.raises(ValueError, match="unbound inputs"):
        PatternBuilder().add(linear("q", "column"), "attn.q")


def test_linear_pins_weight_to_the_matmul_y_operand():
    b = PatternBuilder()
    b.add(linear("fc", "column", bias=True), "fc", x=b.port("x"))
    assert b.graph.edges["fc.weight", "fc.matmul"]["operand"] == 1
    assert b.graph.edges["x", "fc.matmul"]["operand"] == 0
    assert b.graph.nodes["fc.bias"]["bias_of"] == "fc"
