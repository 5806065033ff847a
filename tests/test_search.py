"""Strategy search sanity on real traced models.

The big models are traced for real under ``paddle.LazyGuard()`` (no parameter memory): the
docstring Llama at hidden 4096 and 32 layers (3.8B parameters: the docstring keeps its
intermediate size 4096 and vocabulary 8000) and a GPT-2-small-sized model from
``tests/models/gpt.py``. Nothing is scaled or hand-written.
"""

from __future__ import annotations

import dataclasses
import math
import re

import msgspec
import paddle
import pytest
from models import gpt
from models.traced import docstring_module, traced

from autodist.planner import driver
from autodist.planner.recognise.analysis import analyze
from autodist.planner.cost.comm import group_within_node
from autodist.planner.cost.graph_cost import model_cost
from autodist.planner.cost.hardware import PROFILES
from autodist.planner.cost.step_time import MEMORY_USABLE, Setup, StageTable, estimate
from autodist.planner.errors import PlannerError
from autodist.planner.review.explain import explain_table
from autodist.planner.cost.search import SearchRequest, search
from autodist.schemas.describe import strategy_text
from autodist.schemas import Strategy

H100, A100_40 = PROFILES["h100-sxm"], PROFILES["a100-40g"]


def _analyse_lazily(build, specs):
    with paddle.LazyGuard():
        model = build()
    return driver.analyse(model, driver.trace(model, specs))


@pytest.fixture(scope="module")
def llama_3b8():
    """to_distributed's docstring Llama at hidden 4096, 32 layers; input spec [4, 1024]."""
    module = docstring_module()
    return _analyse_lazily(lambda: module.build_model(num_layers=32, hidden_size=4096), module.input_spec())


@pytest.fixture(scope="module")
def gpt2_small():
    cfg = gpt.GPTConfig(
        vocab_size=50304, hidden_size=768, num_heads=12, num_layers=12, max_positions=1024, batch_size=8, seq_len=1024
    )
    return _analyse_lazily(lambda: gpt.build_model(cfg), gpt.input_spec(cfg))


def assert_valid(result, request: SearchRequest, heads: int, blocks: int):
    """The chosen strategy obeys every constraint the search promises."""
    s, setup = result.best.strategy, result.setup
    assert s.dp * s.mp * s.pp == request.world
    assert heads % s.mp == 0 and s.pp <= blocks
    assert setup.global_batch % (s.dp * s.micro_batches) == 0
    assert (
        s.pp == 1
        or (s.micro_batches == 1 and s.schedule == "sequential")
        or (s.micro_batches >= s.pp and s.schedule in ("1F1B", "VPP"))
    )
    assert result.best.estimate.memory.total <= request.device.memory_bytes * MEMORY_USABLE
    assert s.sequence_parallel is False or s.mp > 1
    assert s.sharding_stage == 0 or s.dp > 1


@pytest.mark.slow
def test_a_model_that_fits_on_one_device_prefers_data_parallel(gpt2_small):
    result = search(gpt2_small, SearchRequest(devices_per_node=8, device=H100))
    assert (result.best.strategy.dp, result.best.strategy.mp, result.best.strategy.pp) == (8, 1, 1)


@pytest.mark.slow
def test_a_model_that_does_not_fit_gets_mp_or_pp(llama_3b8):
    # 3.8B parameters x 16 bytes of model state = 61 GB: more than an A100-40GB holds.
    no_zero = search(llama_3b8, SearchRequest(devices_per_node=8, device=A100_40, sharding_stage=0))
    assert no_zero.best.strategy.mp * no_zero.best.strategy.pp > 1
    searched = search(llama_3b8, SearchRequest(devices_per_node=8, device=A100_40)).best.strategy
    assert searched.mp * searched.pp > 1 or searched.sharding_stage > 0  # never plain replicated dp


@pytest.mark.slow
@pytest.mark.parametrize(("devices_per_node", "nodes"), [(8, 2), (8, 4), (6, 4)])
def test_mp_stays_inside_a_node(llama_3b8, devices_per_node, nodes):
    # Without ZeRO (which would let plain dp fit: FSDP-style zero3 is what the search picks then),
    # 16 bytes of states per parameter x 6.7 B do not fit in 40 GB: the model must be split.
    # A global batch of 8 samples a node, so data parallelism is not capped by the batch.
    result = search(
        llama_3b8,
        SearchRequest(
            devices_per_node=devices_per_node,
            nodes=nodes,
            device=A100_40,
            sharding_stage=0,
            global_batch_size=8 * nodes * devices_per_node,
        ),
    )
    best = result.best.strategy
    assert best.mp * best.pp > 1  # the model needs splitting here (by mp, or by real pipelines now)
    assert best.mp == 1 or group_within_node(best.mp, 1, devices_per_node)


@pytest.mark.slow
def test_an_mp_group_across_nodes_is_priced_slower(llama_3b8):
    from autodist.planner.cost.graph_cost import model_cost

    table = StageTable(model_cost(llama_3b8))
    strategy = Strategy(dp=2, mp=8, micro_batches=2)
    inside = Setup(device=H100, devices_per_node=8, nodes=2, seq_len=1024, global_batch=16)
    across = Setup(device=H100, devices_per_node=4, nodes=4, seq_len=1024, global_batch=16)
    # Across nodes of 4: four members per node, four 50 GB/s NICs (200 GB/s) against NVLink's 450.
    assert estimate(table, strategy, across).mp_comm_s > 2 * estimate(table, strategy, inside).mp_comm_s


@pytest.mark.slow
def test_impossible_request_names_the_memory_it_would_need(llama_3b8):
    with pytest.raises(PlannerError) as err:
        search(llama_3b8, SearchRequest(devices_per_node=1, device=A100_40))
    message = str(err.value)
    assert "does not fit on 1 x a100-40g" in message
    needed = float(re.search(r"at least ([0-9.]+) GB", message).group(1))
    params = sum(math.prod(shape) for shape, _ in llama_3b8.params.values())
    assert needed * 1e9 * MEMORY_USABLE >= 16 * params  # at least the model states themselves


@pytest.mark.slow
@pytest.mark.parametrize(("devices_per_node", "nodes"), [(n, 1) for n in range(1, 17)] + [(8, 2), (8, 4), (8, 16)])
def test_every_device_count_gets_a_valid_plan(llama_3b8, devices_per_node, nodes):
    request = SearchRequest(devices_per_node=devices_per_node, nodes=nodes, device=H100, dtype="bf16")  # AMP
    result = search(llama_3b8, request)
    assert_valid(result, request, heads=32, blocks=32)
    times = [c.estimate.step_time_s for c in [result.best, *result.accepted]]
    assert times == sorted(times) and len(result.accepted) <= 10


@pytest.mark.slow
def test_six_devices_reject_mp3_and_mp6_with_the_reason(llama_3b8):
    result = search(llama_3b8, SearchRequest(devices_per_node=6, device=H100))
    reasons = {(r.strategy.mp, r.strategy.pp): r.reason for r in result.rejected}
    assert reasons[(3, 1)] == "mp=3 does not divide the 32 heads of layers.0-31"
    assert "mp=6 does not divide" in reasons[(6, 1)]


@pytest.mark.slow
def test_fixed_degrees_constrain_the_search(llama_3b8):
    result = search(llama_3b8, SearchRequest(devices_per_node=8, mp=4, sequence_parallel=True, device=H100))
    for candidate in [result.best, *result.accepted]:
        assert candidate.strategy.mp == 4 and candidate.strategy.sequence_parallel
    pinned = search(
        llama_3b8,
        SearchRequest(devices_per_node=8, dp=2, mp=2, pp=2, micro_batches=4, global_batch_size=8, device=H100),
    )
    best = pinned.best.strategy
    # The docstring Llama is cut at its blocks: a pipelining schedule, VPP's smaller bubble winning.
    assert (best.dp, best.mp, best.pp, best.micro_batches, best.schedule, best.virtual_stages) == (2, 2, 2, 4, "VPP", 2)


def test_default_schedule_is_a_pipelining_one_for_a_model_with_blocks(llama_3b8):
    """1F1B for any model the applier can cut at its blocks (not only a paddle.nn.Sequential), a
    named schedule always wins, and sequential only where no pipelining schedule can run."""
    request = SearchRequest(devices_per_node=4, dp=1, mp=2, pp=2, micro_batches=4, device=H100)
    cost = model_cost(llama_3b8)
    assert search(cost, request).best.strategy.schedule in ("1F1B", "VPP")
    assert search(cost, dataclasses.replace(request, schedule="1F1B")).best.strategy.schedule == "1F1B"
    assert (
        search(cost, dataclasses.replace(request, micro_batches=1, schedule="sequential")).best.strategy.schedule
        == "sequential"
    )


def test_vpp_is_a_candidate_when_the_blocks_fill_two_chunks_per_stage(llama_3b8):
    """VPP (2 chunks per rank) is priced beside 1F1B; with one block per chunk it is not."""
    request = SearchRequest(devices_per_node=4, mp=2, pp=2, micro_batches=4, device=H100)
    result = search(model_cost(llama_3b8), request)
    priced = {(c.strategy.schedule, c.strategy.virtual_stages) for c in [result.best, *result.accepted]}
    assert ("1F1B", 1) in priced and ("VPP", 2) in priced
    three_blocks = dataclasses.replace(model_cost(llama_3b8), blocks=model_cost(llama_3b8).blocks[:3])
    result = search(three_blocks, request)
    assert {c.strategy.schedule for c in [result.best, *result.accepted]} == {"1F1B"}


@pytest.mark.parametrize(
    ("request_kwargs", "message"),
    [
        (dict(devices_per_node=8, mp=3), "--mp 3 does not divide the 8 devices"),
        (dict(devices_per_node=8, dp=2, mp=2, pp=1), "dp x mp x pp = 4 but there are 8 devices"),
        (
            dict(devices_per_node=8, dp=4, mp=4),
            "dp=4 x mp=4 needs 16 devices, but there are 8 (--nnodes x --nproc-per-node)",
        ),
        (dict(devices_per_node=2, dtype="fp8"), "unknown dtype 'fp8'"),
        (dict(devices_per_node=2, recompute="some"), "unknown recompute 'some'"),
        (dict(devices_per_node=2, schedule="gpipe"), "unknown schedule 'gpipe'"),
        (dict(devices_per_node=0), "at least 1"),
    ],
)
def test_inconsistent_requests_are_clear_errors(request_kwargs, message):
    model, program, graph = traced("gpt")
    with pytest.raises(PlannerError, match=re.escape(message)):
        search(analyze(program, graph, model), SearchRequest(**request_kwargs))


def test_micro_batches_below_pp_are_rejected_for_1f1b():
    model, program, graph = traced("gpt")
    analysis = analyze(program, graph, model)
    with pytest.raises(PlannerError) as err:
        search(analysis, SearchRequest(devices_per_node=2, pp=2, micro_batches=1, schedule="1F1B", device=H100))
    assert "1F1B needs at least pp=2 micro-batches, got 1" in err.value.detail
    # The sequential schedule does not pipeline micro-batches, so one is fine; it is what the
    # search falls back to when no pipelining schedule can run.
    sequential = search(analysis, SearchRequest(devices_per_node=2, pp=2, micro_batches=1, device=H100))
    assert sequential.best.strategy.schedule == "sequential"


def test_sequential_pipelines_take_one_micro_batch():
    """apply_plan accumulates only without a pipeline, so a sequential plan never asks for more."""
    model, program, graph = traced("gpt")
    analysis = analyze(program, graph, model)
    searched = search(analysis, SearchRequest(devices_per_node=2, pp=2, schedule="sequential", global_batch_size=8))
    assert searched.best.strategy.micro_batches == 1
    with pytest.raises(PlannerError) as err:
        search(analysis, SearchRequest(devices_per_node=2, pp=2, micro_batches=2, schedule="sequential"))
    assert "accumulates micro-batches only without a pipeline" in err.value.detail


def test_a_model_without_blocks_gets_data_parallel_and_says_why_not_mp():
    model, program, graph = traced("cnn")
    request = SearchRequest(devices_per_node=4, device=H100, global_batch_size=8)  # the spec's batch is 2
    result = search(analyze(program, graph, model), request)
    assert (result.best.strategy.dp, result.best.strategy.mp, result.best.strategy.pp) == (4, 1, 1)
    assert any("no transformer block" in r.reason for r in result.rejected if r.strategy.mp > 1)


def test_search_is_deterministic_and_explained():
    model, program, graph = traced("gpt")
    analysis = analyze(program, graph, model)
    request = SearchRequest(devices_per_node=4, nodes=2, device=H100)
    first, second = search(analysis, request), search(analysis, request)
    encode = msgspec.json.encode
    assert encode([first.best, *first.accepted, *first.rejected]) == encode(
        [second.best, *second.accepted, *second.rejected]
    )
    table = explain_table(first)
    assert strategy_text(first.best.strategy, "short") in table.splitlines()[2]
    assert "where the time of #1 goes" in table


def test_the_input_specs_batch_is_the_global_batch():
    """One meaning of the batch: the spec's batch is what the loader yields per optimizer step
    over all ranks, however many devices; --global-batch-size overrides it."""
    model, program, graph = traced("gpt")  # input spec batch 2
    analysis = analyze(program, graph, model)
    assert search(analysis, SearchRequest(devices_per_node=2, device=H100)).setup.global_batch == 2
    assert (
        search(analysis, SearchRequest(devices_per_node=2, device=H100, global_batch_size=16)).setup.global_batch == 16
    )


def test_a_batch_that_does_not_divide_over_the_fixed_dp_is_refused_at_plan_time():
    model, program, graph = traced("gpt")
    with pytest.raises(
        PlannerError,
        match=re.escape("global batch 2 (the input spec's batch) does not divide over dp=4 x 1 micro-batches"),
    ):
        search(analyze(program, graph, model), SearchRequest(devices_per_node=4, dp=4, device=H100))
    with pytest.raises(
        PlannerError, match=re.escape("global batch 8 (--global-batch-size) does not divide over dp=2 x 8")
    ):
        search(
            analyze(program, graph, model),
            SearchRequest(devices_per_node=2, dp=2, micro_batches=8, global_batch_size=8, device=H100),
        )
