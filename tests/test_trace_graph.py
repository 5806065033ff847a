"""trace_model and build_graph on real traced models: op attribution, constant folding, the
model left untouched, lazy parameters left unallocated, fallback tracing, a stable fingerprint."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import paddle
import pytest
from click.testing import CliRunner

from autodist.planner.cli import cli
from autodist.planner.graph import CONSTANT_OPS, build_graph, graph_fingerprint
from autodist.planner.trace import trace_model

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "plans" / "llama_docstring"))
import model as docstring  # noqa: E402

TINY = docstring.LlamaConfig(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_heads=4, num_layers=2, seq_length=16
)


def lazy_tiny_model():
    with paddle.LazyGuard():
        return docstring.build_model(TINY)


@pytest.fixture(scope="module")
def traced():
    return trace_model(lazy_tiny_model(), docstring.input_spec(TINY))


@pytest.fixture(scope="module")
def graph(traced):
    return build_graph(traced)


def test_ops_are_attributed_to_the_innermost_layer(traced):
    layers_of = {}
    for op, layer in zip(traced.ops, traced.op_layers):
        layers_of.setdefault(op.name(), set()).add(layer)
    # Every projection's matmul is owned by the projection itself, not its attention/MLP parent.
    projections = {
        f"layers.{i}.{p}"
        for i in range(2)
        for p in (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
        )
    }
    assert projections <= layers_of["pd_op.matmul"]
    assert layers_of["pd_op.embedding"] == {"embed_tokens"}
    assert layers_of["pd_op.swiglu"] == {"layers.0.mlp", "layers.1.mlp"}
    assert layers_of["pd_op.softmax"] == {"layers.0.self_attn", "layers.1.self_attn"}
    assert layers_of["pd_op.rsqrt"] == {
        f"layers.{i}.{n}" for i in range(2) for n in ("input_layernorm", "post_attn_layernorm")
    } | {"norm"}
    assert traced.traced_layer == "" and traced.untraced_layers == []


def test_graph_nodes_carry_parameter_fqns_and_fold_constants(graph):
    model = lazy_tiny_model()
    params = {data["param"] for _, data in graph.nodes(data=True) if data["param"]}
    assert params == {fqn for fqn, _ in model.named_parameters()}
    assert not any(data["op"] in CONSTANT_OPS for _, data in graph.nodes(data=True))
    q_weight = next(n for n, d in graph.nodes(data=True) if d["param"] == "layers.0.self_attn.q_proj.weight")
    (matmul,) = graph.successors(q_weight)
    assert graph.nodes[matmul]["op"] == "pd_op.matmul"
    assert graph.edges[q_weight, matmul, 1] == {"operand": 1, "result": 0}
    assert graph.nodes[q_weight]["layer"] == "layers.0.self_attn.q_proj"
    assert graph.nodes[q_weight]["shapes"] == [[32, 32]] and graph.nodes[q_weight]["dtypes"] == ["float32"]
    # The reshape to [0, 0, heads, head_dim] keeps its target shape as a folded constant.
    (reshape,) = [n for n in graph.successors(matmul) if graph.nodes[n]["op"] == "pd_op.reshape"]
    assert graph.nodes[reshape]["consts"] == {1: [0, 0, 4, 8]}
    assert graph.nodes[reshape]["shapes"][0] == [4, 16, 4, 8]
    json.dumps([data for _, data in graph.nodes(data=True)])  # attributes are plain JSON


def test_an_op_reading_two_results_of_one_unbind_keeps_both_operands():
    """``paddle.matmul(q, k, transpose_y=True)`` with q and k from one ``unbind``: two edges
    between the same two nodes, one per operand (one per producer pair lost ``k``, and Paddle's
    ``matmul`` SPMD rule segfaulted on the operand missing: tests/models/zoo/vit.py:build_with_transpose_y)."""
    from autodist.planner.graph import operand_sources

    class Scores(paddle.nn.Layer):
        def forward(self, qkv):
            q, k, v = qkv.unbind(0)
            return paddle.matmul(q, k, transpose_y=True)

    graph = build_graph(trace_model(Scores(), [paddle.static.InputSpec([3, 2, 5, 7], "float32", "qkv")]))
    (matmul,) = [n for n, d in graph.nodes(data=True) if d["op"] == "pd_op.matmul"]
    (producer,) = set(graph.predecessors(matmul))
    assert operand_sources(graph, matmul) == {0: (producer, 0), 1: (producer, 1)}
    assert graph.nodes[matmul]["shapes"] == [[2, 5, 5]]


def test_tracing_leaves_a_lazy_model_unallocated(traced):
    model = lazy_tiny_model()
    trace_model(model, docstring.input_spec(TINY))
    assert not any(p._is_initialized() for p in model.parameters())


def test_model_is_usable_and_unchanged_after_tracing():
    paddle.seed(1)
    model = docstring.build_model(TINY)
    ids = paddle.to_tensor(np.random.RandomState(0).randint(0, 64, (4, 16)).astype("int64"))
    before_loss, before_logits = model(ids, labels=ids)
    before_state = {k: v.numpy().copy() for k, v in model.state_dict().items()}
    forward = model.forward
    trace_model(model, docstring.input_spec(TINY))
    assert model.forward == forward
    assert all(
        not layer._forward_pre_hooks and not layer._forward_post_hooks for layer in model.sublayers(include_self=True)
    )
    after_loss, after_logits = model(ids, labels=ids)
    np.testing.assert_array_equal(after_logits.numpy(), before_logits.numpy())
    assert float(after_loss) == float(before_loss)
    for key, value in model.state_dict().items():
        np.testing.assert_array_equal(value.numpy(), before_state[key])
    after_loss.backward()  # still trains: gradients flow to every weight
    assert all(p.grad is not None for p in model.parameters())


class Untraceable(paddle.nn.Layer):
    """Stands for PaddleFormers' ForCausalLM classes: its own forward does not trace, its body does."""

    def __init__(self):
        super().__init__()
        self.body = docstring.build_model(TINY)
        self.lm_head = paddle.nn.Linear(64, 64)

    def forward(self, input_ids):
        if not paddle.in_dynamic_mode():  # what dy2static hits on LlamaForCausalLM.forward
            raise RecursionError("maximum recursion depth exceeded")
        _, logits = self.body(input_ids)
        return self.lm_head(logits)


def test_untraceable_model_traces_its_largest_child_with_user_fqns():
    with paddle.LazyGuard():
        model = Untraceable()
    traced = trace_model(model, docstring.input_spec(TINY))
    assert traced.traced_layer == "body"
    assert traced.untraced_layers == ["lm_head"]
    assert "body.layers.1.mlp.down_proj" in traced.op_layers
    assert all(layer == "body" or layer.startswith("body.") for layer in traced.op_layers)
    graph = build_graph(traced)
    assert any(d["param"] == "body.layers.0.self_attn.q_proj.weight" for _, d in graph.nodes(data=True))


def test_fingerprint_changes_with_the_model(graph):
    wider = docstring.LlamaConfig(**{**TINY.__dict__, "intermediate_size": 128})
    with paddle.LazyGuard():
        model = docstring.build_model(wider)
    other = build_graph(trace_model(model, docstring.input_spec(wider)))
    assert graph_fingerprint(other) != graph_fingerprint(graph)


FINGERPRINT_SCRIPT = """
import sys, paddle
sys.path.insert(0, {path!r})
import model as m
from paddle import nn
from autodist.planner.graph import build_graph, graph_fingerprint
from autodist.planner.trace import trace_model
nn.Linear(3, 3); nn.Linear(3, 3)  # shifts Paddle's generated parameter names in this process only
{config}
with paddle.LazyGuard():
    net = m.build_model(cfg)
print(graph_fingerprint(build_graph(trace_model(net, m.input_spec(cfg)))))
"""


def test_fingerprint_is_the_same_in_other_processes(graph):
    config = f"cfg = m.{TINY!r}"
    script = FINGERPRINT_SCRIPT.format(path=str(ROOT / "plans" / "llama_docstring"), config=config)
    env = {**os.environ, "PYTHONHASHSEED": "random"}
    prints = [
        subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, check=True, env=env, timeout=120
        ).stdout.split()[-1]
        for _ in range(2)
    ]
    assert prints == [graph_fingerprint(graph)] * 2


def test_graph_command_json_and_dot(tmp_path, monkeypatch):
    for field, value in TINY.__dict__.items():
        monkeypatch.setenv(f"LLAMA_DOCSTRING_{field.upper()}", str(value))
    target = str(ROOT / "plans" / "llama_docstring" / "model.py")
    runner = CliRunner()
    result = runner.invoke(cli, ["graph", target, "--format", "json"])
    assert result.exit_code == 0, result.output
    dumped = json.loads(result.output)
    assert any(n["param"] == "layers.1.mlp.up_proj.weight" for n in dumped["nodes"])
    assert len(dumped["edges"]) > len(dumped["nodes"]) // 2
    out = tmp_path / "g.dot"
    result = runner.invoke(cli, ["graph", target, "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert out.read_text().startswith("digraph") and "pd_op.swiglu" in out.read_text()


def test_graph_command_bad_target_exits_2(tmp_path):
    result = CliRunner().invoke(cli, ["graph", str(tmp_path / "missing.py")])
    assert result.exit_code == 2
    assert "error:" in result.output and "not found" in result.output


@pytest.mark.slow
def test_paddleformers_llama_traces_whole_with_its_head():
    """Its LM head's ``config.get`` used to recurse for ever under dy2static's ``super()``
    rewrite (docs/paddle-notes.md), and the planner fell back to tracing ``model``."""
    from models import paddleformers_models

    with paddle.LazyGuard():
        model = paddleformers_models.build_llama()
    traced = trace_model(model, paddleformers_models.input_spec())
    assert (traced.traced_layer, traced.untraced_layers, traced.fallback_reason) == ("", [], "")
    assert "model.layers.1.self_attn.k_proj" in traced.op_layers and "lm_head" in traced.op_layers


def test_traced_in_eval_mode_and_each_layers_mode_restored():
    """Dropout is traced as the identity it is in eval mode (and ``if self.training`` branches are
    not taken); the model's own per-layer modes come back afterwards, including a sub-layer the
    user had in eval."""
    net = paddle.nn.Sequential(paddle.nn.Linear(4, 4), paddle.nn.Dropout(0.5), paddle.nn.Linear(4, 4))
    net[2].eval()
    traced = trace_model(net, [paddle.static.InputSpec([2, 4], "float32", "x")])
    dropouts = [op.attrs() for op in traced.ops if op.name() == "pd_op.dropout"]
    assert dropouts and all(a["is_test"] and a["mode"] == "upscale_in_train" for a in dropouts)
    assert (net.training, net[0].training, net[1].training, net[2].training) == (True, True, True, False)


class GrowingCache(paddle.nn.Layer):
    """A cache buffer that grows when a longer input comes, assigned (``self.cache = ...``) rather
    than registered again (the zoo's llama_growing_rope_hf registers it again)."""

    def __init__(self):
        super().__init__()
        self.proj = paddle.nn.Linear(8, 8)
        self.register_buffer("cache", paddle.ones([4]), persistable=False)
        self.cached = 4

    def forward(self, x):
        n = x.shape[0]
        if n > self.cached:
            self.cached = n
            self.cache = paddle.arange(n, dtype="float32")
        return self.proj(x) * self.cache[:n].unsqueeze(-1)


def test_a_buffer_set_anew_in_forward_is_traced_as_the_value_it_gets():
    """Paddle writes a traced value assigned to a buffer into it in place, which fails at another
    shape; the trace reads the new value instead, and the layer is as it was afterwards."""
    model = GrowingCache()
    traced = trace_model(model, [paddle.static.InputSpec([6, 8], "float32", "x")])
    assert traced.traced_layer == "" and not traced.fallback_reason
    ranges = [op for op in traced.ops if op.name() == "pd_op.arange"]
    assert [list(op.result(0).shape) for op in ranges] == [[6]]
    assert list(model.cache.shape) == [4] and model.cached == 4 and "cache" not in vars(model)
