"""PaddleFormers ``LlamaForCausalLM`` (tiny, grouped-query attention: 4 heads, 2 KV heads,
tied embedding / LM head) trained with a plan on several CPU ranks equals one device."""

from __future__ import annotations

import pytest

from harness.cases import Config, check_against_reference, train_configurations

pytestmark = pytest.mark.multiprocess

#: Hand-written plans, and the planner's dp2 x mp2 plan (vocabulary-parallel tied embedding).
CONFIGS = [Config(mp=2), Config(dp=2, mp=2, optimizer="adamw"), Config(dp=2, mp=2, plan_source="planner")]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, reference_runs):
    results = train_configurations("paddleformers_llama", CONFIGS, tmp_path_factory.mktemp("pf_llama"))
    reference_runs.prepare([t.run for t in results.values()])
    return results


@pytest.mark.parametrize("name", [c.name for c in CONFIGS])
def test_paddleformers_llama_matches_single_device(trained, reference_runs, name):
    check_against_reference(trained[name], reference_runs)
