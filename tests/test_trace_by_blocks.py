"""A model whose own forward does not trace is traced block by block (issue #30, item 1).

HF StarCoder2 (tests/models/zoo/starcoder2_hf.py) drops an attention mask of all ones in its
top-level glue, a Python ``if`` on a tensor's value with None in one branch: no
``paddle.jit.to_static(full_graph=True)`` program holds that. Its embedding, decoder layers,
final norm and head trace one by one, called as one eager forward called them, and the graph
reads them as one program; the plan says so, and is the same bytes from run to run. A model
that traces whole is never traced by blocks. (It trains like one device on 2 gloo ranks:
tests/test_train_zoo.py; its placements are in tests/test_zoo.py.)
"""

from __future__ import annotations

import subprocess
import sys

import networkx as nx
import paddle
import pytest

from autodist.planner import driver
from autodist.planner.errors import PlannerError
from autodist.planner.trace import trace_model
from autodist.schemas import load_plan
from harness.cli import ROOT

STARCODER2 = "tests/models/zoo/starcoder2_hf.py"
UNITS = ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm", "lm_head"]


@pytest.fixture(scope="module")
def by_blocks():
    loaded = driver.load(STARCODER2)
    return loaded.model, driver.trace(loaded.model, loaded.input_specs)


def test_a_forward_whose_glue_does_not_trace_is_traced_block_by_block(by_blocks):
    model, traced = by_blocks
    assert traced.program.units == UNITS
    assert "different return type" in traced.program.fallback_reason  # None in one branch, a tensor in the other
    assert traced.program.traced_layer == ""
    assert not any(p._is_initialized() for p in model.parameters())  # the eager forward left it lazy


def test_the_units_are_read_as_one_dataflow(by_blocks):
    """Each unit's input that an earlier unit returned is that output: the graph runs from the
    token embedding through both layers to the head, as a whole trace's would."""
    _, traced = by_blocks
    graph = traced.graph
    table = next(n for n, d in graph.nodes(data=True) if d["param"] == "model.embed_tokens.weight")
    head = next(n for n, d in graph.nodes(data=True) if d["param"] == "lm_head.weight")
    (logits,) = graph.successors(head)
    assert nx.has_path(graph, table, logits)
    inputs = sorted(d["attrs"]["name"] for _, d in graph.nodes(data=True) if d["op"] == "pd_op.data")
    assert inputs == ["input_ids"]  # the hidden states are the units' own outputs, not inputs
    # position_ids, made by the glue and handed to both layers: one node, read by each
    (glue,) = [n for n, d in graph.nodes(data=True) if d["op"] == "glue"]
    assert graph.nodes[glue]["shapes"] == [[1, 12]] and graph.nodes[glue]["dtypes"] == ["int64"]
    assert {graph.nodes[n]["layer"].split(".self_attn")[0] for n in nx.descendants(graph, glue)} >= {
        "model.layers.0",
        "model.layers.1",
    }


def test_a_model_that_traces_whole_is_not_traced_by_blocks():
    loaded = driver.load("tests/models/zoo/stablelm_hf.py")
    traced = driver.trace(loaded.model, loaded.input_specs).program
    assert traced.units == [] and traced.fallback_reason == "" and traced.bridges == {}


def test_the_plan_says_how_it_was_traced_and_is_the_same_bytes_twice(tmp_path):
    plans = []
    for run in range(2):
        out = tmp_path / f"plan{run}.json"
        command = [sys.executable, "-m", "autodist.planner.cli", STARCODER2, "--devices", "2", "--mp", "2"]
        done = subprocess.run([*command, "-o", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        assert "traced block by block (model.embed_tokens, model.layers.0-1, model.norm, lm_head)" in done.stderr
        plans.append(out.read_bytes())
    assert plans[0] == plans[1]
    note = load_plan(plans[0]).notes[0]
    assert note.startswith("traced block by block (model.embed_tokens, model.layers.0-1, model.norm, lm_head), ")
    assert note.endswith("; the code between them runs as written")


class _MaybeScaled(paddle.nn.Layer):
    """A layer holding its own weight whose forward returns None or a tensor by a tensor's value."""

    def __init__(self):
        super().__init__()
        self.weight = self.create_parameter([4, 4])

    def forward(self, x):
        if paddle.all(x > 100):
            return None
        return x @ self.weight


class _Glue(paddle.nn.Layer):
    def __init__(self):
        super().__init__()
        self.first = paddle.nn.Linear(4, 4)
        self.second = _MaybeScaled()

    def forward(self, x):
        h = self.first(x)
        if paddle.all(h > 100):
            return None
        return self.second(h)


def test_a_layer_that_does_not_trace_alone_and_has_no_child_to_split_is_named_in_the_error():
    with paddle.LazyGuard():
        model = _Glue()
    with pytest.raises(PlannerError) as raised:
        trace_model(model, [paddle.static.InputSpec([2, 4], "float32", "x")])
    message = str(raised.value)
    assert "and it does not trace block by block (second does not trace: " in message, message
    assert not any(p._is_initialized() for p in model.parameters())
