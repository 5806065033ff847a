"""Device profiles: named ones with published figures, or a ``cluster.toml`` the user writes.

The named profiles are data: ``devices/<name>.toml``, in the same format as ``--cluster``
(a ``[device]`` table, see :func:`load_cluster_file`), so adding a device is adding a file.

Every figure is per device (one GPU) and per direction. Memory is the datasheet's "GB" read as
10^9 bytes, which is slightly less than the device really has (80 GB HBM reports 81 559 MiB):
the planner should err towards "does not fit", never towards an out-of-memory crash.
Peak FLOP/s are the dense (no 2:4 sparsity) tensor-core figures; fp32 is the plain (non-TF32)
CUDA-core figure, because an fp32 run does not silently get TF32 in Paddle by default.
Inter-node bandwidth is one InfiniBand NIC per GPU, as in the DGX systems the datasheets describe.
Latencies are not on datasheets: they are the per-step costs NCCL shows in ``nccl-tests``
(a few microseconds over NVLink, more over InfiniBand), used as the alpha of the alpha-beta model.
Memory bandwidth is the datasheet's. How the GPUs' matmuls run (``matmul_efficiency``, the
fraction of peak large matmuls sustain, and ``op_overhead_us``, the fixed cost of every op;
:mod:`autodist.planner.cost.compute`) is not on datasheets: the efficiency is fitted on
published runs (``bench/published.py --fit``, rows in docs/benchmarks.md, "Cost model against
published runs"): the a100 files' on Megatron-LM's A100 runs (Narayanan et al., SC 2021,
table 1), h100-sxm's on Megatron-LM's H100 runs (its README's weak-scaling table); h200 (the
H100's compute, no published runs of its own) takes the H100 fit. The fixed cost, 5 us, is a
kernel launch's few microseconds, which those runs (all large matmuls) cannot pin down. ``autodist-plan
calibrate`` measures both on the user's own devices, and with ``--model`` the
``dispatch_overhead_us`` a real training step shows, per kind of strategy too (data, tensor or
hybrid parallel: ``data_parallel_dispatch_overhead_us`` ...; 0 and left out in the named
profiles: on a GPU the host dispatches ahead of the kernels, so it hides behind them).

``overlap_compute_loss`` is the fraction of compute speed lost while a collective runs beside
it (``step_time.overlapped``: communication hidden under compute still costs this much of it).
On the GPUs, NCCL's share of the SMs: a collective's kernel runs one CTA (thread block) per
channel (NCCL's docs, ``NCCL_MAX_NCHANNELS``: fewer channels, fewer CUDA blocks, "hence the
impact on GPU computing resources"), at most ``MAXCHANNELS`` of them, 32 in NCCL 2.18-2.24
(``src/include/devcomm.h``, later ``device.h``; the default ``maxCTAs``; 64 since 2.25), the
versions of the runs in docs/benchmarks.md; a large collective uses them all, and the GEMM
beside it runs on the other SMs: 32 / 132 = 0.24 on H100 and H200 (132 SMs), 32 / 108 = 0.30
on A100 (108 SMs). An upper bound on the SMs, and a lower one on the loss where the collective
also takes memory bandwidth; not fitted on any published run. On the ``cpu`` profile 1: gloo
runs each collective on the thread that computes (``comm_overlap`` false), so nothing overlaps.
``autodist-plan calibrate`` measures it on GPUs (a matmul alone and beside NCCL all-reduces).

Example::

    >>> resolve_device("h100-sxm").peak_flops["bf16"]
    989000000000000.0
"""

from __future__ import annotations

import os
from pathlib import Path

from msgspec.structs import replace

from autodist.planner.errors import PlannerError
from autodist.schemas import DeviceProfile, Strategy, printable
from autodist.schemas.parallel_dims import OPERATIONS, needs_missing
from autodist.schemas.inputs import InputFileError, load_toml

GB = 10**9
TFLOPS = 1e12
GB_PER_S = 1e9
US = 1e-6

#: Profile used when no --device / --cluster is given and the planning machine has a GPU without
#: a profile of its own (:func:`default_device`); the search's default in tests and what-ifs.
FALLBACK_DEVICE = "h100-sxm"

#: The named profiles: one file each in ``devices/``, in the format ``--cluster`` reads (each
#: file's comments cite its datasheet).
DEVICES_DIR = Path(__file__).resolve().parent / "devices"


def _named_profiles() -> dict[str, DeviceProfile]:
    return {path.stem: load_cluster_file(str(path)) for path in sorted(DEVICES_DIR.glob("*.toml"))}


#: Substrings of CUDA device names (``paddle.device.cuda.get_device_name()``) -> profile.
#: Checked in order, so the more specific names come first.
_CUDA_NAME_TO_PROFILE = (
    ("H200", "h200"),
    ("H100", "h100-sxm"),
    ("A100-SXM4-80GB", "a100-80g"),
    ("A100 80GB", "a100-80g"),
    ("A100-PCIE-80GB", "a100-80g"),
    ("A100", "a100-40g"),
)

#: The largest figure a cluster file may give, in SI units (bytes, FLOP/s, bytes/s, seconds):
#: far above any device, and small enough that every estimate stays a finite number.
MAX_FIGURE = 1e18
#: The smallest non-zero figure, in the file's own units (1 kB/s, 1 MFLOP/s, 1 picosecond): a
#: smaller one (a denormal such as 5e-324) would make estimates overflow to infinity.
MIN_FIGURE = 1e-6

#: cluster.toml keys under ``[device]``, their unit factor and what they mean.
_CLUSTER_KEYS = {
    "memory_gb": (GB, "device memory in GB (10^9 bytes)"),
    "peak_tflops_bf16": (TFLOPS, "peak dense bf16 TFLOP/s"),
    "peak_tflops_fp16": (TFLOPS, "peak dense fp16 TFLOP/s"),
    "peak_tflops_fp32": (TFLOPS, "peak fp32 TFLOP/s"),
    "intra_node_bandwidth_gb_s": (GB_PER_S, "per-device bandwidth inside a node, GB/s per direction"),
    "inter_node_bandwidth_gb_s": (GB_PER_S, "per-device bandwidth between nodes, GB/s per direction"),
    "intra_node_latency_us": (US, "latency of one transfer inside a node, microseconds"),
    "inter_node_latency_us": (US, "latency of one transfer between nodes, microseconds"),
    "intra_node_latency_per_rank_us": (
        US,
        "how much one ring step's latency inside a node grows per rank of the group beyond two, microseconds",
    ),
    "inter_node_latency_per_rank_us": (
        US,
        "how much one ring step's latency between nodes grows per rank of the group beyond two, microseconds",
    ),
    "memory_bandwidth_gb_s": (GB_PER_S, "device memory bandwidth, GB/s"),
    "matmul_efficiency": (1.0, "fraction of peak FLOP/s large matmuls sustain"),
    "op_overhead_us": (US, "fixed cost of every op (launch, dispatch), microseconds"),
    "dispatch_overhead_us": (
        US,
        "framework time per op a real training step adds (calibrate --model), for every kind of strategy "
        "without its own figure, microseconds",
    ),
    "data_parallel_dispatch_overhead_us": (US, "the same without tensor parallelism (mp = 1), microseconds"),
    "tensor_parallel_dispatch_overhead_us": (US, "the same with tensor parallelism alone (dp = 1), microseconds"),
    "hybrid_dispatch_overhead_us": (US, "the same with data and tensor parallelism (dp > 1, mp > 1), microseconds"),
    "overlap_compute_loss": (1.0, "fraction of compute speed lost while a collective runs beside it"),
}
#: Keys a file without ``base`` may leave out (the plan format has defaults), and their fields.
_OPTIONAL_FIELDS = {
    "intra_node_latency_per_rank_us": "intra_node_latency_per_rank_s",
    "inter_node_latency_per_rank_us": "inter_node_latency_per_rank_s",
    "memory_bandwidth_gb_s": "memory_bandwidth",
    "matmul_efficiency": "matmul_efficiency",
    "op_overhead_us": "op_overhead_s",
    "dispatch_overhead_us": "dispatch_overhead_s",
    "data_parallel_dispatch_overhead_us": "data_parallel_dispatch_overhead_s",
    "tensor_parallel_dispatch_overhead_us": "tensor_parallel_dispatch_overhead_s",
    "hybrid_dispatch_overhead_us": "hybrid_dispatch_overhead_s",
    "overlap_compute_loss": "overlap_compute_loss",
}
#: Keys that may be 0 (no fixed cost is a fixed cost); every other figure must be positive.
_ZERO_OK = frozenset(
    {
        "op_overhead_us",
        "dispatch_overhead_us",
        "data_parallel_dispatch_overhead_us",
        "tensor_parallel_dispatch_overhead_us",
        "hybrid_dispatch_overhead_us",
        "intra_node_latency_per_rank_us",
        "inter_node_latency_per_rank_us",
        "overlap_compute_loss",
    }
)
#: Keys that are fractions: at most 1.
_FRACTIONS = frozenset({"matmul_efficiency", "overlap_compute_loss"})


def resolve_device(name: str | None = None, cluster_file: str | None = None) -> DeviceProfile:
    """The device profile to plan for: a cluster file, a named profile, or the local GPU.

    Without either argument: the planning machine's own device (:func:`default_device`).

    Example::

        >>> resolve_device("a100-80g").memory_bytes
        80000000000
        >>> resolve_device("tpu")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        autodist.planner.errors.PlannerError: unknown device 'tpu'; known: a100-40g, a100-80g, ... (or give --cluster ...)
    """
    return planned_device(name, cluster_file)[0]


def planned_device(
    name: str | None = None, cluster_file: str | None = None, devices_per_node: int | None = None
) -> tuple[DeviceProfile, str]:
    """``(profile, note)``: :func:`resolve_device`'s profile and, when neither a name nor a cluster
    file is given, what the plan's notes say about the machine's own device (:func:`default_device`,
    probed once); the note is '' when the caller named the device.

    With ``devices_per_node`` (a plan's: the command and :func:`autodist.plan`), the ``cpu``
    profile's memory is this machine's, shared by that many ranks (:func:`this_machines_memory`),
    and the note says so: a CPU plan is for machines like the one it is made on, and records
    the figure, so the plan file stays what it was wherever it is read.

    >>> planned_device("h200")[0].name, planned_device("h200")[1]
    ('h200', '')
    """
    profile, note = _named_or_default(name, cluster_file)
    if devices_per_node is None or cluster_file is not None or profile.name != "cpu":
        return profile, note
    total = this_machines_memory()
    share = total // max(devices_per_node, 1)
    said = (
        f"memory: this machine's {total / 2**30:.1f} GiB shared by the {devices_per_node} rank(s) of a node, "
        f"{share / 2**30:.1f} GiB each"
    )
    return replace(profile, memory_bytes=share), "; ".join(filter(None, [note, said]))


def this_machines_memory() -> int:
    """Bytes of memory this machine gives its processes: its physical memory, or less where a
    control group (a container) limits it (cgroup v2 ``memory.max``)."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
    except OSError:
        return total
    return min(total, int(limit)) if limit.isdigit() else total


def _named_or_default(name: str | None, cluster_file: str | None) -> tuple[DeviceProfile, str]:
    if name is not None and cluster_file is not None:
        raise PlannerError("give either --device or --cluster, not both")
    if cluster_file is not None:
        return load_cluster_file(cluster_file), ""
    note = ""
    if name is None:
        name, note = default_device()
    key = name.lower()
    if key not in PROFILES:
        known = ", ".join(sorted(PROFILES))
        raise PlannerError(f"unknown device {name!r}; known: {known} (or give --cluster cluster.toml)")
    return PROFILES[key], note


def default_device() -> tuple[str, str]:
    """``(profile name, what the plan's notes and the command say about it)`` when no --device
    and no --cluster is given: this machine, where a plan is most likely tried first. Its GPU's
    profile; with no GPU the ``cpu`` profile (gloo), so the plan is one apply_plan can run here
    (no pipeline, ZeRO or sequence parallelism); an unknown GPU gets ``h100-sxm``, said as an
    assumption."""
    cuda_name = local_cuda_name()
    if cuda_name is None:
        return "cpu", (
            "device: no --device or --cluster, and no GPU here: planned for this machine's CPU (the cpu profile, "
            "gloo, which has no pipeline, ZeRO or sequence parallelism); give --device for the GPUs the plan is for"
        )
    name = profile_for_cuda_name(cuda_name)
    if name is not None:
        return name, f"device: no --device or --cluster: planned for this machine's GPU ({name})"
    return FALLBACK_DEVICE, (
        f"device: no --device or --cluster, and this machine's GPU has no profile: assumed {FALLBACK_DEVICE}; "
        "give --device or --cluster"
    )


def local_cuda_name() -> str | None:
    """The CUDA name of this machine's first GPU, or None without one: the one probe of the
    planning machine's device."""
    import paddle  # the planner imports paddle anyway; kept local so profiles load without it

    if not paddle.is_compiled_with_cuda() or paddle.device.cuda.device_count() == 0:
        return None
    return paddle.device.cuda.get_device_name(0)


def profile_for_cuda_name(cuda_name: str) -> str | None:
    """The profile for a CUDA device name as the driver reports it, or None.

    >>> profile_for_cuda_name("NVIDIA H100 80GB HBM3"), profile_for_cuda_name("Tesla V100-SXM2-16GB")
    ('h100-sxm', None)
    """
    for fragment, profile in _CUDA_NAME_TO_PROFILE:
        if fragment in cuda_name:
            return profile
    return None


def load_cluster_file(path: str) -> DeviceProfile:
    """Read a device profile from a TOML file.

    ``base = "h100-sxm"`` starts from a named profile and the other keys override it; without
    a base every key is required. Example file::

        [device]
        name = "my-h100-cluster"
        base = "h100-sxm"
        inter_node_bandwidth_gb_s = 25   # only 200 Gb/s InfiniBand here
        inter_node_latency_us = 8
    """
    return device_profile(_read_cluster_file(path), path)


def device_profile(tables: dict, path: str) -> DeviceProfile:
    """The device profile of a cluster file's decoded TOML ``tables``, read from ``path`` (named in
    the messages; its stem is the default name). :func:`load_cluster_file` after reading; also
    for a cluster file not written yet (``calibrate`` prices its own result before writing it)."""
    source = Path(path)
    device = tables.get("device")
    if not isinstance(device, dict):
        raise PlannerError(f"{path}: needs a [device] table with: {', '.join(_CLUSTER_KEYS)}")
    flags = {"comm_overlap": "whether collectives run beside compute", "fused_kernels": _FUSED_KERNELS}
    unknown = sorted(set(device) - set(_CLUSTER_KEYS) - {"name", "base", "unsupported", *flags})
    if unknown:
        raise PlannerError(
            f"{path}: unknown key(s) in [device]: {', '.join(unknown)}; known: "
            f"name, base, unsupported, {', '.join(flags)}, {', '.join(_CLUSTER_KEYS)}"
        )
    for key in ("name", "base"):
        if key in device and not (isinstance(device[key], str) and device[key].isprintable()):
            raise PlannerError(
                f"{path}: [device].{key} must be a string of printable characters, got {printable(repr(device[key]))}"
            )
    values = _profile_values(resolve_device(device["base"])) if "base" in device else {}
    unsupported = device.get("unsupported", resolve_device(device["base"]).unsupported if "base" in device else [])
    if not (isinstance(unsupported, list) and set(unsupported) <= set(OPERATIONS)):
        raise PlannerError(
            f"{path}: [device].unsupported must be a list of {', '.join(OPERATIONS)}, "
            f"got {printable(repr(unsupported))}"
        )
    switches = {key: device.get(key, values.pop(key, True)) for key in flags}
    for key, value in switches.items():
        if not isinstance(value, bool):
            raise PlannerError(
                f"{path}: [device].{key} must be true or false ({flags[key]}), got {printable(repr(value))}"
            )
    for key, (unit, meaning) in _CLUSTER_KEYS.items():
        if key not in device:
            continue
        raw = device[key]
        value = _si_value(raw, unit)
        lowest_ok = value >= 0 if key in _ZERO_OK else value >= MIN_FIGURE * unit
        most = 1.0 if key in _FRACTIONS else MAX_FIGURE
        if not (lowest_ok and value <= most):
            least = "0" if key in _ZERO_OK else f"{MIN_FIGURE:g}"
            raise PlannerError(
                f"{path}: [device].{key} must be a positive, finite number ({meaning}, at least {least} and at most "
                f"{most / unit:g}), "
                f"got {printable(repr(raw))}"
            )
        values[key] = raw * unit
    missing = [key for key in _CLUSTER_KEYS if key not in values and key not in _OPTIONAL_FIELDS]
    if missing:
        raise PlannerError(
            f"{path}: [device] is missing {', '.join(missing)} "
            '(or set base = "<profile>" to start from a named profile)'
        )
    return DeviceProfile(
        name=str(device.get("name", source.stem)),
        memory_bytes=int(values["memory_gb"]),
        peak_flops={
            "bf16": float(values["peak_tflops_bf16"]),
            "fp16": float(values["peak_tflops_fp16"]),
            "fp32": float(values["peak_tflops_fp32"]),
        },
        intra_node_bandwidth=float(values["intra_node_bandwidth_gb_s"]),
        inter_node_bandwidth=float(values["inter_node_bandwidth_gb_s"]),
        intra_node_latency_s=float(values["intra_node_latency_us"]),
        inter_node_latency_s=float(values["inter_node_latency_us"]),
        unsupported=sorted(set(unsupported)),
        **{field: float(values[key]) for key, field in _OPTIONAL_FIELDS.items() if values.get(key) is not None},
        comm_overlap=switches["comm_overlap"],
        fused_kernels=switches["fused_kernels"],
    )


#: What ``fused_kernels`` in a cluster file means (planner/kernels.py).
_FUSED_KERNELS = "whether the device runs the fused kernels a model selects, flash attention among them"


def _read_cluster_file(path: str) -> dict:
    """The TOML tables of a cluster file, read within bounds (:func:`autodist.schemas.inputs.load_toml`);
    a file that cannot be read is one PlannerError."""
    try:
        return load_toml(path, what="cluster file")
    except InputFileError as err:
        raise PlannerError(str(err)) from None


#: cluster.toml keys under ``[cluster]``: the cluster's shape, and the flag that wins over each.
_SHAPE_KEYS = {"devices_per_node": "--nproc-per-node", "nodes": "--nnodes"}
#: More devices or nodes than this in a cluster file is a typo, not a cluster.
MAX_SHAPE = 1 << 20


def cluster_shape(cluster_file: str | None, devices: int | None = None, nodes: int | None = None) -> tuple[int, int]:
    """Devices per node and nodes to plan for: each flag when given, else the cluster file's
    ``[cluster]`` table, else 1. ``[cluster]`` is optional, and so is each of its keys::

        [cluster]
        nodes = 2
        devices_per_node = 8

    Example::

        >>> cluster_shape(None, devices=4)
        (4, 1)
    """
    table = _read_cluster_file(cluster_file).get("cluster", {}) if cluster_file else {}
    if not isinstance(table, dict):
        raise PlannerError(f"{cluster_file}: cluster must be a table ([cluster] with nodes, devices_per_node)")
    unknown = sorted(set(table) - set(_SHAPE_KEYS))
    if unknown:
        raise PlannerError(
            f"{cluster_file}: unknown key(s) in [cluster]: {printable(', '.join(unknown))}; "
            f"known: {', '.join(_SHAPE_KEYS)}"
        )
    shape = []
    for (key, flag), given in zip(_SHAPE_KEYS.items(), (devices, nodes)):
        value = table.get(key, 1)
        if not (type(value) is int and 1 <= value <= MAX_SHAPE):
            raise PlannerError(
                f"{cluster_file}: [cluster].{key} must be a whole number from 1 to {MAX_SHAPE} "
                f"(what {flag} gives), got {printable(repr(value))}"
            )
        shape.append(value if given is None else given)
    return shape[0], shape[1]


def _si_value(raw: object, unit: float) -> float:
    """``raw * unit`` as a float; NaN for what is not a number (so every bound refuses it)."""
    if isinstance(raw, bool) or not isinstance(raw, (int, float)):
        return float("nan")
    try:
        return float(raw) * unit
    except OverflowError:  # an integer beyond any float
        return float("inf")


PROFILES: dict[str, DeviceProfile] = _named_profiles()


def _profile_values(profile: DeviceProfile) -> dict[str, float]:
    """A profile in cluster-file keys (SI units), so a file can override some of them."""
    return {
        "memory_gb": profile.memory_bytes,
        "peak_tflops_bf16": profile.peak_flops["bf16"],
        "peak_tflops_fp16": profile.peak_flops["fp16"],
        "peak_tflops_fp32": profile.peak_flops["fp32"],
        "intra_node_bandwidth_gb_s": profile.intra_node_bandwidth,
        "inter_node_bandwidth_gb_s": profile.inter_node_bandwidth,
        "intra_node_latency_us": profile.intra_node_latency_s,
        "inter_node_latency_us": profile.inter_node_latency_s,
        **{key: getattr(profile, field) for key, field in _OPTIONAL_FIELDS.items()},
        "comm_overlap": profile.comm_overlap,
        "fused_kernels": profile.fused_kernels,
    }


def backend_problem(device: DeviceProfile, strategy: Strategy) -> str:
    """Why ``device``'s collective backend cannot run ``strategy``, or '' (what needs what:
    :func:`autodist.schemas.parallel_dims.needs_missing`, which apply_plan refuses by too).

    Expert parallelism needs nothing here: its dispatch and combine are an all-gather and an
    all-reduce, which every backend has (docs/recognition.md, "Experts").

    >>> backend_problem(PROFILES["cpu"], Strategy(dp=2, sharding_stage=2))
    'cpu cannot: ZeRO stage 2 needs reduce-scatter'
    >>> backend_problem(PROFILES["cpu"], Strategy(pp=2, micro_batches=2, schedule="1F1B"))
    'cpu cannot: the 1F1B schedule needs batched P2P (batch_isend_irecv)'
    >>> backend_problem(PROFILES["h100-sxm"], Strategy(mp=2, sequence_parallel=True))
    ''
    """
    missing: dict[str, list[str]] = {}
    for feature, operation in needs_missing(strategy, device.unsupported):
        missing.setdefault(feature, []).append(OPERATIONS[operation])
    if not missing:
        return ""
    return f"{device.name} cannot: " + "; ".join(f"{f} needs {' and '.join(ops)}" for f, ops in missing.items())


def pipeline_problem(device: DeviceProfile, pp: int) -> str:
    """Why no pipeline of ``pp`` stages runs on ``device``'s backend (it lacks both the sequential
    schedule's cross-mesh reshard and the 1F1B / VPP schedules' batched P2P), or ''.

    >>> pipeline_problem(PROFILES["cpu"], 2)
    'cpu cannot: a pipeline needs a reshard between two meshes (sequential) or batched P2P (1F1B, VPP)'
    """
    if pp == 1 or not {"cross_mesh_reshard", "batched_p2p"} <= set(device.unsupported):
        return ""
    return (
        f"{device.name} cannot: a pipeline needs a reshard between two meshes (sequential) or batched P2P (1F1B, VPP)"
    )
