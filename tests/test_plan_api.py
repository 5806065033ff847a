"""``autodist.plan`` from Python: a training script builds its model, plans it and saves the plan;
that plan is the command line's for the same model file (only the provenance's target differs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

import autodist
from autodist.planner.cli import cli
from autodist.planner.errors import PlannerError

ROOT = Path(__file__).resolve().parents[1]
DOCSTRING = ROOT / "plans" / "llama_docstring" / "model.py"
TINY = dict(VOCAB_SIZE=64, HIDDEN_SIZE=32, INTERMEDIATE_SIZE=64, NUM_HEADS=4, NUM_LAYERS=2, SEQ_LENGTH=16)
TINY_ENV = {f"LLAMA_DOCSTRING_{k}": str(v) for k, v in TINY.items()}

#: What a user's training script does: build the model eagerly (real parameters), plan, save.
SCRIPT = textwrap.dedent("""
    import importlib.util, sys
    import autodist

    spec = importlib.util.spec_from_file_location("model", sys.argv[1])
    model_file = importlib.util.module_from_spec(spec)
    sys.modules["model"] = model_file
    spec.loader.exec_module(model_file)

    model = model_file.build_model()
    plan = autodist.plan(model, model_file.input_spec(), devices=4, nodes=2, device="a100-40g", mp=2)
    autodist.save_plan(plan, sys.argv[2])
""")


@pytest.mark.slow
def test_a_script_plans_its_model_and_gets_the_commands_plan(tmp_path, monkeypatch):
    script, from_python, from_cli = tmp_path / "train.py", tmp_path / "python.json", tmp_path / "cli.json"
    script.write_text(SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script), str(DOCSTRING), str(from_python)],
        capture_output=True,
        text=True,
        env={**os.environ, **TINY_ENV},
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    for name, value in TINY_ENV.items():
        monkeypatch.setenv(name, value)
    result = CliRunner().invoke(
        cli,
        [
            str(DOCSTRING),
            "--devices",
            "4",
            "--nodes",
            "2",
            "--device",
            "a100-40g",
            "--mp",
            "2",
            "-q",
            "-o",
            str(from_cli),
        ],
    )
    assert result.exit_code == 0, result.output
    python_plan, cli_plan = json.loads(from_python.read_text()), json.loads(from_cli.read_text())
    assert python_plan["provenance"]["arguments"].pop("target") == "model:Model"  # the script's module, its class
    assert cli_plan["provenance"]["arguments"].pop("target") == str(DOCSTRING)
    assert python_plan == cli_plan
    assert python_plan["strategy"]["mp"] == 2 and python_plan["cluster"]["nodes"] == 2


def test_plan_from_python_takes_input_spec_strings_and_reports_bad_degrees(monkeypatch):
    for name, value in TINY_ENV.items():
        monkeypatch.setenv(name, value)
    from models.traced import docstring_module

    model = docstring_module().build_model()
    plan = autodist.plan(model, ["input_ids:int64:2x8"], devices=2, device="cpu")
    assert plan.model.input_specs[0].shape == [2, 8]
    assert plan.provenance.arguments["input_specs"] == "input_ids:int64:2x8"
    with pytest.raises(PlannerError, match="--mp 3 does not divide the 4 heads of "):
        autodist.plan(model, ["input_ids:int64:2x8"], devices=3, mp=3)
