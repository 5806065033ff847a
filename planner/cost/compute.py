"""How long one op takes on one device: matmuls by a roofline with a fixed cost, the rest by bytes.

A matmul of per-rank shape (m x k) @ (k x n), ``batch`` times over, with ``w``-byte elements:

    time = max(2 m n k batch / (e P),  w batch (m k + k n + m n) / B) + t0

- ``P`` is the device's peak FLOP/s for the dtype and ``e`` the fraction of it that large
  matmuls sustain (``DeviceProfile.matmul_efficiency``): the compute roof;
- ``B`` is its memory bandwidth (``DeviceProfile.memory_bandwidth``) and the bytes are the two
  operands read and the result written once: the memory roof, which thin matmuls hit
  (Williams, Waterman and Patterson, "Roofline", CACM 2009);
- ``t0`` (``DeviceProfile.op_overhead_s``) is a fixed cost of every op: kernel launch (and for
  a matmul the last, partly filled wave of thread blocks), and on a CPU the framework's
  dispatch. It is the saturation curve: the sustained rate 2mnk batch / time rises towards the
  roof as the work grows, and is half of it at a work of e P t0 FLOPs.

- ``td`` (``DeviceProfile.dispatch_overhead_s``) is the framework's time per op that a real
  training step shows on top of ``t0``: with eager auto-parallel on a CPU, every op runs SPMD
  rules and reshard checks on distributed tensors and its autograd bookkeeping, synchronously on
  the thread that computes, and when ranks outnumber cores each also waits for one. Op-level
  timings (``t0``) cannot see all of it, so ``autodist-plan calibrate --model`` times real
  training steps of the plan and fits ``td`` to what is left:
  ``td = (measured step - priced step at td = 0) / (ops priced per step)``
  (:func:`autodist.planner.cost.calibrate.fit_dispatch`). The named GPU profiles have 0: there
  the host dispatches ahead of the kernels, asynchronously, so it hides behind them.

  ``td`` is not one figure for every strategy: on 4 gloo ranks sharing 2 cores a step of
  dp2 x mp2 left 2.2-2.6x the time per op that dp4's did and 1.4-3.6x mp4's
  (docs/benchmarks.md, "Search quality"): what each rank waits for differs with which mesh axes
  split the work (dp4's ranks meet only at the gradient sums, mp4's all four at every
  tensor-parallel collective, dp2 x mp2's in two pairs that share the cores with each other).
  So a profile holds a figure per kind of strategy (:data:`DISPATCH_KINDS`: data parallel, mp 1;
  tensor parallel, dp 1 and mp > 1; hybrid, both above 1), each fitted on a strategy of that
  kind (calibrate times the plan and its siblings of the other kinds on the same ranks,
  :func:`autodist.planner.cost.calibrate.sibling_degrees`), and ``dispatch_overhead_s`` for a
  kind without one; a strategy's ops pay its kind's (:func:`as_run`).

Every op pays ``t0 + td`` once (:func:`fixed_op_time`): matmuls on top of their roofline, and
an op that is not a matmul (norms, elementwise, softmax, rotary, cross-entropy), which is
memory-bound: its time is the bytes it reads and writes over ``B``, plus that fixed cost. A device without a memory bandwidth
(``B`` = 0, a profile from before it was known) prices only the compute roof and these ops
at nothing.

Example (an H100-like device: 989 TFLOP/s, 60 % sustained, 3.35 TB/s, 5 us per matmul)::

    >>> from msgspec.structs import replace

from autodist.schemas import DeviceProfile
    >>> d = DeviceProfile(name="x", memory_bytes=1, peak_flops={"bf16": 989e12, "fp16": 989e12,
    ...                   "fp32": 67e12}, intra_node_bandwidth=1, inter_node_bandwidth=1,
    ...                   intra_node_latency_s=0, inter_node_latency_s=0, memory_bandwidth=3.35e12,
    ...                   matmul_efficiency=0.6, op_overhead_s=5e-6)
    >>> round(matmul_time(8192, 8192, 8192, d, "bf16") * 1e3, 3)    # compute-bound: 1.85 ms + 5 us
    1.858
    >>> round(matmul_time(8192, 8192, 1, d, "bf16") * 1e6, 1)       # a vector: bytes-bound
    45.1
"""

from __future__ import annotations

from msgspec.structs import replace

from autodist.schemas import DeviceProfile
from autodist.schemas.vocabulary import TrainingDType, training_bytes


def matmul_time(m: float, n: float, k: float, device: DeviceProfile, dtype: TrainingDType, batch: float = 1) -> float:
    """Seconds for ``batch`` matmuls of (m x k) @ (k x n), as one kernel (see the module docstring)."""
    if m <= 0 or n <= 0 or k <= 0 or batch <= 0:
        return 0.0
    compute = 2.0 * m * n * k * batch / (device.peak_flops[dtype] * device.matmul_efficiency)
    memory = memory_time(training_bytes(dtype) * batch * (m * k + k * n + m * n), device)
    return max(compute, memory) + fixed_op_time(device)


def fixed_op_time(device: DeviceProfile) -> float:
    """Seconds every op pays whatever its size: ``t0 + td`` (see the module docstring).

    >>> from autodist.planner.cost.hardware import PROFILES
    >>> from msgspec.structs import replace
    >>> round(fixed_op_time(replace(PROFILES["cpu"], op_overhead_s=20e-6, dispatch_overhead_s=30e-6)) * 1e6, 6)
    50.0
    """
    return device.op_overhead_s + device.dispatch_overhead_s


#: The kinds of strategy whose framework time per op is fitted apart (see the module docstring)
#: and the profile field holding each (None there: ``dispatch_overhead_s``).
DISPATCH_KINDS = {
    "data_parallel": "data_parallel_dispatch_overhead_s",  # mp = 1
    "tensor_parallel": "tensor_parallel_dispatch_overhead_s",  # dp = 1, mp > 1
    "hybrid": "hybrid_dispatch_overhead_s",  # dp > 1 and mp > 1
}


def dispatch_kind(dp: int, mp: int) -> str:
    """The kind of a strategy of degrees ``dp`` and ``mp`` (:data:`DISPATCH_KINDS`): the one
    owner of which kind a strategy is.

    >>> dispatch_kind(4, 1), dispatch_kind(1, 4), dispatch_kind(2, 2), dispatch_kind(1, 1)
    ('data_parallel', 'tensor_parallel', 'hybrid', 'data_parallel')
    """
    if mp == 1:
        return "data_parallel"
    return "tensor_parallel" if dp == 1 else "hybrid"


def as_run(device: DeviceProfile, dp: int, mp: int) -> DeviceProfile:
    """``device`` as a strategy of degrees ``dp`` and ``mp`` runs on it: its
    ``dispatch_overhead_s`` the framework time per op of that kind of strategy (of every kind
    the profile has no figure for), the only figure left, so that :func:`fixed_op_time` charges it.

    >>> from autodist.planner.cost.hardware import PROFILES
    >>> d = replace(PROFILES["cpu"], dispatch_overhead_s=300e-6, data_parallel_dispatch_overhead_s=120e-6)
    >>> [round(as_run(d, dp, mp).dispatch_overhead_s * 1e6, 6) for dp, mp in ((4, 1), (2, 2), (1, 4))]
    [120.0, 300.0, 300.0]
    """
    seconds = getattr(device, DISPATCH_KINDS[dispatch_kind(dp, mp)])
    return replace(
        device,
        dispatch_overhead_s=device.dispatch_overhead_s if seconds is None else seconds,
        **dict.fromkeys(DISPATCH_KINDS.values()),
    )


def overlap_loss(device: DeviceProfile) -> float:
    """The fraction of compute speed lost while a collective runs beside it, as the estimate
    prices it (:func:`autodist.planner.cost.step_time.overlapped`): the device's
    ``overlap_compute_loss`` where collectives run beside compute, 1 where they block the
    thread that computes (``comm_overlap`` false: gloo on CPU), so that nothing hides.

    >>> from autodist.planner.cost.hardware import PROFILES
    >>> overlap_loss(PROFILES["h100-sxm"]), overlap_loss(PROFILES["cpu"])
    (0.24, 1.0)
    """
    return device.overlap_compute_loss if device.comm_overlap else 1.0


def memory_time(nbytes: float, device: DeviceProfile) -> float:
    """Seconds to move ``nbytes`` through device memory (0 when the bandwidth is unknown).

    >>> from autodist.planner.cost.hardware import PROFILES
    >>> round(memory_time(3.35e9, PROFILES["h100-sxm"]) * 1e3, 3)   # 3.35 GB at 3.35 TB/s
    1.0
    """
    return nbytes / device.memory_bandwidth if device.memory_bandwidth > 0 else 0.0
