"""Model analysis on real traced models: roles, split dims, sizes, outer layers, ties."""

from __future__ import annotations

import dataclasses

import paddle
import pytest

from autodist import schemas
from autodist.planner.recognise.analysis import analyze, split_dim, weight_use
from autodist.planner.graph import build_graph
from autodist.planner.trace import trace_model
from models.traced import build, traced


def analysis_of(key: str):
    model, program, graph = traced(key)
    return analyze(program, graph, model)


def roles(block) -> dict[str, tuple[str, int | None, int]]:
    return {lin.layer.rpartition(".")[2]: (lin.role, lin.split_dim, lin.fused) for lin in block.linears}


def test_docstring_llama_roles_sizes_and_outer_layers():
    a = analysis_of("docstring")
    assert [b.layer for b in a.blocks] == ["layers.0", "layers.1"]
    block = a.blocks[0]
    assert roles(block) == {
        "q_proj": ("column", 1, 1),
        "k_proj": ("column", 1, 1),
        "v_proj": ("column", 1, 1),
        "o_proj": ("row", 0, 1),
        "gate_proj": ("column", 1, 1),
        "up_proj": ("column", 1, 1),
        "down_proj": ("row", 0, 1),
    }
    assert (block.num_heads, block.num_kv_heads, block.head_dim, block.hidden_size, block.intermediate_size) == (
        4,
        4,
        8,
        32,
        64,
    )
    assert block.norms == ["layers.0.input_layernorm.weight", "layers.0.post_attn_layernorm.weight"]
    assert a.embedding == "embed_tokens.weight" and a.vocab_size == 64
    assert a.final_norm == ["norm.weight"]
    # the head is the model's own [hidden, vocab] parameter in a plain matmul: vocab is dim 1
    assert (a.lm_head.weight, a.lm_head.role, a.lm_head.split_dim) == ("weight", "column", 1)
    assert a.unmatched == [] and a.tied == {}
    assert (a.batch_size, a.seq_len) == (2, 16)
    assert a.input_specs == [schemas.InputSpec(name="input_ids", dtype="int64", shape=[2, 16])]


def test_paddleformers_llama_gqa_with_tied_head():
    a = analysis_of("llama")
    assert a.traced_layer == ""  # the whole LlamaForCausalLM, head included
    block = a.blocks[1]
    assert (block.num_heads, block.num_kv_heads, block.head_dim) == (4, 2, 8)
    assert roles(block)["k_proj"] == ("column", 1, 1) and roles(block)["down_proj"] == ("row", 0, 1)
    # the head's weight is the embedding's Parameter ([vocab, hidden], used transposed)
    assert a.tied["model.embed_tokens.weight"] == ["lm_head.weight"]
    assert (a.lm_head.weight, a.lm_head.role, a.lm_head.split_dim) == ("model.embed_tokens.weight", "column", 0)
    assert a.final_norm == ["model.norm.weight"] and a.unmatched == []


def test_untied_paddleformers_head_is_placed_from_its_shape():
    a = analysis_of("llama_untied")
    assert a.tied == {}
    assert a.params["lm_head.weight"][0] == [64, 32]  # [vocab, hidden]
    assert (a.lm_head.weight, a.lm_head.role, a.lm_head.split_dim) == ("lm_head.weight", "column", 0)


def test_phi3_fused_projections():
    a = analysis_of("phi3")
    block = a.blocks[0]
    assert block.kind == "phi3_decoder"
    assert roles(block) == {
        "qkv_proj": ("column", 1, 3),
        "o_proj": ("row", 0, 1),
        "gate_up_proj": ("column", 1, 2),
        "down_proj": ("row", 0, 1),
    }
    # sizes from shapes: q|k|v = (4 + 2 * 2) * 8 features, gate|up = 2 * 64
    assert (block.num_heads, block.num_kv_heads, block.head_dim, block.intermediate_size) == (4, 2, 8, 64)


def test_gemma3_qk_norms_sandwich_norms_and_scaled_embedding():
    a = analysis_of("gemma3")
    block = a.blocks[0]
    assert roles(block) == {
        "qkv_proj": ("column", 1, 3),
        "o_proj": ("row", 0, 1),
        "up_gate_proj": ("column", 1, 2),
        "down_proj": ("row", 0, 1),
    }
    assert [n.rpartition(".")[0].rpartition(".")[2] for n in block.norms] == [
        "input_layernorm",
        "q_norm",
        "k_norm",
        "post_attention_layernorm",
        "pre_feedforward_layernorm",
        "post_feedforward_layernorm",
    ]
    assert (block.num_heads, block.num_kv_heads, block.head_dim) == (4, 2, 8)
    # the embedding multiplies by a scale buffer; the head is the embedding's Parameter
    assert a.embedding == "model.embed_tokens.weight" and a.lm_head.weight == a.embedding
    assert a.unmatched == []


def test_gpt_biases_layer_norms_and_position_embedding():
    a = analysis_of("gpt")
    block = a.blocks[0]
    biases = {lin.layer.rpartition(".")[2]: lin.bias for lin in block.linears}
    assert biases == {
        "qkv_proj": "blocks.0.attn.qkv_proj.bias",
        "out_proj": "blocks.0.attn.out_proj.bias",
        "fc_in": "blocks.0.mlp.fc_in.bias",
        "fc_out": "blocks.0.mlp.fc_out.bias",
    }
    assert (block.num_heads, block.num_kv_heads, block.intermediate_size) == (4, 4, 128)
    assert a.embedding == "wte.weight" and a.final_norm == ["ln_f.weight", "ln_f.bias"]
    assert (a.lm_head.weight, a.lm_head.split_dim) == ("lm_head.weight", 1)
    assert any("wpe.weight" in note for note in a.notes) and a.unmatched == []


def test_sizes_come_from_the_graph_not_from_config_attributes():
    model, program, graph = traced("docstring")
    config = model.config
    model.config = dataclasses.replace(config, num_heads=1, intermediate_size=7)
    try:
        block = analyze(program, graph, model).blocks[0]
    finally:
        model.config = config  # the traced model is shared by the session
    assert (block.num_heads, block.intermediate_size) == (4, 64)


def test_cnn_has_no_blocks_and_lists_its_layers_as_unmatched():
    a = analysis_of("cnn")
    assert a.blocks == [] and a.lm_head is None and a.embedding is None
    assert a.unmatched == ["conv", "fc"]  # the plan notes them per layer (emit; tests/test_cli_plan.py)


def test_fingerprints_match_the_schema_helpers():
    model, _, _ = traced("gpt")
    a = analysis_of("gpt")
    assert a.param_fingerprint == schemas.parameter_fingerprint(schemas.parameter_table(model.named_parameters()))
    assert len(a.graph_fingerprint) == 64


class TransposedHead(paddle.nn.Layer):
    """A weight stored [out, in] and used through ``transpose_y``: its output dim is dim 0."""

    def __init__(self):
        super().__init__()
        self.weight = self.create_parameter([8, 4])

    def forward(self, x):
        return paddle.matmul(x, self.weight, transpose_y=True)


def test_transposed_use_swaps_the_split_dim():
    model = TransposedHead()
    graph = build_graph(trace_model(model, [paddle.static.InputSpec([2, 4], "float32", "x")]))
    weight = next(n for n, d in graph.nodes(data=True) if d["param"] == "weight")
    matmul = next(iter(graph.successors(weight)))
    operand, transposed = weight_use(graph, weight, matmul)
    assert (operand, transposed) == (1, True)
    assert split_dim("column", operand, transposed) == 0 and split_dim("row", operand, transposed) == 1


@pytest.mark.parametrize(
    "role, operand, transposed, expected",
    [
        ("column", 1, False, 1),
        ("row", 1, False, 0),
        ("column", 1, True, 0),
        ("row", 1, True, 1),
        ("column", 0, False, 0),
        ("column", 0, True, 1),
        ("replicate", 1, False, None),
    ],
)
def test_split_dim_rule(role, operand, transposed, expected):
    assert split_dim(role, operand, transposed) == expected


def test_analysis_leaves_the_model_usable():
    model, _ = build("gpt")
    ids = paddle.randint(0, 64, [2, 8])
    before = model(ids).numpy()
    analyze(
        trace := trace_model(model, [paddle.static.InputSpec([2, 8], "int64", "input_ids")]), build_graph(trace), model
    )
    assert (model(ids).numpy() == before).all()


class MlpStack(paddle.nn.Layer):
    """Repeated blocks that are only MLPs (no attention beside them)."""

    def __init__(self):
        super().__init__()
        from models.paddleformers_models import SwiGLUMLP

        self.layers = paddle.nn.LayerList([SwiGLUMLP(), SwiGLUMLP()])

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x


def test_an_mlp_is_split_without_an_attention_beside_it():
    model = MlpStack()
    program = trace_model(model, [paddle.static.InputSpec([2, 8, 32], "float32", "x")])
    a = analyze(program, build_graph(program), model)
    assert [b.description for b in a.blocks] == ["mlp(gate|up)"] * 2
    assert {(lin.name, lin.role) for lin in a.blocks[1].linears} == {
        ("gate", "column"),
        ("up", "column"),
        ("down", "row"),
    }


class NormedMlp(paddle.nn.Layer):
    """A hidden LayerNorm over the intermediate features: a split there needs a gather."""

    def __init__(self):
        super().__init__()
        self.fc1, self.norm, self.fc2 = paddle.nn.Linear(32, 64), paddle.nn.LayerNorm(64), paddle.nn.Linear(64, 32)

    def forward(self, x):
        return x + self.fc2(self.norm(paddle.nn.functional.gelu(self.fc1(x))))


class NormedStack(paddle.nn.Layer):
    def __init__(self):
        super().__init__()
        self.blocks = paddle.nn.LayerList([NormedMlp() for _ in range(3)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def test_what_stops_a_split_is_one_note_per_layer_kind():
    model = NormedStack()
    program = trace_model(model, [paddle.static.InputSpec([2, 8, 32], "float32", "x")])
    a = analyze(program, build_graph(program), model)
    assert a.blocks == []
    assert [n for n in a.notes if "stops" in n] == [
        "blocks.*.fc2: op layer_norm (first seen in blocks.0.norm) stops the tensor-parallel split before this "
        "projection; it and the projections feeding it stay replicated"
    ]


def test_a_layer_norm_without_bias_is_a_final_norm():
    """HF DBRX's ``norm_f`` is ``nn.LayerNorm(d_model, bias=False)``: a ``layer_norm`` op with a
    weight and no bias, matched as the final norm (before, no pattern matched it and it was warned
    about as an unknown layer; sequence parallelism anchors its end there)."""
    from autodist.planner import driver

    loaded = driver.load("tests/models/zoo/dbrx_hf.py", None)
    analysis = driver.analyse(loaded.model, driver.trace(loaded.model, loaded.input_specs))
    assert analysis.final_norm == ["transformer.norm_f.weight"]
    assert "transformer.norm_f" not in analysis.unmatched
