"""Full-coverage matching on real traced models, and matching work independent of depth."""

from __future__ import annotations

import pytest

from autodist.planner.recognise.match import Matcher, block_nodes, compute_view
from autodist.planner.recognise.patterns import GELU_MLP, PARAM, SWIGLU_SILU, mlp_pattern
from models.traced import traced

BLOCK_LISTS = {"docstring": "layers", "llama": "model.layers", "phi3": "model.layers", "gpt": "blocks",
               "gpt_sdpa": "blocks", "gemma3": "model.layers"}


def match(name: str, layers: int = 2, matcher: Matcher | None = None):
    matcher = matcher or Matcher()
    _, _, graph = traced(f"{name}@{layers}")
    return matcher.match_blocks(graph, [f"{BLOCK_LISTS[name]}.{i}" for i in range(layers)]), graph


def weights(block_match, graph) -> dict[str, str]:
    """pattern linear name -> parameter FQN it matched."""
    pattern = block_match.match.pattern.graph
    return {pattern.nodes[p]["linear"]: graph.nodes[g]["param"]
            for p, g in block_match.match.nodes_where(op=PARAM) if "linear" in pattern.nodes[p]}


@pytest.mark.parametrize("name, kind, description", [
    ("docstring", "llama_decoder", "rms_norm+attn(q|k|v,rope)+mlp(swiglu_op)"),
    ("llama", "llama_decoder", "rms_norm+attn(q|k|v,rope)+mlp(swiglu_silu)"),
    ("phi3", "phi3_decoder", "rms_norm+attn(qkv,rope)+mlp(fused_swiglu)"),
    ("gpt", "gpt_block", "layer_norm+attn(qkv,qkv_bias,o_bias)+mlp(gelu,bias)"),
    # Paddle's SDPA traces to the same math on CPU; its causal mask is built from the scores' shape
    ("gpt_sdpa", "gpt_block", "layer_norm+attn(qkv,qkv_bias,o_bias)+mlp(gelu,bias)"),
    ("gemma3", "gemma3_decoder", "rms_norm(sandwich)+attn(qkv,qk_norm,rope)+mlp(fused_geglu)"),
])
def test_every_block_of_a_real_model_matches(name, kind, description):
    blocks, _ = match(name)
    assert [(b.match.pattern.kind, b.match.pattern.description) for b in blocks] == [(kind, description)] * 2


@pytest.mark.parametrize("name, expected", [
    ("docstring", {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
                   "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}),
    ("llama", {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
               "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}),
    ("phi3", {"qkv": "self_attn.qkv_proj", "o": "self_attn.o_proj", "gate_up": "mlp.gate_up_proj",
              "down": "mlp.down_proj"}),
    ("gpt", {"qkv": "attn.qkv_proj", "o": "attn.out_proj", "fc_in": "mlp.fc_in", "fc_out": "mlp.fc_out"}),
])
def test_each_pattern_linear_lands_on_its_own_layers_projection(name, expected):
    """q/k (same op, same producer) are told apart by operand slots; the second block's match is
    moved over from the first and must name the second block's parameters."""
    blocks, graph = match(name)
    for block in blocks:
        assert weights(block, graph) == {k: f"{block.layer}.{v}.weight" for k, v in expected.items()}


def view_of_whole_model(name: str):
    _, _, graph = traced(name)
    return compute_view(graph, block_nodes(graph, ""))


def test_gelu_mlp_pattern_does_not_match_a_swiglu_mlp_and_vice_versa():
    swiglu, gelu = view_of_whole_model("swiglu_mlp"), view_of_whole_model("gelu_mlp")
    gelu_only, swiglu_only = Matcher([mlp_pattern(GELU_MLP)]), Matcher([mlp_pattern(SWIGLU_SILU)])
    assert gelu_only.match_view(swiglu) is None
    assert swiglu_only.match_view(gelu) is None
    # ...while each matches its own kind, so the None above is the pattern's doing
    assert gelu_only.match_view(gelu) is not None
    assert swiglu_only.match_view(swiglu) is not None


def test_a_pattern_covering_part_of_a_block_is_no_match():
    blocks, _ = match("llama")
    view = blocks[0].view
    mlp_only = mlp_pattern(SWIGLU_SILU)
    # the MLP's ops are all inside the block: a partial-overlap matcher would accept it
    assert all(view_count >= n for op, n in mlp_only.histogram.items()
               for view_count in [sum(1 for _, d in view.nodes(data=True) if d["op"] == op)])
    assert Matcher([mlp_only]).match_view(view) is None


@pytest.mark.parametrize("name", ["gpt", "docstring"])
def test_matching_work_does_not_grow_with_depth(name):
    shallow, deep = Matcher(), Matcher()
    shallow_blocks, _ = match(name, 2, shallow)
    deep_blocks, _ = match(name, 8, deep)
    assert all(b.match is not None for b in shallow_blocks + deep_blocks)
    assert len(deep_blocks) == 8
    assert deep.calls == shallow.calls >= 1
