"""Device profiles and cluster files (planner/cost/hardware.py)."""

from __future__ import annotations

import pytest

from autodist.planner.cost.hardware import PROFILES, load_cluster_file, resolve_device
from autodist.planner.errors import PlannerError

FULL_FILE = """
[device]
name = "lab-cluster"
memory_gb = 24
peak_tflops_bf16 = 100
peak_tflops_fp16 = 100
peak_tflops_fp32 = 25
intra_node_bandwidth_gb_s = 64
inter_node_bandwidth_gb_s = 12.5
intra_node_latency_us = 4
inter_node_latency_us = 10
"""


def test_required_profiles_exist_with_sane_published_figures():
    for name in ("a100-40g", "a100-80g", "h100-sxm", "h200", "cpu"):
        device = resolve_device(name)
        assert device.name == name
        assert device.peak_flops["bf16"] >= device.peak_flops["fp32"] > 0
        # NVLink-class links inside a node are faster and have lower latency than the network.
        assert device.intra_node_bandwidth > device.inter_node_bandwidth > 0
        assert device.inter_node_latency_s >= device.intra_node_latency_s > 0
    assert PROFILES["h200"].memory_bytes > PROFILES["h100-sxm"].memory_bytes == PROFILES["a100-80g"].memory_bytes
    assert PROFILES["h100-sxm"].peak_flops["bf16"] > 3 * PROFILES["a100-80g"].peak_flops["bf16"]


def test_names_are_case_insensitive_and_unknown_ones_list_the_known():
    assert resolve_device("H100-SXM") == PROFILES["h100-sxm"]
    with pytest.raises(PlannerError, match="unknown device 'v100'; known: a100-40g, a100-80g, cpu, h100-sxm, h200"):
        resolve_device("v100")


def test_default_is_this_machines_cpu_on_a_machine_without_gpu():
    import paddle

    if paddle.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0:
        pytest.skip("this machine has a GPU: the default is its own profile")
    assert resolve_device() == PROFILES["cpu"]


def test_cluster_file_gives_every_figure_in_si_units(tmp_path):
    path = tmp_path / "cluster.toml"
    path.write_text(FULL_FILE)
    device = resolve_device(cluster_file=str(path))
    assert device.name == "lab-cluster"
    assert device.memory_bytes == 24_000_000_000
    assert device.peak_flops == {"bf16": 100e12, "fp16": 100e12, "fp32": 25e12}
    assert device.intra_node_bandwidth == 64e9 and device.inter_node_bandwidth == 12.5e9
    assert device.intra_node_latency_s == pytest.approx(4e-6) and device.inter_node_latency_s == pytest.approx(10e-6)


def test_cluster_file_can_start_from_a_named_profile(tmp_path):
    path = tmp_path / "slow-ib.toml"
    path.write_text('[device]\nbase = "h100-sxm"\ninter_node_bandwidth_gb_s = 25\n')
    device = load_cluster_file(str(path))
    assert device.name == "slow-ib"  # the file's stem when no name is given
    assert device.inter_node_bandwidth == 25e9
    assert device.peak_flops == PROFILES["h100-sxm"].peak_flops
    assert device.memory_bytes == PROFILES["h100-sxm"].memory_bytes


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[device]\nmemory_gb = 80\n", "is missing peak_tflops_bf16"),
        ("[device]\nbase = 'h100-sxm'\nmemory_gb = -1\n", r"\[device\].memory_gb must be a positive, finite number"),
        ("[device]\nbase = 'h100-sxm'\nmemory_gb = '80'\n", "must be a positive, finite number"),
        ("[device]\nbase = 'h100-sxm'\nmemroy_gb = 80\n", "unknown key.*memroy_gb"),
        ("[device]\nbase = 'tpu'\n", "unknown device 'tpu'"),
        ("memory_gb = 80\n", r"needs a \[device\] table"),
        ("[device\n", "not valid TOML"),
    ],
)
def test_bad_cluster_files_get_one_clear_error(tmp_path, text, message):
    path = tmp_path / "cluster.toml"
    path.write_text(text)
    with pytest.raises(PlannerError, match=message):
        load_cluster_file(str(path))


def test_missing_cluster_file_and_both_options_are_errors(tmp_path):
    with pytest.raises(PlannerError, match="cannot read the cluster file: No such file"):
        resolve_device(cluster_file=str(tmp_path / "nope.toml"))
    with pytest.raises(PlannerError, match="either --device or --cluster"):
        resolve_device("h200", cluster_file=str(tmp_path / "nope.toml"))


@pytest.mark.parametrize(
    ("cuda_name", "profile"),
    [
        ("NVIDIA H200", "h200"),
        ("NVIDIA H100 80GB HBM3", "h100-sxm"),
        ("NVIDIA A100-SXM4-80GB", "a100-80g"),
        ("NVIDIA A100 80GB PCIe", "a100-80g"),
        ("NVIDIA A100-SXM4-40GB", "a100-40g"),
        ("Tesla V100-SXM2-32GB", None),
    ],
)
def test_local_gpu_names_map_to_profiles(cuda_name, profile):
    from autodist.planner.cost.hardware import profile_for_cuda_name

    assert profile_for_cuda_name(cuda_name) == profile


def test_named_profiles_are_cluster_files_a_user_can_copy(tmp_path):
    """Each named profile is a file in the --cluster format: a copy of it plans like the name."""
    from autodist.planner.cost.hardware import DEVICES_DIR

    assert sorted(p.stem for p in DEVICES_DIR.glob("*.toml")) == sorted(PROFILES)
    copy = tmp_path / "mine.toml"
    copy.write_text((DEVICES_DIR / "h100-sxm.toml").read_text())
    assert resolve_device(cluster_file=str(copy)) == PROFILES["h100-sxm"]
    # The published figures, read back from the data file (H100 SXM5 datasheet).
    h100 = PROFILES["h100-sxm"]
    assert (h100.memory_bytes, h100.peak_flops["bf16"], h100.intra_node_bandwidth) == (80 * 10**9, 989e12, 450e9)


def test_this_machines_device_is_probed_once_and_its_note_comes_with_it(monkeypatch):
    from autodist.planner.cost import hardware

    probes = []
    monkeypatch.setattr(hardware, "local_cuda_name", lambda: probes.append(1) or "Tesla V100-SXM2-16GB")
    profile, note = hardware.planned_device()
    assert profile == PROFILES["h100-sxm"] and "has no profile: assumed h100-sxm" in note and len(probes) == 1
    assert hardware.planned_device("a100-80g") == (PROFILES["a100-80g"], "") and len(probes) == 1


def test_a_cpu_plan_takes_this_machines_memory_shared_by_its_ranks():
    """The cpu profile's 16 GB is a placeholder (it said "14.9 GiB each" on a 23 GiB machine): a
    plan for the cpu device takes this machine's memory (MemTotal, or a container's limit) over
    the ranks of a node, and says so; the profile itself and named GPUs stay as published."""
    from pathlib import Path

    from autodist.planner.cost.hardware import planned_device

    meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    total = int(meminfo["MemTotal"].split()[0]) * 1024
    limit = Path("/sys/fs/cgroup/memory.max")
    if limit.exists() and limit.read_text().strip().isdigit():
        total = min(total, int(limit.read_text()))
    profile, note = planned_device("cpu", None, 3)
    assert profile.memory_bytes == total // 3
    assert note == (
        f"memory: this machine's {total / 2**30:.1f} GiB shared by the 3 rank(s) of a node, "
        f"{total // 3 / 2**30:.1f} GiB each"
    )
    assert planned_device("cpu")[0] == PROFILES["cpu"]
    assert planned_device("h100-sxm", None, 3)[0] == PROFILES["h100-sxm"]
