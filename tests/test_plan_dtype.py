"""The dtype a plan is priced in: the model's parameters' unless ``--dtype`` asks for mixed precision.

``--dtype`` once defaulted to bf16 for every model, also on the CPU profile, whose wheel has no
bf16 matmul: a float32 model's plan then said each rank holds half the parameter bytes it holds,
and nothing said why. Here a float32 docstring Llama (sizes that coincide nowhere) is planned at
mp=2 without ``--dtype``, applied on two real gloo ranks, and each rank's shards are weighed.
"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from autodist.planner.cli.review import show
from autodist.planner.review.format import human_bytes
from autodist.schemas import load_plan
from harness.launcher import launch_ranks
from harness.planning import plan_command

#: No two sizes alike: vocab, hidden, intermediate, heads, layers, sequence.
CONFIG = dict(vocab_size=96, hidden_size=40, intermediate_size=72, num_heads=4, num_layers=3, seq_length=12)
ENV = {f"LLAMA_DOCSTRING_{k.upper()}": str(v) for k, v in CONFIG.items()}
TARGET = "plans/llama_docstring/model.py"
ARGUMENTS = ["--devices", "2", "--mp", "2", "--device", "cpu", "--input-spec", "input_ids:int64:4x12"]

#: One rank: the model as its file builds it (float32), the plan applied, its shards weighed.
RANK = """
import json, sys
import paddle.distributed as dist
from autodist.applier import apply_plan
from harness.memory import local_parameter_bytes
from harness.workloads import load_model_file
config = json.loads(sys.argv[1])
dist.init_parallel_env()
model = load_model_file("plans/llama_docstring/model.py", "llama_docstring_model").build_model(**config)
model, _, _ = apply_plan(model, None, None, sys.argv[2])
print(json.dumps({"local": local_parameter_bytes(model), "dtypes": sorted({str(p.dtype) for p in model.parameters()})}))
"""


@pytest.mark.multiprocess
def test_a_float32_plan_shows_the_bytes_its_shards_hold(tmp_path):
    path = plan_command(TARGET, ARGUMENTS, tmp_path / "plan.json", ENV)
    plan = load_plan(path)
    assert plan.provenance.arguments["dtype"] == "fp32"
    job = launch_ranks(2, ["-c", RANK, json.dumps(CONFIG), str(path)], workdir=tmp_path, timeout_s=240)
    job.raise_for_failure()
    reports = [json.loads(p.stdout.strip().splitlines()[-1]) for p in job.processes]
    assert all(r["dtypes"] == ["paddle.float32"] for r in reports), reports
    held = max(r["local"] for r in reports)
    shown = json.loads(CliRunner().invoke(show, [str(path), "--json"]).output)
    assert shown["estimate"]["memory"]["params"] == held, (shown["estimate"]["memory"], reports)
    assert shown["dtype"] == "fp32"
    text = CliRunner().invoke(show, [str(path)]).output
    assert f"params {human_bytes(held)}," in text and "\ndtype     fp32\n" in text, text


def test_mixed_precision_is_priced_only_when_asked(tmp_path):
    """``--dtype bf16`` on float32 parameters: half the parameter bytes, and ``show`` says it is
    mixed precision over float32 parameters."""
    fp32 = load_plan(plan_command(TARGET, ARGUMENTS, tmp_path / "fp32.json", ENV))
    path = plan_command(TARGET, [*ARGUMENTS, "--dtype", "bf16"], tmp_path / "bf16.json", ENV)
    bf16 = load_plan(path)
    assert 2 * bf16.estimate.memory.params == fp32.estimate.memory.params
    text = CliRunner().invoke(show, [str(path)]).output
    assert "\ndtype     bf16 (mixed precision: float32 parameters)\n" in text, text
