"""Planning in a loop holds its memory flat (issue #23, item 9): a trace leaves nothing behind in
the process. Paddle's C++ keeps every PIR op's creation call stack (from
``traceback.extract_stack``) after the op is gone, and names each traced layer call in a global
tree; both grew with every ``autodist.plan`` call (about 0.8 MB a call for a small Llama; the
memory itself is measured in bench/plan_memory.py, not here)."""

from __future__ import annotations

import gc
import traceback

import paddle
from paddle.base import framework

from autodist.planner.trace import trace_model


class Block(paddle.nn.Layer):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = paddle.nn.Linear(16, 32), paddle.nn.Linear(32, 16)

    def forward(self, x):
        return x + self.fc2(paddle.nn.functional.gelu(self.fc1(x)))


class Net(paddle.nn.Layer):
    def __init__(self):
        super().__init__()
        self.blocks = paddle.nn.LayerList([Block() for _ in range(2)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def live_stacks() -> int:
    gc.collect()
    return sum(isinstance(o, traceback.StackSummary) for o in gc.get_objects())


def name_tree_size(node=None) -> int:
    node = node or framework._name_struct
    return sum(1 + name_tree_size(child) for named in node._children.values() for child in named)


def test_tracing_again_and_again_keeps_no_call_stacks_and_no_names():
    spec = [paddle.static.InputSpec([2, 4, 16], "float32", "x")]
    with paddle.LazyGuard():
        model = Net()
    first = trace_model(model, spec)
    stacks, names = live_stacks(), name_tree_size()
    for _ in range(3):
        again = trace_model(model, spec)
        assert len(again.ops) == len(first.ops)
        del again
    assert live_stacks() == stacks  # on main: 3 x (one stack per op of the trace and its startup program)
    assert name_tree_size() == names  # on main: a Net_1, Net_2, Net_3 subtree each time
    assert traceback.extract_stack()[-1].name == "test_tracing_again_and_again_keeps_no_call_stacks_and_no_names"


def test_a_trace_leaves_the_models_attributes_as_they_were():
    """HF Falcon's rotary layer caches its cos/sin table in its first forward
    (tests/models/zoo/falcon_hf.py, ``cos_sin``): the trace's forward would leave static values
    there, which the local view's proof (an eager run after the trace) cannot compute with."""
    from models.zoo import falcon_hf

    model = falcon_hf.build_model()
    rotary = model.transformer.h[0].self_attention.maybe_rotary
    trace_model(model, falcon_hf.input_spec())
    assert rotary.seq_len_cached == -1 and rotary.cos_cached is None and rotary.sin_cached is None
    assert model(paddle.randint(0, falcon_hf.VOCAB, [2, 8])).shape == [2, 8, falcon_hf.VOCAB]


class RaisesAfterItsBlocks(Net):
    """Its blocks trace, then its own forward raises."""

    def forward(self, x):
        x = super().forward(x)
        raise NotImplementedError("not traceable")


def test_a_trace_that_raised_leaves_no_parameter_values_of_its_program_behind():
    """dy2static drops a program's parameter values (keyed by the program's and the tensor's
    ``id()``) only when its trace succeeds. Left behind, a later program and parameter at the same
    addresses found them: Paddle segfaulted building a layer_norm (test_zoo's StarCoder2, whose
    glue raises before it is traced block by block, after StableLM: every run). After a trace
    that raised, dy2static's maps are as they were."""
    import pytest
    from paddle.jit.dy2static import parameter_recorder

    from autodist.planner.errors import PlannerError

    recorder = parameter_recorder._global_parameter_recorder
    before = (recorder, dict(recorder.params_dict), dict(recorder.tensor2value))
    with pytest.raises(PlannerError, match="not traceable"):
        trace_model(RaisesAfterItsBlocks(), [paddle.static.InputSpec([4, 16], "float32")])
    recorder = parameter_recorder._global_parameter_recorder
    assert (recorder, recorder.params_dict, recorder.tensor2value) == before


class GlueDoesNotTrace(Net):
    """Its blocks trace, its own forward does not (it reads a value with ``.tolist()``)."""

    def forward(self, x):
        steps = x.shape[0] if x.abs().sum().tolist() > 0 else 1
        return super().forward(x) * steps


def test_a_trace_made_block_by_block_leaves_no_parameter_values_behind():
    """The same residue from a trace that succeeds: HF DBRX's forward does not trace whole, so its
    first attempts raise and it is traced block by block. The values those attempts left behind
    were found by the local-view proof's retrace of DBRX at a batch of its own, in its forked
    child: Paddle segfaulted in layer_norm (or the retrace saw other arguments) and autodist-plan
    lost DBRX's attention views, 5 runs of 5 before the fix (docs/paddle-notes.md)."""
    from paddle.jit.dy2static import parameter_recorder

    recorder = parameter_recorder._global_parameter_recorder
    before = dict(recorder.params_dict)
    traced = trace_model(GlueDoesNotTrace(), [paddle.static.InputSpec([4, 16], "float32")])
    assert traced.units == ["blocks.0", "blocks.1"]
    assert parameter_recorder._global_parameter_recorder.params_dict == before
