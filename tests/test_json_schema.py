"""`autodist-plan schema` prints a JSON Schema that accepts valid plans and rejects broken ones."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

EXAMPLE = json.loads((Path(__file__).parent / "data" / "example_plan.json").read_text())


@pytest.fixture(scope="module")
def validator() -> jsonschema.Draft202012Validator:
    cli = [sys.executable, "-c", "from autodist.planner.cli import main; main()", "schema"]
    schema = json.loads(subprocess.run(cli, capture_output=True, text=True, check=True).stdout)
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def test_schema_accepts_the_hand_written_example(validator):
    assert list(validator.iter_errors(EXAMPLE)) == []


@pytest.mark.parametrize(
    "path, value",
    [
        (("params", "layers.0.norm.weight", "placements", 0), "Shard(0)"),  # not a short placement
        (("strategy", "sharding_stage"), 4),  # ZeRO has stages 0..3
        (("mesh", "axes", 0), "tp"),  # axes are pp, dp, mp
        (("strategy", "dp"), 0),  # degrees are positive
        (("model", "param_fingerprint"), "not-a-sha"),
        (("hooks", 0, "when"), "during"),
        (("hooks", 0, "to_stage"), 1),  # only a stage_handoff has a target stage (tagged union)
        (("hooks", 0, "action"), "teleport"),
    ],
)
def test_schema_rejects_invalid_values(validator, path, value):
    doc = json.loads(json.dumps(EXAMPLE))
    node = doc
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    assert list(validator.iter_errors(doc)), f"schema accepted {path} = {value!r}"


def test_schema_rejects_unknown_and_missing_fields(validator):
    doc = json.loads(json.dumps(EXAMPLE))
    doc["strategy"]["tensor_parallel"] = 2
    assert any("Additional properties" in e.message for e in validator.iter_errors(doc))
    doc = json.loads(json.dumps(EXAMPLE))
    del doc["mesh"]
    assert any("'mesh' is a required property" in e.message for e in validator.iter_errors(doc))
