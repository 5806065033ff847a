"""Blocks of real traced models split into sub-layers by dataflow, and recognition work
independent of depth."""

from __future__ import annotations

import pytest

from autodist import schemas
from autodist.planner.recognise.match import Matcher, block_nodes, compute_view
from autodist.planner.recognise.patterns import LINEAR, part_pattern
from autodist.planner.recognise.patterns.norm import RMS_NORM
from autodist.planner.recognise.roles import BlockRecogniser
from models.traced import traced

BLOCK_LISTS = {
    "docstring": "layers",
    "llama": "model.layers",
    "phi3": "model.layers",
    "gpt": "blocks",
    "gpt_sdpa": "blocks",
    "gemma3": "model.layers",
}


def recognise(name: str, layers: int = 2, recogniser: BlockRecogniser | None = None):
    recogniser = recogniser or BlockRecogniser()
    model, _, graph = traced(f"{name}@{layers}")
    params = schemas.parameter_table(model.named_parameters())
    return recogniser.recognise(graph, [f"{BLOCK_LISTS[name]}.{i}" for i in range(layers)], params)


@pytest.mark.parametrize(
    "name, description",
    [
        ("docstring", "attention(q|k|v)+mlp(gate|up)"),
        ("llama", "attention(q|k|v)+mlp(gate|up)"),
        ("phi3", "attention(qkv)+mlp(gate_up)"),
        ("gpt", "attention(qkv)+mlp(fc_in)"),
        # Paddle's SDPA traces to the same math on CPU; its causal mask is built from the scores' shape
        ("gpt_sdpa", "attention(qkv)+mlp(fc_in)"),
        ("gemma3", "attention(qkv)+mlp(gate_up)"),
    ],
)
def test_every_block_of_a_real_model_splits_into_its_sub_layers(name, description):
    blocks = recognise(name)
    assert ["+".join(s.description for s in b.roles.sublayers) for b in blocks] == [description] * 2


@pytest.mark.parametrize(
    "name, expected",
    [
        (
            "docstring",
            {
                "q": "self_attn.q_proj",
                "k": "self_attn.k_proj",
                "v": "self_attn.v_proj",
                "o": "self_attn.o_proj",
                "gate": "mlp.gate_proj",
                "up": "mlp.up_proj",
                "down": "mlp.down_proj",
            },
        ),
        (
            "llama",
            {
                "q": "self_attn.q_proj",
                "k": "self_attn.k_proj",
                "v": "self_attn.v_proj",
                "o": "self_attn.o_proj",
                "gate": "mlp.gate_proj",
                "up": "mlp.up_proj",
                "down": "mlp.down_proj",
            },
        ),
        (
            "phi3",
            {
                "qkv": "self_attn.qkv_proj",
                "o": "self_attn.o_proj",
                "gate_up": "mlp.gate_up_proj",
                "down": "mlp.down_proj",
            },
        ),
        ("gpt", {"qkv": "attn.qkv_proj", "o": "attn.out_proj", "fc_in": "mlp.fc_in", "fc_out": "mlp.fc_out"}),
    ],
)
def test_each_role_lands_on_its_own_layers_projection(name, expected):
    """q and k (same op, same producer) are told apart by the operand of the scores they reach;
    the second block's result is moved over from the first and must name its own parameters."""
    for block in recognise(name):
        names = {p.name: p.weight for s in block.roles.sublayers for p in s.projections}
        assert names == {k: f"{block.layer}.{v}.weight" for k, v in expected.items()}


def test_fused_projections_record_their_segments_and_heads():
    block = recognise("phi3")[0]
    attention, mlp = block.roles.sublayers
    assert {p.name: p.fused for p in attention.projections} == {"qkv": 3, "o": 1}
    assert {p.name: p.fused for p in mlp.projections} == {"gate_up": 2, "down": 1}
    assert (attention.num_heads, attention.num_kv_heads, attention.head_dim) == (4, 2, 8)


@pytest.mark.parametrize("name", ["gpt", "docstring"])
def test_recognition_work_does_not_grow_with_depth(name):
    shallow, deep = BlockRecogniser(), BlockRecogniser()
    shallow_blocks = recognise(name, 2, shallow)
    deep_blocks = recognise(name, 8, deep)
    assert all(b.roles.sublayers for b in shallow_blocks + deep_blocks)
    assert len(deep_blocks) == 8
    assert deep.calls == shallow.calls >= 1


def view_of_whole_model(name: str):
    _, _, graph = traced(name)
    return compute_view(graph, block_nodes(graph, ""))


def test_a_pattern_covering_part_of_a_layer_is_no_full_match_but_is_found():
    view = view_of_whole_model("swiglu_mlp")
    linear = part_pattern(LINEAR)
    assert Matcher([linear]).match_view(view) is None
    assert Matcher().find(view, linear)  # a projection inside the larger layer


def test_rms_norm_written_out_matches_its_pattern():
    _, _, graph = traced("llama")
    view = compute_view(graph, block_nodes(graph, "model.norm"))
    assert Matcher([part_pattern(RMS_NORM)]).match_view(view).pattern.kind == "rms_norm"
