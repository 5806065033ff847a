"""Device limits: a profile says what its collective backend cannot do, and the search never
chooses a strategy that needs it (gloo on the CPU wheel: no reduce-scatter, no all-to-all, no
reshard between two meshes — docs/paddle-notes.md)."""

from __future__ import annotations


import pytest

from autodist.planner.cost.hardware import PROFILES, load_cluster_file
from autodist.planner.errors import PlannerError
from autodist.schemas import load_plan
from harness.cli import DOCSTRING, run, tiny_docstring  # noqa: F401 (autouse fixture)


def test_the_cpu_profile_says_what_gloo_lacks():
    assert PROFILES["cpu"].unsupported == ["all_to_all", "batched_p2p", "cross_mesh_reshard", "reduce_scatter"]
    assert PROFILES["h100-sxm"].unsupported == []


def test_a_cpu_plan_never_needs_what_gloo_lacks(tmp_path):
    """Found by a user: a --device cpu plan chose ZeRO-2 and died at the first backward
    (Unimplemented cpu kernel for CReduceScatterOp)."""
    out = tmp_path / "plan.json"
    result = run(DOCSTRING, "--devices", 4, "--device", "cpu", "--global-batch-size", 16, "-o", out)
    assert result.exit_code == 0, result.output
    plan = load_plan(out)
    for strategy in [plan.strategy, *(c.strategy for c in plan.alternatives.accepted)]:
        assert strategy.sharding_stage == 0 and not strategy.sequence_parallel and strategy.pp == 1, strategy
    assert plan.cluster.device.unsupported == ["all_to_all", "batched_p2p", "cross_mesh_reshard", "reduce_scatter"]
    assert any("its backend lacks" in note for note in plan.notes)
    assert any(r.strategy.pp > 1 and "cpu cannot: a pipeline" in r.reason for r in plan.alternatives.rejected)


def test_asking_for_what_the_backend_lacks_is_refused_with_the_reason(tmp_path):
    result = run(
        DOCSTRING, "--devices", 2, "--device", "cpu", "--mp", 2, "--sequence-parallel", "-o", tmp_path / "p.json"
    )
    assert result.exit_code != 0
    assert "cpu cannot: sequence parallelism needs reduce-scatter and all-to-all" in result.output
    assert not (tmp_path / "p.json").exists()


def test_a_cluster_file_may_name_what_its_backend_lacks(tmp_path):
    path = tmp_path / "cluster.toml"
    path.write_text('[device]\nname = "lab"\nbase = "h100-sxm"\nunsupported = ["all_to_all"]\n')
    assert load_cluster_file(str(path)).unsupported == ["all_to_all"]
    path.write_text('[device]\nname = "lab"\nbase = "cpu"\n')
    assert load_cluster_file(str(path)).unsupported == PROFILES["cpu"].unsupported  # inherited from the base
    path.write_text('[device]\nbase = "cpu"\nunsupported = ["teleport"]\n')
    with pytest.raises(
        PlannerError, match="unsupported must be a list of reduce_scatter, all_to_all, cross_mesh_reshard, batched_p2p"
    ):
        load_cluster_file(str(path))


@pytest.mark.skipif(
    __import__("paddle").device.cuda.device_count() > 0,
    reason="this machine has a GPU: its profile is used",
)
def test_without_device_or_gpu_the_plan_is_for_this_machines_cpu_and_says_so(tmp_path):
    """No --device on a CPU machine plans for the cpu profile (gloo), so the plan is one
    apply_plan runs here; the summary and the plan's notes say so. Named devices say nothing."""
    result = run(DOCSTRING, "--devices", 2, "-o", tmp_path / "p.json")
    assert result.exit_code == 0, result.output
    said = (
        "device: no --device or --cluster, and no GPU here: planned for this machine's CPU (the cpu profile, gloo, "
        "which has no pipeline, ZeRO or sequence parallelism); give --device for the GPUs the plan is for"
    )
    assert f"({said}; memory: this machine's " in result.stderr  # test_hardware: the figure
    plan = load_plan(tmp_path / "p.json")
    assert plan.cluster.device.name == "cpu" and any(note.startswith(f"{said}; memory: ") for note in plan.notes)
    assert plan.strategy.pp == 1 and plan.strategy.sharding_stage == 0 and not plan.strategy.sequence_parallel
    named = run(DOCSTRING, "--devices", 2, "--device", "h100-sxm", "-o", tmp_path / "q.json")
    assert "device:" not in named.stderr
    assert not any(note.startswith("device:") for note in load_plan(tmp_path / "q.json").notes)
