"""Trace a model to a PIR program and tell, for every op, which sub-layer ran it.

``paddle.jit.to_static(layer.forward, input_spec=..., full_graph=True)`` builds the program;
forward pre/post hooks on every sub-layer note the op count when the layer starts and ends,
so each op is attributed to the innermost layer whose range holds it (an op's ``struct_name``
attribute is the fallback). ``rollback()`` and hook removal leave the model as it was.

Some models do not trace whole (a forward dy2static cannot convert). Then the largest direct
child that traces is traced instead (``llama`` / ``model``), FQNs stay relative to the user's
model, and the other parameter-holding children (``lm_head``) are listed in ``untraced_layers``
for the analysis to place. PaddleFormers' ``...ForCausalLM`` classes used to be such models (a
``RecursionError`` from dy2static's rewrite of ``super()``); they trace whole now
(:func:`_dy2static_caches`, item 3). When no such child traces, the model is traced block by
block (:func:`_trace_by_blocks`: each layer alone, called as one eager forward called it, the
programs read as one), and the glue between the blocks runs as written.

A loop over the rows ``nonzero`` selects (HuggingFace's MoE blocks: only the experts that got
tokens) is traced as the loop over every row (:mod:`.dense_selection`).

Example::

    >>> traced = trace_model(model, [paddle.static.InputSpec([4, 16], "int64", "input_ids")])  # doctest: +SKIP
    >>> traced.op_layers[traced.ops.index(some_matmul)]  # doctest: +SKIP
    'layers.0.self_attn.q_proj'
"""

from __future__ import annotations

import ast
import dataclasses
import dis
import inspect
import math
import sys
import textwrap
import threading
import traceback
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import paddle

from autodist.applier.placement.hooks import first_input, first_tensor
from autodist.planner.dense_selection import every_selection_taken
from autodist.planner.errors import PlannerError, source_place
from autodist.planner.kernels import eager_path, recorded_calls
from autodist.schemas import dtype_name
from autodist.schemas.describe import layers_text


@dataclass
class TracedProgram:
    program: "paddle.pir.Program"
    ops: list  # the global block's ops, in program order
    op_layers: list[str]  # per op: FQN (relative to the user's model) of the innermost layer that ran it
    traced_layer: str  # FQN of the traced sub-layer, "" for the whole model
    param_fqns: dict[str, str]  # Parameter.name ("linear_0.w_0") -> FQN in the user's model
    untraced_layers: list[str] = field(default_factory=list)  # top-level children outside the traced one
    #: Why the whole model was not traced (a known tracing limit), "" when it was.
    fallback_reason: str = ""
    #: Inputs the model takes that the traced sub-layer does not (``labels``: they feed the
    #: untraced head's loss), by name.
    unused_inputs: list[str] = field(default_factory=list)
    #: Op index -> the fused kernel whose call added it (:mod:`autodist.planner.kernels`).
    kernel_ops: dict[int, str] = field(default_factory=dict)
    #: Fused kernels the model selects -> why (a call the trace saw, a config flag).
    selected_kernels: dict[str, str] = field(default_factory=dict)
    #: Layer FQN -> how the trace called it, call by call (:class:`LayerCall`).
    layer_calls: dict[str, list[LayerCall]] = field(default_factory=dict)
    #: What the traced forward returned, flattened: the program's output values.
    outputs: list = field(default_factory=list)
    #: Traced block by block (:func:`_trace_by_blocks`): the layers traced one by one, in the
    #: order the forward first called them; [] when one program holds the model (or ``traced_layer``).
    units: list[str] = field(default_factory=list)
    #: Per block: each unit's program, kept alive while ``ops`` are read; ``program`` is the first.
    unit_programs: list = field(default_factory=list)
    #: Per block: op index of a unit's input (``pd_op.data``) -> the ``(op index, result)`` it
    #: stands for (another unit's output, the first unit's copy of a model input, or a parameter
    #: traced before), or None for a value the glue between the units computed.
    bridges: dict[int, tuple[int, int] | None] = field(default_factory=dict)
    #: Layer FQN -> its first call's first tensor input and first tensor output (as
    #: ``applier.placement.hooks.first_input`` and ``first_tensor`` pick them: what a pipeline
    #: stage replaces and hands on), each the program value ``(op index, result)`` it is, or None
    #: (no tensor, or one the program does not hold). Read by ``recognise/chaining.py``.
    first_tensors: dict[str, tuple[tuple[int, int] | None, tuple[int, int] | None]] = field(default_factory=dict)
    #: The layers whose ``training`` flag the model's own code read while traced in eval mode
    #: (``if self.training:``, ``dropout if self.training else 0.0``): what training runs there
    #: may differ from what was traced, so the forward was traced again in train mode
    #: (:func:`trace_model`): ``training`` is that trace, or None with ``training_untraced``
    #: saying why it could not be made.
    training_readers: list[str] = field(default_factory=list)
    training: TracedProgram | None = None
    training_untraced: str = ""

    def fallback_text(self) -> str:
        """How the model was traced when its whole forward does not trace, in words ("" when it does).

        >>> traced = TracedProgram(None, [], [], "", {}, fallback_reason="TypeError: x", units=["embed", "h.0", "h.1", "head"])
        >>> traced.fallback_text().partition(", the whole")[0]
        'traced block by block (embed, h.0-1, head)'
        """
        if not self.fallback_reason:
            return ""
        if self.units:
            runs: list[list[str]] = []
            for unit in self.units:
                if runs and ", " not in layers_text([*runs[-1], unit]):
                    runs[-1].append(unit)
                else:
                    runs.append([unit])
            named = ", ".join(layers_text(run) for run in runs)
            return (
                f"traced block by block ({named}), the whole forward does not trace ({self.fallback_reason}); "
                "the code between them runs as written"
            )
        unused = f"; {', '.join(self.unused_inputs)} not taken by {self.traced_layer} (they feed what was not traced)"
        return f"traced {self.traced_layer} only, the whole model does not trace ({self.fallback_reason})" + (
            unused if self.unused_inputs else ""
        )


@dataclass(frozen=True)
class TracedTensor:
    """A tensor argument as the trace saw it: its shape, dtype and whether it carries a gradient
    (no values: the trace runs under static graph, the model under ``LazyGuard``)."""

    shape: tuple[int, ...]
    dtype: str
    stop_gradient: bool


@dataclass(frozen=True)
class Opaque:
    """An argument that is neither a tensor nor a plain value (a cache object, a config), by type name."""

    type_name: str


@dataclass(frozen=True)
class LayerCall:
    """One call of a layer in the trace. ``args`` and ``kwargs`` as passed, each tensor a
    :class:`TracedTensor`, an unknown object an :class:`Opaque`, None/bool/int/float/str and
    tuples, lists and dicts of them as they were. ``outputs``: per item of what the call returned
    (each item of a tuple or list, else the one value): ``"none"``, ``"read"`` (a tensor an op
    outside the call reads: a consumer, or the program's output), ``"unread"`` (a tensor nothing
    outside the call reads: HF's ``hidden_states, _ = self.self_attn(...)``; also a tuple, list or
    dataclass of tensors and None none of which is read: x-transformers' ``Intermediates``) or
    ``"other"``."""

    args: tuple
    kwargs: dict
    outputs: tuple[str, ...]


def trace_model(model: paddle.nn.Layer, input_specs: list) -> TracedProgram:
    """Trace ``model`` (or, failing that, its largest traceable child) with ``input_specs``, in
    eval mode: dropout is the identity there, so the program holds what a placement depends on.
    Every sub-layer's ``training`` flag is restored afterwards.

    Where the model's own code reads a layer's ``training`` flag while traced (a branch ``if
    self.training:`` that only training runs, PaddleFormers GPT-OSS's experts loop), the forward is
    traced again in train mode, and that program is kept as ``training`` for the checks of what
    Paddle cannot run on distributed tensors (:mod:`autodist.planner.recognise.crashes`): a plan is
    trained, not evaluated. Reads by Paddle's own layers (``nn.Dropout``, ``nn.BatchNorm``) do not
    count: they run on distributed tensors in either mode.

    Config flags selecting a fused kernel whose path does not trace on CPU are off while tracing
    (the eager path is traced) and the selection is kept in ``selected_kernels``, with the fused
    kernels the trace saw called (:mod:`autodist.planner.kernels`).

    Raises :class:`PlannerError` when neither the model nor any child traces.
    """
    with in_mode(model, training=False), eager_path(model) as selected, _training_reads(model) as readers:
        traced = _trace_model(model, input_specs)
    called: dict[str, str] = {}  # a call the trace saw says more than a flag: it is what runs
    for i, kernel in sorted(traced.kernel_ops.items()):
        called.setdefault(kernel, f"calls {_KERNEL_CALLS[kernel]} ({traced.op_layers[i] or 'the model'})")
    traced.selected_kernels = dict(sorted({**selected, **called}.items()))
    traced.training_readers = sorted(readers)
    if readers:
        try:
            with in_mode(model, training=True), _buffer_values_kept(model), eager_path(model):
                traced.training = _trace_model(model, input_specs)
        except PlannerError as error:
            traced.training_untraced = error.message
    return traced


#: How a kernel the trace saw called is named to the user.
_KERNEL_CALLS = {
    "attention": "a fused attention (F.scaled_dot_product_attention)",
    "rms_norm": "fused_rms_norm",
    "rope": "fused_rotary_position_embedding",
    "swiglu": "swiglu",
}


@contextmanager
def in_mode(model: paddle.nn.Layer, training: bool):
    """``model.train()`` or ``model.eval()`` for the ``with`` body; each layer's attributes as they
    were on exit: its own ``training`` flag, and whatever its forward set while traced (HF Falcon's
    rotary layer caches its cos/sin table in its first forward: left so, it would hold the trace's
    static values, which no later eager run, such as a local view's proof, can compute with).

    >>> net = paddle.nn.Sequential(paddle.nn.Dropout(0.5), paddle.nn.Linear(2, 2))
    >>> _ = net[0].eval()
    >>> with in_mode(net, training=False):
    ...     net.training, net[1].training
    ...     net[1].cached = "static"
    (False, False)
    >>> net.training, net[0].training, net[1].training, hasattr(net[1], "cached")
    (True, False, True, False)
    >>> with in_mode(net, training=True):
    ...     net[0].training
    True
    >>> net[0].training
    False
    """
    saved = [(layer, dict(vars(layer))) for _, layer in model.named_sublayers(include_self=True)]
    model.train() if training else model.eval()
    try:
        yield
    finally:
        for layer, attributes in saved:
            vars(layer).clear()
            vars(layer).update(attributes)


@contextmanager
def _buffer_values_kept(model: paddle.nn.Layer):
    """For the ``with`` body: each buffer, and each parameter that does not train, holding values
    gets them back on exit. A train-mode forward run eagerly (the block-by-block trace's first
    calls) updates some in place (a ``BatchNorm``'s running statistics, which Paddle keeps as
    parameters that do not train), and the model may be the user's own (``autodist.plan``). A
    forward changes no trained parameter, so those (most of the memory) are not copied.

    >>> net = paddle.nn.BatchNorm1D(2)
    >>> with _buffer_values_kept(net):
    ...     _ = net(paddle.to_tensor([[1.0, 2.0], [3.0, 4.0]]))
    >>> net._mean.tolist()
    [0.0, 0.0]
    """
    tensors = {id(tensor): tensor for tensor in [*model.parameters(), *model.buffers()]}.values()
    kept = [(t, t.numpy().copy()) for t in tensors if t.stop_gradient and t._is_initialized()]
    try:
        yield
    finally:
        for tensor, values in kept:
            tensor.set_value(values)


#: Code whose reads of a layer's ``training`` flag do not make a model's training differ from
#: what its eval-mode trace holds: Paddle's own (its layers run on distributed tensors in either
#: mode; its tracer reads the flag too) and the planner's.
_NOT_THE_MODELS = (str(Path(paddle.__file__).parent), str(Path(__file__).parents[1]))


@contextmanager
def _training_reads(model: paddle.nn.Layer) -> Iterator[set[str]]:
    """For the ``with`` body: the FQNs of ``model``'s layers whose ``training`` flag code outside
    Paddle and the planner reads (the model's own, as written or as dy2static converted it).
    ``Layer.training`` is a property for the while (a data descriptor, so it is asked before the
    instance's own entry, where it keeps the flag).

    >>> class Gated(paddle.nn.Layer):
    ...     def forward(self, x):
    ...         return x * 2 if self.training else x
    >>> net = paddle.nn.Sequential(paddle.nn.Dropout(0.5), Gated())
    >>> with _training_reads(net) as readers:
    ...     _ = net(paddle.ones([2]))
    >>> sorted(readers), "training" in vars(paddle.nn.Layer)
    (['1'], False)
    """
    names = {id(layer): fqn for fqn, layer in model.named_sublayers(include_self=True)}
    readers: set[str] = set()

    def read(layer):
        if id(layer) in names and not sys._getframe(1).f_code.co_filename.startswith(_NOT_THE_MODELS):
            readers.add(names[id(layer)])
        return vars(layer)["training"]

    def write(layer, value):
        vars(layer)["training"] = value

    paddle.nn.Layer.training = property(read, write)
    try:
        yield readers
    finally:
        del paddle.nn.Layer.training


def _trace_model(model: paddle.nn.Layer, input_specs: list) -> TracedProgram:
    param_fqns = {p.name: fqn for fqn, p in model.named_parameters()}
    try:
        return _trace_layer(model, "", input_specs, param_fqns, untraced=[])
    except Exception as whole_error:  # noqa: BLE001 -- sorted out just below
        failure = whole_error
    if not is_tracing_limit(failure):  # the forward itself raised: that is the user's to fix
        raise PlannerError(
            f"{type(model).__name__}.forward raised {_last_line(failure)} while being traced with the input "
            "specs given; fix the forward or the input specs (--input-spec)",
            detail=str(failure).strip(),
        )
    for name, child in _children_by_size(model):
        others = [n for n, c in model.named_children() if n != name and _num_params(c) > 0]
        child_specs = _specs_for(child, input_specs)
        if child_specs is None:
            continue
        try:
            traced = _trace_layer(child, name, child_specs, param_fqns, untraced=others)
        except Exception:  # noqa: BLE001 -- this child does not trace either; try the next one
            continue
        traced.fallback_reason = _last_line(failure)
        traced.unused_inputs = [s.name for s in input_specs if s not in child_specs]
        return traced
    traced, untraceable = _trace_by_blocks(model, input_specs, param_fqns)
    if traced is not None:
        traced.fallback_reason = _last_line(failure)
        return traced
    raise PlannerError(
        f"{type(model).__name__}.forward does not trace with paddle.jit.to_static(full_graph=True) "
        f"({_last_line(failure)}), no sub-layer holding most of its parameters does either, "
        f"and it does not trace block by block ({untraceable})",
        detail=str(failure).strip(),
    )


def _trace_by_blocks(model: paddle.nn.Layer, input_specs: list, param_fqns: dict[str, str]):
    """The model traced piece by piece, when its own forward does not trace (a Python ``if`` on
    a tensor's value in the glue between its blocks, say): one eager forward on this machine
    (:func:`_first_calls`) records how each sub-layer is called; then, from the top, each layer
    called with parameters is traced alone with what it got (its *unit*), and a layer that does
    not trace is split into its children in turn. What lies between the units is glue that runs
    as written, eagerly, at apply time too; the plan needs only the units' placements.

    The units' programs are read as one (:attr:`TracedProgram.bridges`): an input that is an
    earlier unit's output (the same tensor object in the eager forward) is that output, so the
    graph runs from the embedding through the blocks to the head as in a whole trace. Returns
    ``(traced, "")``, or ``(None, why)`` naming a layer with parameters that does not trace and
    has no child that holds them, or the eager forward's error.
    """
    try:
        calls, model_inputs = _first_calls(model, input_specs)
    except Exception as error:  # noqa: BLE001 -- said in the caller's one error line
        return None, f"its eager forward on example inputs raised {_last_line(error)}"
    units: list[tuple[TracedProgram, dict[str, paddle.Tensor]]] = []
    pending = [("", model)]
    while pending:
        fqn, layer = pending.pop(0)
        call = calls.get(fqn)
        failure = None
        if fqn and call is not None:
            try:
                units.append(_trace_unit(layer, fqn, call, model_inputs, param_fqns))
                continue
            except Exception as error:  # noqa: BLE001 -- split it into its children below
                failure = error
        holders = [(f"{fqn}.{n}" if fqn else n, c) for n, c in layer.named_children() if _num_params(c) > 0]
        if failure is not None and not holders:
            return None, f"{fqn} does not trace: {_last_line(failure)}"
        pending[:0] = holders  # a layer never called holds parameters the glue reads, if any: kept whole
    order = {fqn: i for i, fqn in enumerate(calls)}
    return _merged(sorted(units, key=lambda unit: order[unit[0].traced_layer]), calls, model_inputs), ""


@dataclass
class _EagerCall:
    """A layer's first call in the eager forward: its arguments and what it returned."""

    args: tuple
    kwargs: dict
    output: object = None


def _first_calls(model: paddle.nn.Layer, input_specs: list) -> tuple[dict[str, _EagerCall], dict[int, str]]:
    """Run ``model`` once eagerly on example inputs (:func:`_example_inputs`), its lazy parameters
    made on demand (:func:`_materialised`): each layer's first call (FQN -> :class:`_EagerCall`,
    in the order the calls began), and the model inputs (tensor id -> input spec name)."""
    inputs = _example_inputs(model, input_specs)
    calls: dict[str, _EagerCall] = {}
    returned: set[str] = set()
    handles = []

    def watch(fqn: str):
        def pre(layer, args, kwargs):
            calls.setdefault(fqn, _EagerCall(args, kwargs))

        def post(layer, args, output):
            if fqn not in returned:
                returned.add(fqn)
                calls[fqn].output = output

        return pre, post

    for fqn, layer in model.named_sublayers(include_self=True):
        pre, post = watch(fqn)
        handles += [layer.register_forward_pre_hook(pre, with_kwargs=True), layer.register_forward_post_hook(post)]
    try:
        with _materialised(model):
            model(*inputs)
    finally:
        for handle in handles:
            handle.remove()
    return calls, {id(tensor): spec.name for tensor, spec in zip(inputs, input_specs)}


def _example_inputs(model: paddle.nn.Layer, input_specs: list) -> list[paddle.Tensor]:
    """One tensor per input spec, the same in every run: integers all 1 (a token every table
    holds, a mask of ones attends everywhere, as a batch without padding has it; 0 when the
    smallest embedding table has one row), floats standard normal, bools true; a size known only
    at run time (-1) is 1.

    >>> [t.shape for t in _example_inputs(paddle.nn.Embedding(5, 2), [paddle.static.InputSpec([2, -1], "int64")])]
    [paddle.Size([2, 1])]
    """
    import numpy as np

    smallest = min(
        (
            layer.weight.shape[0]
            for layer in model.sublayers(include_self=True)
            if isinstance(layer, paddle.nn.Embedding)
        ),
        default=2,
    )
    random = np.random.RandomState(0)
    tensors = []
    for spec in input_specs:
        shape = [d if d is not None and d > 0 else 1 for d in spec.shape]
        dtype = dtype_name(spec.dtype)
        if dtype == "bool":
            value = np.ones(shape, dtype=bool)
        elif dtype.startswith(("int", "uint")):
            value = np.full(shape, 1 if smallest > 1 else 0)
        else:
            value = random.standard_normal(shape)
        tensors.append(paddle.to_tensor(value).astype(spec.dtype))
    return tensors


@contextmanager
def _materialised(model: paddle.nn.Layer):
    """For the ``with`` body: every lazy parameter (the model is built under ``paddle.LazyGuard``)
    holds values, made by its own initializer; on exit each is lazy again and Paddle's random
    state is as it was. Parameters already holding values are left alone. All at once, not layer
    by layer as each is called: a forward may read a weight its layer never calls
    (``F.linear(x, self.qkv.weight)``), and the glue a weight after its layer returned.

    >>> with paddle.LazyGuard():
    ...     net = paddle.nn.Linear(2, 2)
    >>> with _materialised(net):
    ...     list(net(paddle.ones([1, 2])).shape)
    [1, 2]
    >>> net.weight._is_initialized()
    False
    """
    state = paddle.get_rng_state()
    paddle.seed(0)
    made = [(param, param._init_func) for param in model.parameters() if not param._is_initialized()]
    try:
        for param, _ in made:
            param.initialize()
        yield
    finally:
        for param, init in made:
            param._clear_data()
            param.set_init_func(init)
        paddle.set_rng_state(state)


def _trace_unit(
    layer, fqn: str, call: _EagerCall, model_inputs: dict[int, str], param_fqns
) -> tuple[TracedProgram, dict[str, paddle.Tensor]]:
    """``layer`` traced alone, called as the eager forward called it: each tensor argument an
    ``InputSpec`` of its shape, dtype and gradient flag, named by its parameter (a model input by
    its input spec's name), other arguments as they were. Returns the trace and the tensor each
    input (``pd_op.data``) was given, by name; ``layer_calls`` records the call."""
    try:
        names = [
            p
            for p, kind in ((p.name, p.kind) for p in inspect.signature(layer.forward).parameters.values())
            if kind != inspect.Parameter.VAR_POSITIONAL
        ]
    except (TypeError, ValueError):
        names = []
    tensors: dict[str, paddle.Tensor] = {}

    def spec(value, name: str):
        if isinstance(value, paddle.Tensor):
            name = model_inputs.get(id(value), name)
            tensors[name] = value
            return paddle.static.InputSpec(value.shape, value.dtype, name, stop_gradient=value.stop_gradient)
        if isinstance(value, (tuple, list)):
            return type(value)(spec(item, f"{name}_{i}") for i, item in enumerate(value))
        if isinstance(value, dict):
            return {key: spec(item, f"{name}_{key}") for key, item in value.items()}
        return value

    args = [spec(value, names[i] if i < len(names) else f"arg{i}") for i, value in enumerate(call.args)]
    kwargs = {key: spec(value, key) for key, value in call.kwargs.items()}
    return _trace_layer(layer, fqn, args, param_fqns, untraced=[], kwargs=kwargs), tensors


def _merged(
    units: list[tuple[TracedProgram, dict[str, paddle.Tensor]]],
    calls: dict[str, _EagerCall],
    model_inputs: dict[int, str],
) -> TracedProgram:
    """The units' programs read as one, in the order the forward called them: ops and their
    layers concatenated, each unit input bridged (:attr:`TracedProgram.bridges`) to what the eager
    forward handed it: an earlier unit's output (the same tensor), the first unit input of the
    same model input or glue value, or None (the glue computed it); a parameter traced by an
    earlier unit is that unit's parameter op."""
    ops: list = []
    op_layers: list[str] = []
    kernel_ops: dict[int, str] = {}
    layer_calls: dict[str, list[LayerCall]] = {}
    bridges: dict[int, tuple[int, int] | None] = {}
    made: dict[object, tuple[int, int]] = {}  # tensor id / parameter name -> (op index, result)
    first_tensors: dict[str, tuple[tuple[int, int] | None, tuple[int, int] | None]] = {}

    def source(i: int, result: int) -> tuple[int, int]:  # through a bridged input to what it stands for
        bridged = bridges.get(i)
        return bridged if bridged is not None else (i, result)

    for unit, inputs in units:
        offset = len(ops)
        for i, op in enumerate(unit.ops, offset):
            name = op.name()
            if name == "builtin.parameter":
                key = ("parameter", op.attrs().get("parameter_name"))
                if key in made:
                    bridges[i] = made[key]
                made.setdefault(key, (i, 0))
            elif name == "pd_op.data":
                tensor = inputs[op.attrs()["name"]]
                if id(tensor) in made:
                    bridges[i] = made[id(tensor)]
                elif id(tensor) not in model_inputs:
                    bridges[i] = None
                made.setdefault(id(tensor), (i, 0))
        call = calls[unit.traced_layer]
        returned = _tensors(call.output)
        if _alike(unit.outputs, returned):  # else its outputs reach later units as glue values
            for value, tensor in zip(unit.outputs, returned):
                producer = value.get_defining_op()
                made[id(tensor)] = source(offset + unit.ops.index(producer), result_index(producer, value))
        ends = (first_input(call.args, call.kwargs), first_tensor(call.output))
        first_tensors[unit.traced_layer] = (
            None if ends[0] is None else made.get(id(ends[0])),
            None if ends[1] is None else made.get(id(ends[1])),
        )
        for fqn, ends in unit.first_tensors.items():
            shifted = [None if at is None else source(offset + at[0], at[1]) for at in ends]
            first_tensors.setdefault(fqn, (shifted[0], shifted[1]))
        ops += unit.ops
        op_layers += unit.op_layers
        kernel_ops.update({offset + i: kernel for i, kernel in unit.kernel_ops.items()})
        for fqn, recorded in unit.layer_calls.items():
            layer_calls.setdefault(fqn, []).extend(recorded)
    first = units[0][0]
    return TracedProgram(
        program=first.program,
        ops=ops,
        op_layers=op_layers,
        traced_layer="",
        param_fqns=first.param_fqns,
        kernel_ops=kernel_ops,
        layer_calls=layer_calls,
        units=[unit.traced_layer for unit, _ in units],
        unit_programs=[unit.program for unit, _ in units],
        bridges=bridges,
        first_tensors=first_tensors,
    )


def _alike(values: list, tensors: list) -> bool:
    """Whether a program's outputs and the eager call's returned tensors pair up one to one, each
    pair of one shape and dtype (a forward may return what the trace and the eager run flatten
    differently: then none is paired, rather than one wrongly)."""
    return len(values) == len(tensors) and all(
        list(v.shape) == list(t.shape) and dtype_name(v.dtype) == dtype_name(t.dtype) for v, t in zip(values, tensors)
    )


def _tensors(value) -> list:
    """The tensors in ``value`` (a tensor, or tuples, lists and dicts of them), flattened in the
    order ``paddle.utils.flatten`` gives a program's outputs."""
    return [item for item in paddle.utils.flatten(value) if isinstance(item, (paddle.Tensor, paddle.pir.Value))]


def result_index(op, value) -> int:
    """Which result of ``op`` ``value`` is."""
    return next((k for k, result in enumerate(op.results()) if result.is_same(value)), 0)


# -- internals ---------------------------------------------------------------------------------------


def is_tracing_limit(error: BaseException) -> bool:
    """Whether ``error`` is a limit of Paddle's tracer rather than the forward raising: a
    ``RecursionError`` (dy2static's AST transformer on a deep model, or its rewrite of
    ``super()``, which :func:`_dy2static_caches` now works around; docs/paddle-notes.md,
    "Tracing") or an error whose innermost frame is
    inside Paddle. dy2static keeps the original traceback on the error (``ERROR_DATA``); a
    ``raise`` in the user's forward ends in the user's (transformed) code, and only then is
    falling back to a sub-layer wrong: it would plan a fragment and hide the error."""
    if isinstance(error, RecursionError):
        return True
    from paddle.jit.dy2static.error import ERROR_DATA

    origin = getattr(getattr(error, ERROR_DATA, None), "origin_traceback", None)
    frames = origin if isinstance(origin, list) else traceback.extract_tb(origin or error.__traceback__)
    return bool(frames) and frames[-1].filename.startswith(_PADDLE_DIR)


_PADDLE_DIR = str(Path(paddle.__file__).parent)


def _last_line(error: BaseException) -> str:
    """dy2static puts the real error (``ValueError: not enough values to unpack``) last, after
    the transformed code; plain exceptions get their type prefixed."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if not lines:
        return type(error).__name__
    return lines[-1] if ": " in lines[-1] and len(lines) > 1 else f"{type(error).__name__}: {lines[-1]}"


def _specs_for(child: paddle.nn.Layer, input_specs: list) -> list | None:
    """The model's input specs that ``child.forward`` takes, by name, in its order: a causal-LM
    wrapper takes ``labels`` for its loss, its decoder does not, and passing ``labels`` on
    positionally would trace it as the decoder's ``attention_mask``. None when the names the
    child takes are not its first parameters in order (positional passing would put one in
    the wrong place); unnamed specs are passed as given."""
    if any(not getattr(spec, "name", None) for spec in input_specs):
        return list(input_specs)
    try:
        parameters = list(inspect.signature(child.forward).parameters)
    except (TypeError, ValueError):
        return list(input_specs)
    taken = [spec for spec in input_specs if spec.name in parameters]
    if [spec.name for spec in taken] != parameters[: len(taken)]:
        return None
    return taken


def _num_params(layer: paddle.nn.Layer) -> int:
    return sum(math.prod(p.shape) for p in layer.parameters())


def _children_by_size(model: paddle.nn.Layer) -> list[tuple[str, paddle.nn.Layer]]:
    """Direct children with their own forward (a LayerList has none) that hold at least half of
    the model's parameters, largest first. A smaller child would not stand for the model: its
    tracing would hide the real failure (often a wrong input spec) behind a plan of a fragment."""
    total = _num_params(model)
    children = [
        (name, child)
        for name, child in model.named_children()
        if type(child).forward is not paddle.nn.Layer.forward
        and _num_params(child) > 0
        and 2 * _num_params(child) >= total
    ]
    return sorted(children, key=lambda item: -_num_params(item[1]))


class _OpRangeRecorder:
    """Forward hooks that record, per layer call, the ops it added to the program being built,
    and how it was called (:class:`LayerCall`, made by :meth:`layer_calls` once the program is whole).
    A layer's ``forward`` called directly (``self.attention.forward(h, freqs_cis, mask)``, as
    Mistral's reference code does) runs no hooks: :meth:`direct_forwards` records how it was
    called, its ops staying its caller's."""

    def __init__(self, root: paddle.nn.Layer, prefix: str):
        self.calls: list[tuple[str, list]] = []  # (layer FQN, its ops), in post-hook order
        self._starts: list[tuple[int, tuple, dict, object]] = []
        # (FQN, args, kwargs, ops, output, first tensor input)
        self._returned: list[tuple[str, tuple, dict, list, object, object]] = []
        self._handles = []
        self._names = {id(layer): name for name, layer in root.named_sublayers(prefix=prefix)}
        for name, layer in root.named_sublayers(prefix=prefix):
            self._handles.append(layer.register_forward_pre_hook(self._pre, with_kwargs=True))
            self._handles.append(layer.register_forward_post_hook(self._make_post(name)))

    @staticmethod
    def _block_ops() -> list:
        from paddle.base import default_main_program  # PIR switches it at import: look up late

        return default_main_program().global_block().ops

    def _pre(self, layer, args, kwargs):
        first = first_input(args, kwargs, paddle.pir.Value)
        self._starts.append((len(self._block_ops()), _described(args), _described(kwargs), first))

    def _make_post(self, fqn: str):
        def post(layer, inputs, outputs):
            start, args, kwargs, first = self._starts.pop()
            # Op objects, not indices: they survive whatever dy2static does to the list later.
            ops = self._block_ops()[start:]
            self.calls.append((fqn, ops))
            self._returned.append((fqn, args, kwargs, ops, outputs, first))

        return post

    @contextmanager
    def direct_forwards(self) -> Iterator[None]:
        """For the ``with`` body (a dy2static trace): record each call of a sub-layer's bound
        ``forward`` made from converted code (dy2static routes it through
        ``paddle.jit.dy2static.Call``) as :meth:`layer_calls` records a hooked call."""
        import paddle.jit.dy2static as jst

        convert = jst.Call

        def call(func):
            converted = convert(func)
            owner = getattr(func, "__self__", None)
            name = self._names.get(id(owner)) if isinstance(owner, paddle.nn.Layer) else None
            if name is None or getattr(func, "__name__", "") != "forward":
                return converted

            def recorded(*args, **kwargs):
                start, first = len(self._block_ops()), first_input(args, kwargs, paddle.pir.Value)
                out = converted(*args, **kwargs)
                ops = self._block_ops()[start:]
                self._returned.append((name, _described(args), _described(kwargs), ops, out, first))
                return out

            return recorded

        jst.Call = call
        try:
            yield
        finally:
            jst.Call = convert

    def layer_calls(self) -> dict[str, list[LayerCall]]:
        """Every call, by layer, with what reads its outputs: only known once the program is
        built (the readers come after the call). Drops the outputs it held."""
        found: dict[str, list[LayerCall]] = {}
        for fqn, args, kwargs, ops, output, _ in self._returned:
            own = set(ops)
            items = output if isinstance(output, (tuple, list)) else (output,)
            found.setdefault(fqn, []).append(LayerCall(args, kwargs, tuple(_read(item, own) for item in items)))
        self._returned = []
        return found

    def first_tensors(self, index: dict) -> dict[str, tuple[tuple[int, int] | None, tuple[int, int] | None]]:
        """:attr:`TracedProgram.first_tensors`: each layer's first call's first tensor input and
        output as program values, ``index`` numbering the program's ops. Call before
        :meth:`layer_calls`, which drops the outputs."""
        found: dict[str, tuple[tuple[int, int] | None, tuple[int, int] | None]] = {}
        for fqn, _, _, _, output, first in self._returned:
            found.setdefault(fqn, (_place(first, index), _place(first_tensor(output, paddle.pir.Value), index)))
        return found

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def _place(value, index: dict) -> tuple[int, int] | None:
    """The program value ``(op index, result)`` a traced value is, or None (not a value, or one
    made by no op of the program: a block argument, an op a pass removed)."""
    producer = value.get_defining_op() if isinstance(value, paddle.pir.Value) else None
    return (index[producer], result_index(producer, value)) if producer in index else None


def _described(value):
    """``value`` with each tensor a :class:`TracedTensor` and each unknown object an :class:`Opaque`."""
    if isinstance(value, (paddle.pir.Value, paddle.Tensor)):
        return TracedTensor(tuple(value.shape), dtype_name(value.dtype), bool(value.stop_gradient))
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (tuple, list)):
        return (tuple if isinstance(value, tuple) else list)(_described(item) for item in value)
    if isinstance(value, dict):
        return {key: _described(item) for key, item in value.items()}
    return Opaque(type(value).__name__)


def _read(item, own: set) -> str:
    """What reads one item of a call's output (:class:`LayerCall` ``outputs``). An item holding
    tensors and None alone (a tuple, a list, a dataclass: x-transformers' ``Intermediates``) is
    read when one of its tensors is, unread when none is."""
    if item is None:
        return "none"
    if isinstance(item, paddle.pir.Value):
        return "read" if any(user not in own for user in item.all_used_ops()) else "unread"
    if dataclasses.is_dataclass(item) and not isinstance(item, type):
        held = [getattr(item, f.name) for f in dataclasses.fields(item)]
    elif isinstance(item, (tuple, list)):
        held = list(item)
    else:
        return "other"
    reads = {_read(value, own) for value in held}
    if not reads or not reads <= {"none", "read", "unread"}:
        return "other"
    return "read" if "read" in reads else "unread"


def _trace_layer(layer, prefix: str, input_specs, param_fqns, untraced: list[str], kwargs=None) -> TracedProgram:
    """``layer.forward`` traced with positional ``input_specs`` and ``kwargs`` (InputSpecs where
    tensors go, other values as given)."""
    recorder = _OpRangeRecorder(layer, prefix)
    static_fn = paddle.jit.to_static(layer.forward, full_graph=True)
    try:
        with (
            _dy2static_caches(),
            _buffers_registered_while_traced(),
            _no_residue(),
            every_selection_taken(),
            recorded_calls(_OpRangeRecorder._block_ops) as calls,
            recorder.direct_forwards(),
            warnings.catch_warnings(),
        ):
            # dy2static warns about tensor methods it stubs out ("Tensor do not have 'place'
            # interface for pir graph mode"): noise to someone planning a model.
            warnings.filterwarnings("ignore", category=UserWarning, module=r"paddle\.")
            concrete, _ = static_fn.get_concrete_program(*input_specs, is_train=layer.training, **(kwargs or {}))
            program = concrete.main_program
    finally:
        static_fn.rollback()
        recorder.remove()
    ops = list(program.global_block().ops)
    op_layers = _attribute_ops(ops, recorder.calls, param_fqns, prefix)
    index = {op: i for i, op in enumerate(ops)}
    first_tensors = recorder.first_tensors(index)
    return TracedProgram(
        program=program,
        ops=ops,
        op_layers=op_layers,
        traced_layer=prefix,
        param_fqns=param_fqns,
        untraced_layers=untraced,
        kernel_ops={index[op]: kernel for kernel, call_ops in calls for op in call_ops if op in index},
        layer_calls=recorder.layer_calls(),
        outputs=_tensors(concrete.outputs),
        first_tensors=first_tensors,
    )


@contextmanager
def _buffers_registered_while_traced():
    """For the ``with`` body (a trace): a buffer a forward sets anew from a traced value is read
    back as that value, as the eager forward reads the tensor it sets. Rotary caches that grow
    on demand do so: HuggingFace's ``_set_cos_sin_cache``, called when a longer sequence comes,
    registers its cos/sin cache again, or assigns it (``self.cos_cached = ...``). Paddle's
    ``register_buffer`` takes tensors only and refuses the trace's values, and an assignment
    writes the value into the buffer in place, which fails at another shape; so the value is
    kept as the layer's attribute instead (its own ``__dict__`` entry, read before the buffers).
    An assignment of the buffer's own shape is left to Paddle. :func:`in_mode` drops what the
    trace set afterwards.

    >>> layer = paddle.nn.Linear(2, 2)
    >>> with _buffers_registered_while_traced():
    ...     layer.register_buffer("cache", paddle.ones([2]))
    >>> list(layer.cache.shape), "cache" in vars(layer)
    ([2], False)
    """
    register, assign = paddle.nn.Layer.register_buffer, paddle.nn.Layer.__setattr__

    def register_buffer(layer, name, tensor, persistable=True):
        if isinstance(tensor, paddle.pir.Value):
            vars(layer)[name] = tensor
        else:
            vars(layer).pop(name, None)  # a value this trace set for it would hide the tensor
            register(layer, name, tensor, persistable)

    def setattr_(layer, name, value):
        buffer = vars(layer).get("_buffers", {}).get(name)
        if isinstance(value, paddle.pir.Value) and buffer is not None:
            if name in vars(layer) or list(buffer.shape) != list(value.shape):  # set by this trace, or cannot be
                vars(layer)[name] = value
                return
        assign(layer, name, value)

    paddle.nn.Layer.register_buffer, paddle.nn.Layer.__setattr__ = register_buffer, setattr_
    try:
        yield
    finally:
        paddle.nn.Layer.register_buffer, paddle.nn.Layer.__setattr__ = register, assign


#: What :func:`_no_residue` hands Paddle for every op's creation call stack: one empty stack.
_NO_STACK = traceback.StackSummary()


@contextmanager
def _no_residue():
    """Trace without leaving anything behind in the process (``autodist.plan`` in a loop holds
    its memory flat: bench/plan_memory.py).

    1. Paddle's C++ records every PIR op's creation call stack by calling Python's
       ``traceback.extract_stack()``, and keeps a reference to each stack it gets after the op and
       its program are gone: about 240 stacks, 0.8 MB, per trace of a small Llama
       (docs/paddle-notes.md, "Tracing leaves call stacks behind"). While we trace,
       ``extract_stack`` returns one shared empty stack: nothing new is kept. The planner's own
       errors do not use those stacks (a forward that raises is reported from its exception).
    2. Paddle names each traced layer call in a global tree (``framework._name_struct``: the
       ``struct_name`` attribute); each trace adds a subtree under the current node
       (``Model_1``, ``Model_2``, ...). It is cut back to what it was, so the names, too, are
       those of a first trace.
    3. dy2static records each program's parameters (as PIR values, by the tensor's ``id()``) and
       in-place values in maps keyed by the program's ``id()`` (``parameter_recorder``'s globals;
       ``ProgramTranslator``'s own for the old IR), and drops a program's entries only when its
       trace succeeds. After a trace that raised (a glue that does not trace, before the planner
       traces block by block), a later program and parameter at the same addresses found the dead
       program's values: Paddle 3.3.1 segfaulted building a ``layer_norm`` (tracing HF StarCoder2
       after HF StableLM in one process, every time). Each trace gets maps of its own; the
       process's are put back after.
    """
    from paddle.base import framework
    from paddle.jit.dy2static import parameter_recorder, program_translator

    translator = program_translator.ProgramTranslator.get_instance()
    maps = [
        (parameter_recorder, "_global_parameter_recorder", parameter_recorder.ParametersRecorder),
        (parameter_recorder, "_global_inplace_map", parameter_recorder.InplaceMap),
        (translator, "_params_recorder", program_translator.ParametersRecorder),
        (translator, "_inplace_map", program_translator.InplaceMap),
    ]
    kept = [getattr(owner, name) for owner, name, _ in maps]
    for owner, name, fresh in maps:
        setattr(owner, name, fresh())
    extract_stack = traceback.extract_stack
    node = framework._name_struct
    children = {prefix: len(named) for prefix, named in node._children.items()}
    traceback.extract_stack = lambda f=None, limit=None: _NO_STACK
    try:
        yield
    finally:
        for (owner, name, _), value in zip(maps, kept):
            setattr(owner, name, value)
        traceback.extract_stack = extract_stack
        for prefix in list(node._children):
            if prefix not in children:
                del node._children[prefix]
            else:
                del node._children[prefix][children[prefix] :]


@contextmanager
def _dy2static_caches():
    """Two caches dy2static lacks, installed only while we trace (restored on exit).

    1. It caches converted functions in a WeakKeyDictionary keyed by the callable it gets; for a
       method that is a fresh bound-method object, dead a moment later, so the forward of every
       layer *instance* is converted again (source generation, a temp file, an import). The
       converted function does not depend on the instance (it is a plain function bound to the
       layer afterwards), so methods are keyed by their underlying function.
    2. ``is_unsupported(func)`` rebuilds the list of every built-in module's functions on each
       call (milliseconds, over a thousand calls for a deep model); its answer depends only on
       the function (for a layer: its class), so it is remembered.

    Together they cut the tracing time of a deep model by about half. And one fix:

    3. dy2static rewrites a zero-argument ``super()`` as ``super(self.__class__, self)``, which
       for an instance of a *subclass* of the method's class finds the same method again, for
       ever: PaddleFormers' ``PretrainedConfig.__getattribute__`` called on a ``LlamaConfig``
       (from ``config.get(...)`` in the LM head) is the ``RecursionError`` that kept
       ``LlamaForCausalLM`` from tracing whole (docs/paddle-notes.md, "Tracing"). Such a method
       runs as plain Python instead (:func:`_super_misconverted`).
    4. dy2static defines a converted function under its own name in the module it generates, so
       a method that calls the module-level function of the same name (``self.rotate_half(x)``
       whose body is ``return rotate_half(x)``) calls itself instead: a ``RecursionError`` for a
       static method, a missing argument for a bound one. Such a method runs as plain Python too
       (:func:`_shadows_its_global`).
    5. dy2static converts a function holding ``_CACHE_LOCK``, a plain ``threading.Lock``, and its
       AST pass evaluates callee expressions (``is_api_in_module``): one that calls a function
       (``_jst.Call(self.get_rel_embedding)().weight``, HF DeBERTa-v2) converts that function
       again on the same thread, and waits on the lock it holds, for ever (seen as a hung test
       suite). The lock is an ``RLock`` while we trace.
    """
    from paddle.jit.dy2static import convert_call_func, program_translator
    from paddle.jit.dy2static.program_translator import _FUNCTION_CACHE

    convert, is_unsupported = _FUNCTION_CACHE.convert_with_cache, convert_call_func.is_unsupported
    converted: dict = {}
    supported: dict = {}

    def convert_by_function(func):
        function = getattr(func, "__func__", None)
        if function is None:
            return convert(func)
        if function not in converted:
            converted[function] = convert(func)
        return converted[function]

    def remembered_is_unsupported(func):
        if _super_misconverted(func) or _shadows_its_global(func):
            return True
        # A layer is judged by its class's forward, a method by its function.
        key = type(func) if isinstance(func, paddle.nn.Layer) else (type(func), getattr(func, "__func__", func))
        try:
            hash(key)
        except TypeError:
            return is_unsupported(func)
        if key not in supported:
            supported[key] = is_unsupported(func)
        return supported[key]

    _FUNCTION_CACHE.convert_with_cache = convert_by_function
    convert_call_func.is_unsupported = remembered_is_unsupported
    lock, program_translator._CACHE_LOCK = program_translator._CACHE_LOCK, threading.RLock()
    try:
        yield
    finally:
        del _FUNCTION_CACHE.convert_with_cache  # the instance attribute: the class's method shows again
        convert_call_func.is_unsupported = is_unsupported
        program_translator._CACHE_LOCK = lock


def _super_misconverted(func) -> bool:
    """Whether dy2static's rewrite of ``super()`` in bound method ``func`` would recurse: the
    method calls the zero-argument ``super()`` (its code has the ``__class__`` cell) and its
    instance is of a subclass of the class defining it.

    >>> class Base:
    ...     def get(self):
    ...         return super().__repr__()
    >>> class Child(Base):
    ...     pass
    >>> _super_misconverted(Base().get), _super_misconverted(Child().get)
    (False, True)
    """
    function, instance = getattr(func, "__func__", None), getattr(func, "__self__", None)
    code = getattr(function, "__code__", None)
    if function is None or instance is None or code is None or "__class__" not in code.co_freevars:
        return False
    defining = function.__closure__[code.co_freevars.index("__class__")].cell_contents
    return type(instance) is not defining


def _shadows_its_global(func) -> bool:
    """Whether function or method ``func`` reads a module-level name equal to its own name that
    is bound to another object: dy2static's converted copy would read itself there.

    >>> def helper(x):
    ...     return x
    >>> class Net:
    ...     @staticmethod
    ...     def helper(x):
    ...         return helper(x)
    >>> class Other:
    ...     def helper(self, x):
    ...         return x.helper()
    >>> _shadows_its_global(Net.helper), _shadows_its_global(helper), _shadows_its_global(Other().helper)
    (True, False, False)
    """
    function = getattr(func, "__func__", func)
    code, namespace = getattr(function, "__code__", None), getattr(function, "__globals__", None)
    if code is None or namespace is None or namespace.get(code.co_name, function) is function:
        return False
    # a global read, not an attribute of that name (``x.reshape`` in a method ``reshape``)
    return any(i.opname == "LOAD_GLOBAL" and i.argval == code.co_name for i in dis.get_instructions(code))


def _attribute_ops(ops: list, calls: list[tuple[str, list]], param_fqns: dict[str, str], prefix: str) -> list[str]:
    index = {op: i for i, op in enumerate(ops)}
    layer_of: dict[int, str] = {}
    # Inner layers' post hooks run before their parents', so the first claim is the innermost.
    for layer, call_ops in calls:
        for op in call_ops:
            i = index.get(op)
            if i is not None:
                layer_of.setdefault(i, layer)
    # Fallback: an op outside every hooked range but carrying a struct_name some attributed op
    # also carries belongs to that op's layer.
    layer_by_struct: dict[str | None, str] = {}
    for i, owner in layer_of.items():
        layer_by_struct.setdefault(_struct_name(ops[i]), owner)
    layer_by_struct.pop(None, None)
    op_layers = []
    for i, op in enumerate(ops):
        fqn = layer_of.get(i)
        if fqn is None and op.name() == "builtin.parameter":
            fqn = _parameter_layer(op, param_fqns)
        if fqn is None:
            fqn = layer_by_struct.get(_struct_name(op), prefix)
        op_layers.append(fqn)
    _place_buffers_with_their_consumer(ops, op_layers, index, param_fqns)
    return op_layers


def _struct_name(op) -> str | None:
    return op.attrs().get("struct_name")


def _parameter_layer(op, param_fqns: dict[str, str]) -> str | None:
    """dy2static hoists parameter ops to the program's start: the owner comes from the FQN."""
    fqn = param_fqns.get(op.attrs().get("parameter_name"))
    return fqn.rpartition(".")[0] if fqn is not None else None


def _place_buffers_with_their_consumer(ops, op_layers, index, param_fqns) -> None:
    """Plain tensor attributes (RoPE caches, ``eager_tmp_N``) also become hoisted parameter ops;
    they belong to the layer of the first op that reads them."""
    for i, op in enumerate(ops):
        if op.name() != "builtin.parameter" or op.attrs().get("parameter_name") in param_fqns:
            continue
        consumers = sorted(index[user] for user in op.result(0).all_used_ops() if user in index)
        if consumers:
            op_layers[i] = op_layers[consumers[0]]


def subscript_source(model: paddle.nn.Layer, fqn: str) -> str:
    """Where the code of ``model``'s layer holding parameter ``fqn`` slices it
    (``self.<name>[...]``): ``Class.method at file:line`` of the first such subscript in the
    layer's class; "" when Python cannot say.

    >>> class Net(paddle.nn.Layer):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.w = self.create_parameter([2, 4])
    ...     def half(self, x):
    ...         return x @ self.w[:, :2]
    >>> subscript_source(Net(), "w")  # doctest: +ELLIPSIS
    'Net.half at ...'
    """
    owner, _, name = fqn.rpartition(".")
    layer = dict(model.named_sublayers(include_self=True)).get(owner)
    if layer is None:
        return ""
    for cls in type(layer).__mro__:
        for method_name, method in vars(cls).items():
            if not inspect.isfunction(method):
                continue
            try:
                file, first = source_place(method)
                tree = ast.parse(textwrap.dedent(inspect.getsource(method)))
            except (OSError, TypeError, SyntaxError):
                continue
            lines = [
                n.lineno
                for n in ast.walk(tree)
                if isinstance(n, ast.Subscript)
                and isinstance(n.value, ast.Attribute)
                and n.value.attr == name
                and isinstance(n.value.value, ast.Name)
                and n.value.value.id == "self"
            ]
            if lines:
                return f"{cls.__name__}.{method_name} at {file}:{first + min(lines) - 1}"
    return ""


def forward_source(model: paddle.nn.Layer, fqn: str) -> str:
    """Where the code of sub-layer ``fqn`` of ``model`` is: ``Class.forward at file:line`` of it,
    or of its nearest enclosing layer whose class is not Paddle's own (an op of a ``Linear`` is
    written in the forward that calls it); "" when Python cannot say.

    >>> class Net(paddle.nn.Layer):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.fc = paddle.nn.Linear(2, 2)
    >>> forward_source(Net(), "fc")  # doctest: +ELLIPSIS
    'Net.forward at ...'
    """
    layers = dict(model.named_sublayers(include_self=True))
    path = fqn.split(".") if fqn else []
    for depth in range(len(path), -1, -1):
        layer = layers.get(".".join(path[:depth]))
        if layer is None or type(layer).__module__.split(".")[0] == "paddle":
            continue
        forward = inspect.unwrap(type(layer).forward)
        try:
            return f"{type(layer).__name__}.forward at {':'.join(map(str, source_place(forward)))}"
        except (OSError, TypeError):
            return ""
    return ""
