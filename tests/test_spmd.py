"""Placements checked against Paddle's SPMD rules along each block's dataflow."""

from __future__ import annotations

import pytest

from autodist.planner.recognise.analysis import analyze
from autodist.planner.recognise.reshards import block_reshards, implicit_comm, reshard_hooks
from models.traced import traced


def analysis_of(key: str):
    model, program, graph = traced(key)
    return analyze(program, graph, model)


@pytest.mark.parametrize("key", ["docstring", "llama"])
def test_llama_column_and_row_choices_need_no_implicit_communication(key):
    """q/k/v/gate/up column, o/down row: heads stay split through reshape, RoPE, GQA repetition
    and softmax; the only collectives are the row linears' own all-reduces."""
    a = analysis_of(key)
    assert implicit_comm(a, 2) == []
    reshards = [r for r in block_reshards(a, a.blocks[0], 2) if r.collective]
    assert [r.collective for r in reshards] == ["all_reduce", "all_reduce"]
    sources = {a.graph.nodes[r.before.partial_source]["layer"] for r in reshards}
    assert sources == {f"{a.blocks[0].layer}.self_attn.o_proj", f"{a.blocks[0].layer}.mlp.down_proj"}


def test_column_split_fused_qkv_and_gate_up_force_gathers_in_phi3():
    a = analysis_of("phi3")
    comms = implicit_comm(a, 2)
    first = [c for c in comms if c.layer.startswith("model.layers.0.")]
    # q, k and v are sliced out of the split q|k|v output; gate and up split out of gate|up
    assert [(c.layer, c.op, c.collective) for c in first] == [
        ("model.layers.0.self_attn", "slice", "all_gather")
    ] * 3 + [("model.layers.0.mlp", "split_with_num", "all_gather")]
    assert "qkv_proj" in first[0].reason and "gate_up_proj" in first[3].reason
    assert len(comms) == 2 * len(first)


def test_gpt_fused_qkv_gather_and_its_bytes():
    a = analysis_of("gpt")
    comms = implicit_comm(a, 2)
    assert [(c.layer, c.op, c.collective) for c in comms] == [
        ("blocks.0.attn", "reshape", "all_gather"),
        ("blocks.1.attn", "reshape", "all_gather"),
    ]
    # [2, 8, 96] float32 gathered over 2 ranks: half of it sent forward, the same back
    assert comms[0].bytes_per_step == 2 * (2 * 8 * 96 * 4) // 2
    assert implicit_comm(a, 2, dtype_bytes=2)[0].bytes_per_step == comms[0].bytes_per_step // 2


def test_the_rules_decide_where_the_gather_happens():
    """At mp=3 the reshape [.., 96] -> [.., 3, 4, 8] can keep the split (3 segments over 3
    ranks); Paddle's rules then gather at the unbind that separates q, k and v instead."""
    a = analysis_of("gpt")
    ops = [c.op for c in implicit_comm(a, 3) if c.layer.startswith("blocks.0.")]
    assert "reshape" not in ops and ops and all(op == "unbind" for op in ops[:1])


def test_reshard_hooks_gather_fused_outputs_and_remove_implicit_comm():
    a = analysis_of("phi3")
    hooks = reshard_hooks(a, 2, mesh_axes=("pp", "dp", "mp"))
    assert [(h.layer, h.when, h.action, h.placements) for h in hooks[:2]] == [
        ("model.layers.0.self_attn.qkv_proj", "post", "reshard", ["R", "S(0)", "R"]),
        ("model.layers.0.mlp.gate_up_proj", "post", "reshard", ["R", "S(0)", "R"]),
    ]
    assert len(hooks) == 4
    assert implicit_comm(a, 2, hooks=hooks) == []


def test_no_hooks_and_no_comm_without_fused_projections_or_mp():
    assert reshard_hooks(analysis_of("llama"), 2) == []
    phi3 = analysis_of("phi3")
    assert reshard_hooks(phi3, 1) == [] and implicit_comm(phi3, 1) == []
