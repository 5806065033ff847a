"""`autodist-plan show`: the summary a reviewer reads, collapsed placements, the mesh grid."""

from __future__ import annotations

import json
import math
from pathlib import Path

import msgspec
import pytest
from click.testing import CliRunner

from autodist.planner.cli.review import REVIEW_COMMANDS, show
from autodist.planner.review.format import collapse, index_ranges, mesh_grid
from autodist.planner.review.show import MAX_ROWS, mesh_lines, show_data, show_text
from autodist.schemas import (
    Block,
    Cluster,
    DeviceProfile,
    Estimate,
    StageHandoff,
    ImplicitComm,
    Mesh,
    ModelInfo,
    ParamPlan,
    Plan,
    Provenance,
    Strategy,
    load_plan,
    save_plan,
)

EXAMPLE = Path(__file__).parent / "data" / "example_plan.json"
DEVICE = DeviceProfile(
    name="test-gpu",
    memory_bytes=16 * 2**30,
    peak_flops={"bf16": 1e14},
    intra_node_bandwidth=1e11,
    inter_node_bandwidth=1e10,
    intra_node_latency_s=1e-6,
    inter_node_latency_s=1e-5,
)


def layered_plan(layers: int = 4, dp: int = 1, mp: int = 2, pp: int = 1, step_time: float = 1.0) -> Plan:
    """A consistent Llama-like plan with ``layers`` blocks, built from the Structs (no planner)."""
    dims = [(n, s) for n, s in (("pp", pp), ("dp", dp), ("mp", mp)) if s > 1] or [("dp", 1)]
    names, shape = [n for n, _ in dims], [s for _, s in dims]
    on_mp = lambda p: ["R" if n != "mp" else p for n in names]  # noqa: E731
    params, blocks = {}, []
    per_stage = math.ceil(layers / pp)
    for i in range(layers):
        stage, prefix = i // per_stage, f"llama.layers.{i}"
        blocks.append(Block(layer=prefix, kind="llama_decoder", stage=stage))
        for proj, style, placement in (("q_proj", "ColWiseParallel", "S(1)"), ("o_proj", "RowWiseParallel", "S(0)")):
            params[f"{prefix}.self_attn.{proj}.weight"] = ParamPlan(
                shape=[8, 8],
                dtype="float32",
                placements=on_mp(placement if mp > 1 else "R"),
                stage=stage,
                style=style if mp > 1 else "Replicate",
            )
        params[f"{prefix}.input_layernorm.weight"] = ParamPlan(
            shape=[8], dtype="float32", placements=on_mp("R"), stage=stage
        )
    params["llama.embed_tokens.weight"] = ParamPlan(shape=[32, 8], dtype="float32", placements=on_mp("R"))
    world = dp * mp * pp
    return Plan(
        model=ModelInfo(
            class_name="LlamaForCausalLM",
            num_parameters=sum(math.prod(p.shape) for p in params.values()),
            param_fingerprint="a" * 64,
            graph_fingerprint="b" * 64,
        ),
        cluster=Cluster(nodes=1, devices_per_node=world, device=DEVICE),
        mesh=Mesh(axes=names, shape=shape, process_ids=list(range(world))),
        strategy=Strategy(dp=dp, mp=mp, pp=pp, schedule="sequential" if pp > 1 else "none"),
        params=params,
        blocks=blocks,
        hooks=[
            StageHandoff(layer=f"llama.layers.{i}", when="post", to_stage=i // per_stage + 1)
            for i in range(layers)
            if pp > 1 and (i + 1) % per_stage == 0 and i // per_stage + 1 < pp
        ],
        estimate=Estimate(step_time_s=step_time),
        provenance=Provenance(autodist_version="0.1.0", paddle_version="3.3.1"),
    )


def test_collapse_uses_a_wildcard_only_for_the_whole_set():
    values = {f"m.layers.{i}.w": ("R", "S(1)") for i in range(32)}
    assert [(r.pattern, len(r.members)) for r in collapse(values)] == [("m.layers.*.w", 32)]
    values["m.layers.7.w"] = ("R", "R")
    rows = {r.pattern: r.value for r in collapse(values)}
    assert rows == {"m.layers.{0-6,8-31}.w": ("R", "S(1)"), "m.layers.7.w": ("R", "R")}


def test_collapse_never_names_more_than_its_members():
    # a checkerboard over two indices has no exact pattern: listed one by one
    values = {f"a.{i}.b.{j}.w": (i + j) % 2 for i in range(3) for j in range(2)}
    rows = collapse(values)
    assert len(rows) == 6 and all(r.pattern == r.members[0] for r in rows)


def test_index_ranges():
    assert index_ranges([8, 0, 1, 2, 3]) == "0-3,8"
    assert index_ranges([5]) == "5"


def test_mesh_grid_is_row_major_per_stage():
    plan = layered_plan(layers=4, dp=2, mp=2, pp=2)
    assert mesh_grid(plan) == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    lines = mesh_lines(plan)
    assert lines[0] == "pp=0" and "mp=1" in lines[1] and lines[2].split() == ["dp=0", "0", "1"]
    assert lines[4] == "pp=1" and lines[-1].split() == ["dp=1", "6", "7"]


def test_large_meshes_are_abridged():
    wide = mesh_lines(layered_plan(layers=2, dp=40, mp=1))
    assert [line.split()[0] for line in wide] == ["dp=0-15", "dp=16-31", "dp=32-39"]
    assert wide[-1].split()[1:] == [str(i) for i in range(32, 40)]
    tall = mesh_lines(layered_plan(layers=2, dp=16, mp=8))
    assert len(tall) == 1 + MAX_ROWS and tall[-2].strip() == "…"
    assert tall[-1].split() == ["dp=15", *[str(i) for i in range(120, 128)]]


def test_data_parallel_plan_says_everything_is_replicated():
    text = show_text(layered_plan(layers=4, dp=4, mp=1))
    assert "all 13 parameters replicated (R on every mesh axis)" in text
    assert "q_proj" not in text


def test_show_text_collapses_32_layers_into_one_line_each():
    text = show_text(layered_plan(layers=32, dp=2, mp=2))
    q_lines = [line for line in text.splitlines() if "q_proj" in line]
    assert len(q_lines) == 1
    assert q_lines[0].split()[:4] == ["llama.layers.*.self_attn.q_proj.weight", "R", "S(1)", "ColWiseParallel"]
    assert q_lines[0].split()[-1] == "×32"


def test_implicit_communication_is_collapsed():
    plan = layered_plan(layers=8, mp=2)
    plan.implicit_comm = [
        ImplicitComm(
            layer=f"llama.layers.{i}.self_attn",
            op="pd_op.reshape",
            collective="all_gather",
            bytes_per_step=100,
            reason="fused q|k|v split across segments",
        )
        for i in range(8)
    ]
    lines = [line for line in show_text(plan).splitlines() if "implicit all_gather" in line]
    assert lines == [
        "  implicit all_gather at llama.layers.*.self_attn ×8 (pd_op.reshape): 800 B — "
        "fused q|k|v split across segments"
    ]


def test_tied_parameters_are_named():
    plan = layered_plan(layers=2, mp=2)
    plan.params["llama.embed_tokens.weight"].tied_to = ["lm_head.weight"]
    assert "  tied: llama.embed_tokens.weight is also lm_head.weight (one parameter)" in show_text(plan)


def test_show_names_the_blocks_of_each_stage():
    data = show_data(layered_plan(layers=6, mp=2, pp=2))
    assert [s["blocks"] for s in data["stages"]] == [["llama.layers.{0-2}"], ["llama.layers.{3-5}"]]
    assert [s["num_blocks"] for s in data["stages"]] == [3, 3]
    # embedding on stage 0 plus 3 tensors per block
    assert [s["num_params"] for s in data["stages"]] == [10, 9]


def test_show_json_matches_the_plan(tmp_path):
    path = tmp_path / "plan.json"
    save_plan(layered_plan(layers=4, dp=2, mp=2), path)
    result = CliRunner().invoke(show, [str(path), "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["strategy"]["mp"] == 2 and data["mesh"]["grid"] == [[[0, 1], [2, 3]]]
    assert sum(row["count"] for row in data["placements"]) == 4 * 3 + 1


def test_show_example_plan_text():
    result = CliRunner().invoke(show, [str(EXAMPLE)])
    assert result.exit_code == 0, result.output
    plan = load_plan(EXAMPLE)
    assert plan.model.class_name in result.output
    assert "dp × mp = 2 × 2" in result.output
    for reason in (r.reason for r in plan.alternatives.rejected):
        assert reason.split()[0].split("=")[0] in result.output
    for note in plan.notes:
        assert note in result.output


@pytest.mark.parametrize(
    "content, expected",
    [
        (None, "cannot read the plan file"),
        (b"{not json", "not valid JSON"),
        (b'{"format": "autodist.plan", "version": 99}', "upgrade autodist"),
    ],
)
def test_show_bad_input_is_one_line_and_exit_2(tmp_path, content, expected):
    path = tmp_path / "plan.json"
    if content is not None:
        path.write_bytes(content)
    result = CliRunner().invoke(show, [str(path)])
    assert result.exit_code == 2
    assert len(result.output.strip().splitlines()) == 1
    assert result.output.startswith("error: ") and expected in result.output


def test_show_help_has_an_example():
    result = CliRunner().invoke(show, ["--help"])
    assert result.exit_code == 0 and "Example:" in result.output and "autodist-plan show" in result.output


def test_layered_plan_is_valid():
    # the factory the review tests build on must itself be a valid plan
    for kwargs in ({}, {"dp": 2, "mp": 2}, {"mp": 2, "pp": 2}, {"dp": 1, "mp": 1}):
        load_plan(msgspec.json.encode(layered_plan(**kwargs)))


@pytest.mark.parametrize("command", REVIEW_COMMANDS, ids=lambda c: c.name)
def test_every_review_command_has_help_with_an_example(command):
    result = CliRunner().invoke(command, ["--help"])
    assert result.exit_code == 0
    assert "Example:" in result.output and f"autodist-plan {command.name}" in result.output


def test_vpp_says_how_many_chunks_each_stage_runs():
    plan = layered_plan(layers=4, pp=2)
    plan.strategy = msgspec.structs.replace(plan.strategy, schedule="VPP", micro_batches=2, virtual_stages=2)
    assert "schedule VPP (2 chunks per stage)" in show_text(plan)


def test_rejected_reasons_keep_their_numbers_and_name_the_run_of_blocks(tmp_path):
    """Twelve blocks of 4 heads on 6 devices: mp=3 and mp=6 are rejected, each reason word for
    word (once ``mp=N does not divide the N attention heads of blocks.N``), with how many
    meshes it rejected and every block it is about."""
    from harness.planning import plan_command

    sizes = dict(num_layers=12, hidden_size=40, num_heads=4, vocab_size=96, intermediate_size=72)
    env = {f"LLAMA_DOCSTRING_{k.upper()}": str(v) for k, v in sizes.items()}
    arguments = ["--devices", "6", "--device", "h100-sxm", "--input-spec", "input_ids:int64:6x16"]
    plan = load_plan(plan_command("plans/llama_docstring/model.py", arguments, tmp_path / "plan.json", env))
    lines = [line for line in show_text(plan).splitlines() if "rejected ×" in line]
    assert lines == [
        "  rejected ×2: mp=3 does not divide the 4 heads of layers.0-11",
        "  rejected ×1: mp=6 does not divide the 4 heads of layers.0-11",
    ]
