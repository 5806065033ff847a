"""`autodist-plan check`: a plan made for one version of a model file is valid for it and stale,
with the reason named, once the model changes its parameters or its forward."""

from __future__ import annotations

import msgspec
import pytest
from click.testing import CliRunner

from autodist.planner.graph import build_graph, graph_fingerprint
from autodist.planner.load import load_target
from autodist.planner.cli.review import check
from autodist.planner.trace import trace_model
from autodist.schemas import (
    Cluster,
    Reshard,
    SequenceParallelBegin,
    InputSpec,
    Mesh,
    ModelInfo,
    ParamPlan,
    Plan,
    Provenance,
    Strategy,
    parameter_fingerprint,
    parameter_table,
    save_plan,
)

MODEL = """
import paddle
from paddle import nn


class Net(nn.Layer):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.layers = nn.LayerList([nn.Linear(16, 16) for _ in range({layers})])
        self.head = nn.Linear(16, {out})

    def forward(self, input_ids):
        h = self.embed(input_ids)
        for layer in self.layers:
            h = paddle.nn.functional.{act}(layer(h))
        return self.head(h)


def build_model():
    return Net()


def input_spec():
    return [paddle.static.InputSpec([2, 8], "int64", "input_ids")]
"""


def write_model(path, layers=2, out=32, act="relu"):
    path.write_text(MODEL.format(layers=layers, out=out, act=act))
    return str(path)


def plan_for(target: str) -> Plan:
    """A one-device plan carrying the fields `check` compares, computed the way the planner
    computes them (its load, trace and graph stages)."""
    from test_show import DEVICE

    loaded = load_target(target)
    table = parameter_table(loaded.model.named_parameters())
    traced = trace_model(loaded.model, loaded.input_specs)
    return Plan(
        model=ModelInfo(
            class_name="Net",
            num_parameters=0,
            param_fingerprint=parameter_fingerprint(table),
            graph_fingerprint=graph_fingerprint(build_graph(traced)),
            traced_layer=traced.traced_layer,
            input_specs=[InputSpec(name="input_ids", dtype="int64", shape=[2, 8])],
        ),
        cluster=Cluster(nodes=1, devices_per_node=1, device=DEVICE),
        mesh=Mesh(axes=["dp"], shape=[1], process_ids=[0]),
        strategy=Strategy(),
        params={fqn: ParamPlan(shape=shape, dtype=dtype, placements=["R"]) for fqn, (shape, dtype) in table.items()},
        provenance=Provenance(autodist_version="0.1.0", paddle_version="3.3.1"),
    )


@pytest.fixture
def planned(tmp_path):
    """(model file, plan file) for the first version of the model."""
    target = write_model(tmp_path / "model.py")
    plan_path = tmp_path / "plan.json"
    save_plan(plan_for(target), plan_path)
    return tmp_path / "model.py", str(plan_path)


def run_check(plan_path, target, *extra):
    return CliRunner().invoke(check, [plan_path, str(target), *extra])


def test_valid_plan_exit_0(planned):
    model, plan_path = planned
    result = run_check(plan_path, model)
    assert result.exit_code == 0, result.output
    assert "valid" in result.output


def test_resized_parameter_is_named(planned):
    model, plan_path = planned
    write_model(model, out=48)
    result = run_check(plan_path, model, "--no-trace")
    assert result.exit_code == 1
    assert (
        "2 parameter(s) changed shape or dtype: head.bias: plan 32 float32, model 48 float32; "
        "head.weight: plan 16x32 float32, model 16x48 float32"
    ) in result.output


def test_added_layers_are_collapsed(planned):
    model, plan_path = planned
    write_model(model, layers=5)
    result = run_check(plan_path, model)
    assert result.exit_code == 1
    assert "6 parameter(s) of the model not in the plan: layers.{2-4}.bias; layers.{2-4}.weight" in result.output
    assert "graph fingerprint differs" in result.output


def test_changed_forward_with_same_parameters(planned):
    model, plan_path = planned
    write_model(model, act="gelu")
    assert run_check(plan_path, model, "--no-trace").exit_code == 0  # parameters alone cannot see it
    result = run_check(plan_path, model)
    assert result.exit_code == 1
    assert "different structure" in result.output


def test_edited_fingerprint_is_reported(planned, tmp_path):
    model, plan_path = planned
    from autodist.schemas import load_plan

    plan = load_plan(plan_path)
    edited = msgspec.structs.replace(plan, model=msgspec.structs.replace(plan.model, param_fingerprint="0" * 64))
    save_plan(edited, plan_path)
    result = run_check(plan_path, model, "--no-trace")
    assert result.exit_code == 1 and "parameter fingerprint differs" in result.output


def test_missing_target_is_one_line_exit_2(planned, tmp_path):
    _, plan_path = planned
    result = run_check(plan_path, tmp_path / "nope.py")
    assert result.exit_code == 2
    assert result.output.startswith("error: ") and "nope.py" in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_help_has_an_example():
    result = CliRunner().invoke(check, ["--help"])
    assert result.exit_code == 0 and "autodist-plan check" in result.output


def test_checked_in_plan_is_valid_for_its_model():
    # the planner's recorded fingerprints are what `check` recomputes
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    result = run_check(str(repo / "plans/llama_docstring/plan_4dev.json"), repo / "plans/llama_docstring/model.py")
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize(
    "change, reason",
    [
        (
            lambda plan: msgspec.structs.replace(
                plan, hooks=[Reshard(layer="layers.7", when="post", placements=["R"])]
            ),
            'no sub-layer "layers.7"',
        ),
        (
            lambda plan: msgspec.structs.replace(
                plan,
                params={
                    **plan.params,
                    "head.weight": msgspec.structs.replace(plan.params["head.weight"], tied_to=["embed.weight"]),
                },
            ),
            'ties it to "embed.weight"',
        ),
        (
            lambda plan: msgspec.structs.replace(plan, hooks=[SequenceParallelBegin(layer="layers.0", when="pre")]),
            "sequence_parallel_begin needs an mp mesh axis",
        ),
    ],
    ids=["hook_on_missing_layer", "wrong_tied_to", "sequence_parallel_without_mp"],
)
def test_check_refuses_what_apply_plan_refuses(planned, change, reason):
    """`check` said "valid" for plans apply_plan then refused: both run the same checks."""
    from autodist.applier.placement.validate import plan_problems
    from autodist.schemas import load_plan

    model, plan_path = planned
    plan = change(load_plan(plan_path))
    save_plan(plan, plan_path)
    result = run_check(plan_path, model, "--no-trace")
    assert result.exit_code == 1, result.output
    assert reason in result.output
    refused = plan_problems(load_target(str(model)).model, None, None, plan, world_size=1)
    assert any(reason in problem for problem in refused), refused


def test_renamed_parameter_is_paired(planned):
    """`check` reports the same diff as apply_plan (schemas.parameter_diff): a vanished name with
    exactly one new name of the same shape and dtype is a rename, not one removal and one addition."""
    from autodist.planner.review.check import parameter_reasons
    from autodist.schemas import load_plan

    _, plan_path = planned
    plan = load_plan(plan_path)
    table = {
        ("out.weight" if fqn == "head.weight" else fqn): entry
        for fqn, entry in ((f, (p.shape, p.dtype)) for f, p in plan.params.items())
    }
    assert parameter_reasons(plan, table) == [
        "1 planned parameter(s) renamed? (same shape and dtype): head.weight -> out.weight"
    ]


def test_check_refuses_a_hook_the_plans_device_cannot_run(planned):
    """A reshard hand-edited to split a tensor over mp, in a plan for a device whose backend lacks
    reduce-scatter and all-to-all (gloo's gaps): before, `check` said valid, and both ranks failed
    with NotImplementedError at the first step. `check` now says what apply_plan refuses."""
    from test_show import DEVICE

    from autodist.schemas import load_plan

    model, plan_path = planned
    plan = load_plan(plan_path)
    gloo_like = msgspec.structs.replace(DEVICE, name="gloo-like", unsupported=["reduce_scatter", "all_to_all"])
    plan = msgspec.structs.replace(
        plan,
        cluster=msgspec.structs.replace(plan.cluster, devices_per_node=2, device=gloo_like),
        mesh=Mesh(axes=["mp"], shape=[2], process_ids=[0, 1]),
        strategy=Strategy(mp=2),
        hooks=[Reshard(layer="layers.0", when="post", placements=["S(1)"])],
    )
    save_plan(plan, plan_path)
    result = run_check(plan_path, model, "--no-trace")
    assert result.exit_code == 1, result.output
    assert (
        "$.hooks[0]: a reshard of layers.0's output to ['S(1)'] needs reduce-scatter or all-to-all, which "
        "gloo-like's backend lacks" in result.output
    ), result.output
