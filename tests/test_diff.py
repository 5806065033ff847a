"""`autodist-plan diff`: what changed, in words; exit 0 equal, 1 different, 2 error."""

from __future__ import annotations

import msgspec
from click.testing import CliRunner
from test_show import EXAMPLE, layered_plan

from autodist.planner.review.diff import diff_plans
from autodist.planner.cli.review import diff
from autodist.schemas import Reshard, dump_plan, load_plan, save_plan


def run_diff(tmp_path, old, new):
    a, b = tmp_path / "old.json", tmp_path / "new.json"
    save_plan(old, a)
    save_plan(new, b)
    return CliRunner().invoke(diff, [str(a), str(b)])


def test_equal_plans_exit_0(tmp_path):
    plan = load_plan(EXAMPLE)
    result = run_diff(tmp_path, plan, plan)
    assert result.exit_code == 0, result.output
    assert diff_plans(plan, plan) == []


def test_mesh_and_collapsed_placements_and_estimate(tmp_path):
    old = layered_plan(layers=32, dp=2, mp=4, step_time=1.21)
    new = layered_plan(layers=32, dp=4, mp=2, step_time=1.05)
    result = run_diff(tmp_path, old, new)
    assert result.exit_code == 1
    lines = result.output.splitlines()
    assert "mesh: dp × mp 2 × 4 → 4 × 2" in lines
    assert "strategy: dp 2 → 4" in lines and "strategy: mp 4 → 2" in lines
    assert "estimate: step time 1.21 s → 1.05 s (-13%)" in lines
    # same styles on a different mesh size: no placement moved, nothing listed 32 times
    assert not any("changed placement" in line for line in lines)
    assert len(lines) < 12


def test_placement_changes_are_collapsed(tmp_path):
    old = layered_plan(layers=32, mp=2)
    new = layered_plan(layers=32, mp=2)
    for i in range(32):
        new.params[f"llama.layers.{i}.self_attn.q_proj.weight"].placements = ["R"]
        new.params[f"llama.layers.{i}.self_attn.o_proj.weight"].placements = ["R"]
    lines = diff_plans(old, new)
    start = lines.index("64 parameters changed placement:")
    assert lines[start + 1].split() == ["llama.layers.*.self_attn.o_proj.weight", "mp:S(0)", "→", "replicated"]
    assert lines[start + 2].split() == ["llama.layers.*.self_attn.q_proj.weight", "mp:S(1)", "→", "replicated"]
    assert start + 3 == len(lines)


def test_adding_a_pp_dim_does_not_move_parameters():
    old, new = layered_plan(layers=4, mp=2), layered_plan(layers=4, mp=2, pp=2)
    lines = diff_plans(old, new)
    assert "mesh: mp 2 → pp × mp 2 × 2" in lines
    assert not any("changed placement" in line for line in lines)
    stage_lines = lines[lines.index("6 parameters changed pipeline stage:") + 1 :]
    assert stage_lines[0].split() == ["llama.layers.{2-3}.input_layernorm.weight", "stage", "0", "→", "stage", "1"]
    assert "1 hook added:" in lines


def test_added_removed_parameters_and_notes():
    old, new = layered_plan(layers=2), layered_plan(layers=3)
    new.notes = ["layer 'pool' matched no pattern"]
    lines = diff_plans(old, new)
    assert "3 parameters added:" in lines
    assert "  llama.layers.2.input_layernorm.weight" in lines
    assert "note added: layer 'pool' matched no pattern" in lines
    assert any(line.startswith("model: num_parameters") for line in lines)


def test_any_difference_is_reported():
    # a change no describer words specially (a hook's reason) still makes the plans differ
    old = layered_plan(layers=2)
    new = msgspec.structs.replace(
        old, hooks=[Reshard(layer="llama.layers.0", when="post", placements=["R"], reason="x")]
    )
    newer = msgspec.structs.replace(new, hooks=[msgspec.structs.replace(new.hooks[0], reason="y")])
    assert dump_plan(new) != dump_plan(newer)
    assert diff_plans(new, newer) == ["hooks: changed"]
    assert diff_plans(old, new)[0] == "1 hook added:"


def test_error_exit_2(tmp_path):
    good = tmp_path / "good.json"
    save_plan(load_plan(EXAMPLE), good)
    result = CliRunner().invoke(diff, [str(good), str(tmp_path / "missing.json")])
    assert result.exit_code == 2
    assert result.output.startswith("error: ") and "missing.json" in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_help_has_an_example():
    result = CliRunner().invoke(diff, ["--help"])
    assert result.exit_code == 0 and "autodist-plan diff" in result.output
