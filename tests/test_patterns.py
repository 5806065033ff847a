"""The pattern library as data: composition, roles, and what tells variants apart."""

from __future__ import annotations

import pytest

from autodist.planner.recognise.patterns import (
    FUSED_SWIGLU, GELU_MLP, PARAM, SWIGLU_OP, SWIGLU_SILU, PatternBuilder, block_patterns, linear, mlp_pattern,
)


def linears(pattern) -> dict[str, dict]:
    return {d["linear"]: d for _, d in pattern.graph.nodes(data=True) if d["op"] == PARAM and "linear" in d}


def by_description(description: str):
    return next(p for p in block_patterns() if p.description == description)


def test_block_descriptions_are_unique():
    descriptions = [p.description for p in block_patterns()]
    assert len(descriptions) == len(set(descriptions))


def test_every_block_has_one_row_linear_per_sublayer_and_columns_before_it():
    for pattern in block_patterns():
        roles = {name: d["role"] for name, d in linears(pattern).items()}
        assert sorted(n for n, r in roles.items() if r == "row") in (["down", "o"], ["fc_out", "o"]), pattern.description
        assert all(r in ("column", "row") for r in roles.values())


def test_llama_block_is_composed_of_its_parts():
    pattern = by_description("rms_norm+attn(q|k|v,rope,mask)+mlp(swiglu_silu)")
    assert pattern.kind == "llama_decoder"
    roles = {name: d["role"] for name, d in linears(pattern).items()}
    assert roles == {"q": "column", "k": "column", "v": "column", "o": "row",
                     "gate": "column", "up": "column", "down": "row"}
    # two RoPE applications (q and k), one softmax, two norms with one weight each
    assert pattern.histogram["softmax"] == 1 and pattern.histogram["rsqrt"] == 2
    assert sum(1 for _, d in pattern.graph.nodes(data=True) if d.get("norm")) == 2


def test_fused_projections_record_their_segments():
    pattern = by_description("rms_norm+attn(qkv,rope)+mlp(fused_swiglu)")
    fused = {name: d["fused"] for name, d in linears(pattern).items()}
    assert fused == {"qkv": 3, "o": 1, "gate_up": 2, "down": 1}
    assert pattern.kind == "phi3_decoder"


def test_gelu_and_swiglu_mlps_differ_in_their_compute_ops():
    gelu = mlp_pattern(GELU_MLP).histogram
    for swiglu in (SWIGLU_OP, SWIGLU_SILU, FUSED_SWIGLU):
        assert mlp_pattern(swiglu).histogram != gelu


def test_builder_refuses_an_unbound_input():
    with pytest.raises(ValueError, match="unbound inputs"):
        PatternBuilder().add(linear("q", "column"), "attn.q")


def test_linear_pins_weight_to_the_matmul_y_operand():
    b = PatternBuilder()
    b.add(linear("fc", "column", bias=True), "fc", x=b.port("x"))
    assert b.graph.edges["fc.weight", "fc.matmul"]["operand"] == 1
    assert b.graph.edges["x", "fc.matmul"]["operand"] == 0
    assert b.graph.nodes["fc.bias"]["bias_of"] == "fc"
