"""Recompute is a plan field and is applied: the layers a plan lists run their forward again
in backward (Paddle's recompute), and training gives the same losses as without."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
from harness.cases import Config, check_against_reference, train_configurations
from harness.plans import tensor_parallel_plan
from harness.workloads import WORKLOADS, make_loader, make_optimizer, train

from autodist.applier import apply_plan
from autodist.schemas import Plan, PlanError, Strategy, check_plan


def _recomputing_plan(model, mode: str, layers: list[str]) -> Plan:
    plan = tensor_parallel_plan(model)
    strategy = msgspec.structs.replace(plan.strategy, recompute=mode)
    return msgspec.structs.replace(plan, strategy=strategy, recompute=layers)


def _count_forwards(layer, counts: dict, name: str) -> None:
    forward = layer.forward

    def counted(*args, **kwargs):
        counts[name] = counts.get(name, 0) + 1
        return forward(*args, **kwargs)

    layer.forward = counted


def _train(recompute_layers: list[str] | None, steps: int = 2):
    workload = WORKLOADS["docstring_llama"]
    model = workload.build(seed=5)
    counts: dict[str, int] = {}
    for name in ("layers.0", "layers.1"):
        _count_forwards(dict(model.named_sublayers())[name], counts, name)
    optimizer, schedule = make_optimizer("adamw", model.parameters())
    loader = make_loader(workload, steps=steps, seed=5)
    if recompute_layers is not None:
        model, optimizer, loader = apply_plan(
            model, optimizer, loader, _recomputing_plan(model, "full", recompute_layers)
        )
    losses = train(workload, model, optimizer, schedule, loader, steps)
    return losses, {k: v.numpy() for k, v in model.state_dict().items()}, counts


def test_listed_blocks_run_forward_again_in_backward_with_equal_training():
    plain_losses, plain_state, plain_counts = _train(None)
    losses, state, counts = _train(["layers.0", "layers.1"])
    assert plain_counts == {"layers.0": 2, "layers.1": 2}
    assert counts == {"layers.0": 4, "layers.1": 4}  # once in forward, once more in backward
    np.testing.assert_allclose(losses, plain_losses, rtol=1e-6)
    for key in plain_state:
        np.testing.assert_allclose(state[key], plain_state[key], atol=1e-6, err_msg=key)


def test_only_listed_layers_are_recomputed():
    _, _, counts = _train(["layers.1"])
    assert counts == {"layers.0": 2, "layers.1": 4}


def test_a_listed_layer_the_model_lacks_is_refused_before_anything_changes():
    model = WORKLOADS["docstring_llama"].build(seed=0)
    with pytest.raises(PlanError, match=r'\$\.recompute\[0\]: no sub-layer "layers\.9"'):
        apply_plan(model, None, None, _recomputing_plan(model, "full", ["layers.9"]))
    assert not any(p.is_dist() for p in model.parameters())


def test_layers_without_a_recompute_strategy_are_inconsistent():
    model = WORKLOADS["docstring_llama"].build(seed=0)
    plan = msgspec.structs.replace(tensor_parallel_plan(model), recompute=["layers.0"])
    assert plan.strategy == Strategy()
    assert any("$.strategy.recompute is 'none'" in p for p in check_plan(plan))


@pytest.mark.multiprocess
def test_planned_full_recompute_on_mp2_trains_like_one_device(tmp_path, reference_runs):
    """autodist-plan --recompute full lists every block; 2 ranks apply it and match one device."""
    config = Config(mp=2, recompute="full", plan_source="planner")
    trained = train_configurations("docstring_llama", [config], tmp_path)[config.name]
    assert trained.plan.strategy.recompute == "full"
    assert trained.plan.recompute == [block.layer for block in trained.plan.blocks] == ["layers.0", "layers.1"]
    check_against_reference(trained, reference_runs)


@pytest.mark.parametrize(
    "name, mode, expected",
    [
        ("docstring", "full", ["layers.0", "layers.1"]),
        ("docstring", "selective", ["layers.0.self_attn", "layers.1.self_attn"]),
        ("llama", "selective", ["model.layers.0.self_attn", "model.layers.1.self_attn"]),  # PaddleFormers, GQA
        ("phi3", "selective", ["model.layers.0.self_attn", "model.layers.1.self_attn"]),  # fused qkv_proj
        ("gpt", "selective", ["blocks.0.attn", "blocks.1.attn"]),  # nanoGPT-style fused c_attn
        ("gpt", "none", []),
    ],
)
def test_the_planner_lists_the_layers_its_recompute_mode_prices(name, mode, expected):
    from models.traced import traced

    from autodist.planner.emit import recompute_layers
    from autodist.planner.recognise.analysis import analyze

    model, program, graph = traced(name)
    assert recompute_layers(analyze(program, graph, model), mode, []) == expected


def test_show_and_diff_say_what_is_recomputed():
    from autodist.planner.review.diff import diff_plans
    from autodist.planner.review.show import show_data, show_text

    model = WORKLOADS["docstring_llama"].build(seed=0)
    plain = tensor_parallel_plan(model)
    full = _recomputing_plan(model, "full", ["layers.0", "layers.1"])
    text = show_text(full)
    assert "recompute full" in text and "recompute (full): forward run again in backward\n  layers.*" in text
    assert show_data(full)["recompute"] == ["layers.*"]
    assert diff_plans(plain, full)[:3] == ["strategy: recompute none → full", "2 layers now recomputed:", "  layers.*"]
