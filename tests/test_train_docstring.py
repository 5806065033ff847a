"""The Llama of ``paddle.distributed.to_distributed``'s docstring (tiny sizes, 2 layers) trained
with a plan on 2 and 4 CPU ranks gives the losses and parameters of one device, with SGD and
with AdamW (weight decay, a step learning-rate schedule, global-norm gradient clipping)."""

from __future__ import annotations

import pytest

from harness.cases import check_against_reference, config_name, train_configurations

pytestmark = pytest.mark.multiprocess

#: (dp, mp, optimizer): dp2 and mp2 share one 2-rank job, dp2 x mp2 is one 4-rank job.
CONFIGS = [(dp, mp, opt) for dp, mp in [(2, 1), (1, 2), (2, 2)] for opt in ("sgd", "adamw")]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, reference_runs):
    results = train_configurations("docstring_llama", CONFIGS, tmp_path_factory.mktemp("docstring_llama"))
    reference_runs.prepare([t.run for t in results.values()])
    return results


@pytest.mark.parametrize("name", [config_name(*c) for c in CONFIGS])
def test_docstring_llama_matches_single_device(trained, reference_runs, name):
    check_against_reference(trained[name], reference_runs)
