"""Which fused kernels a model selects, and which of them the target device runs.

On a GPU a model often runs kernels the CPU trace never shows: ``F.scaled_dot_product_attention``
traces to matmul / softmax / matmul on CPU but runs flash attention on a GPU
(docs/paddle-notes.md, "Tracing"); PaddleFormers' ``fuse_rms_norm`` path does not trace on CPU
at all. The planner prices what the target runs, so it records what the model *selects*:

- **calls** the trace sees: a call to one of :data:`KERNEL_FUNCTIONS` (whatever ops it traces
  to) marks the ops it added with that kernel (:func:`autodist.planner.trace.trace_model`);
- **config flags** of the model's layers (:data:`CONFIG_FLAGS`, PaddleFormers' and PaddleNLP's
  names): a flag that selects a kernel whose path does not trace on CPU is turned off for the
  trace (the eager path is traced) and put back afterwards; the selection is kept for pricing.

:func:`choose_kernels` then decides what the plan is priced with: a device that runs fused
kernels (``DeviceProfile.fused_kernels``: the named GPU profiles) runs what the model selects;
a CPU runs what was traced. ``--attention flash|eager`` says what runs when the planner cannot
know (a model that picks its kernel at run time).

Example::

    >>> from autodist.planner.cost.hardware import PROFILES
    >>> selected = {"attention": "calls F.scaled_dot_product_attention (layers.0.attn)"}
    >>> choose_kernels(selected, PROFILES["h100-sxm"], "auto").attention
    'flash'
    >>> choose_kernels(selected, PROFILES["cpu"], "auto").attention
    'eager'
    >>> choose_kernels({}, PROFILES["h100-sxm"], "flash").reason
    '--attention flash'
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import msgspec

from autodist.planner.errors import PlannerError
from autodist.schemas import DeviceProfile, Kernels, printable

#: ``--attention``: what the attention cores are priced as.
ATTENTION_CHOICES = ("auto", "flash", "eager")

#: Fused kernels besides attention, as the plan's ``kernels.fused`` names them.
FUSED_NAMES = ("rms_norm", "rope", "swiglu")


def kernel_functions() -> dict[object, str]:
    """Paddle functions that run one fused kernel on a GPU -> the kernel's name. Looked up by
    identity, so a model that imported the function under another name is seen too."""
    import paddle.incubate.nn.functional as incubate
    import paddle.nn.functional as F
    import paddle.nn.functional.flash_attention as flash

    found: dict[object, str] = {}
    for module, names, kernel in (
        (F, ("scaled_dot_product_attention", "flash_attention", "flashmask_attention"), "attention"),
        (flash, ("flash_attention", "flash_attn_unpadded", "flash_attn_qkvpacked", "flashmask_attention"), "attention"),
        (incubate, ("fused_rms_norm", "fused_rms_norm_ext"), "rms_norm"),
        (incubate, ("fused_rotary_position_embedding",), "rope"),
        (incubate, ("swiglu",), "swiglu"),
        (F, ("swiglu",), "swiglu"),
    ):
        for name in names:
            function = getattr(module, name, None)
            if function is not None:
                found[function] = kernel
    return found


#: Config attributes that select a fused kernel on a GPU: name -> (kernel, value when the config
#: lacks it, whether the CPU trace must take the eager path instead). ``fuse_rms_norm``: what
#: PaddleFormers' ``GeneralNorm`` reads, ``config.get("fuse_rms_norm", True)``, whose fused
#: kernel rejects float32 while tracing on CPU. ``use_flash_attention``: PaddleNLP's and older
#: PaddleFormers' attention switch. ``fuse_swiglu`` (PaddleFormers) and ``use_fused_rope``
#: (PaddleNLP) select kernels that trace as one op on CPU too: recorded, already priced as one op.
CONFIG_FLAGS: dict[str, tuple[str, bool, bool]] = {
    "use_flash_attention": ("attention", False, False),
    "fuse_rms_norm": ("rms_norm", True, True),
    "fuse_swiglu": ("swiglu", False, False),
    "use_fused_rope": ("rope", False, False),
}
#: PaddleFormers' ``config._attn_implementation`` values that run a fused attention kernel.
FUSED_ATTENTION_IMPLEMENTATIONS = frozenset({"sdpa", "flashmask", "flash_attention_2"})


def _configs(model) -> dict[int, tuple[str, object]]:
    """The distinct config objects the model's layers hold (``layer.config``), by id, with the
    first layer holding each."""
    found: dict[int, tuple[str, object]] = {}
    for name, layer in model.named_sublayers(include_self=True):
        config = layer.__dict__.get("config")
        if config is not None and hasattr(config, "__dict__") and id(config) not in found:
            found[id(config)] = (name or type(model).__name__, config)
    return found


def _flag(config, name: str, default: bool) -> object:
    """The flag as the model reads it (a PaddleFormers config answers ``get``; a plain object its
    attribute), ``default`` when absent."""
    values = vars(config)
    return values[name] if name in values else default


@contextmanager
def eager_path(model) -> Iterator[dict[str, str]]:
    """For the ``with`` body: the kernels the model's config flags select (kernel -> why, filled
    on entry), with each flag whose fused path does not trace on CPU turned off; every config
    exactly as it was on exit."""
    selected: dict[str, str] = {}
    restore: list[tuple[object, str, bool, object]] = []
    for owner, config in _configs(model).values():
        is_paddleformers = type(config).__module__.startswith(("paddleformers.", "paddlenlp."))
        for name, (kernel, default, eager) in CONFIG_FLAGS.items():
            present = name in vars(config)
            if not present and not is_paddleformers:
                continue
            value = _flag(config, name, default)
            if isinstance(value, (bool, int)) and value:
                where = f"{name}={value}" if present else f"{name} (PaddleFormers' default: True)"
                selected.setdefault(kernel, f"config {where} ({owner})")
                if eager:
                    restore.append((config, name, present, vars(config).get(name)))
                    setattr(config, name, False)
        implementation = vars(config).get("_attn_implementation")
        if implementation in FUSED_ATTENTION_IMPLEMENTATIONS:
            selected.setdefault("attention", f"config _attn_implementation={implementation!r} ({owner})")
    try:
        yield selected
    finally:
        for config, name, present, value in reversed(restore):
            if present:
                setattr(config, name, value)
            else:
                delattr(config, name)


@contextmanager
def recorded_calls(block_ops) -> Iterator[list[tuple[str, list]]]:
    """For the ``with`` body (a dy2static trace): every call the converted code makes to one of
    :func:`kernel_functions`, as ``(kernel, the ops it added)``; ``block_ops()`` is the program's
    op list so far. dy2static routes every call in converted code through
    ``paddle.jit.dy2static.Call``, so that is where the calls are seen."""
    import paddle.jit.dy2static as jst

    functions = kernel_functions()
    calls: list[tuple[str, list]] = []
    convert = jst.Call

    def call(func):
        kernel = functions.get(func) if _hashable(func) else None
        if kernel is None:
            return convert(func)

        def recorded(*args, **kwargs):
            start = len(block_ops())
            out = func(*args, **kwargs)
            calls.append((kernel, block_ops()[start:]))  # op objects: they outlive list edits
            return out

        return recorded

    jst.Call = call
    try:
        yield calls
    finally:
        jst.Call = convert


def _hashable(value: object) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


def choose_kernels(selected: dict[str, str], device: DeviceProfile, attention: str = "auto") -> Kernels:
    """What the plan is priced with (the plan's ``kernels``): ``selected`` is what the model
    selects (kernel -> why), ``attention`` the ``--attention`` option (see the module docstring)."""
    if attention not in ATTENTION_CHOICES:
        raise PlannerError(f"attention must be one of {', '.join(ATTENTION_CHOICES)}, got {printable(repr(attention))}")
    fused = device.fused_kernels
    if attention != "auto":
        choice, reason = attention, f"--attention {attention}"
    elif "attention" in selected and fused:
        choice, reason = "flash", f"the model selects it: {selected['attention']}"
    elif "attention" in selected:
        choice, reason = (
            "eager",
            f"{device.name} runs no fused kernels (the model selects one: {selected['attention']})",
        )
    else:
        choice, reason = "eager", "the model selects no fused attention"
    others = sorted(k for k in selected if k in FUSED_NAMES) if fused else []
    return msgspec.convert({"attention": choice, "reason": reason, "fused": others}, Kernels)
