"""The review commands on mutated plans: only exit 0, 1 or 2, and an error is one line.

The same mutations as test_schema_fuzz.py (a value deleted, replaced or added anywhere in a
plan); whatever ``load_plan`` accepts, ``show``, ``diff``, ``export``, ``render`` and ``check``
must handle without a traceback.
"""

from __future__ import annotations

import json

from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autodist.planner.cli.review import check, diff, export, render, show
from test_schema_fuzz import ALL_PATHS, EXAMPLE, json_values, mutate

COMMANDS = {
    "show": lambda plan, original: [show, [plan]],
    "show --json": lambda plan, original: [show, [plan, "--json"]],
    "diff": lambda plan, original: [diff, [original, plan]],
    "export": lambda plan, original: [export, [plan, "--to", "paddle-parallelize"]],
    "render": lambda plan, original: [render, [plan]],
}
FUZZ = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)


def assert_clean_exit(result, what: str) -> None:
    """Exit 0/1/2, never an exception escaping; a failure is one ``error:`` line."""
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise AssertionError(f"{what}: {type(result.exception).__name__}: {result.exception}") from result.exception
    assert result.exit_code in (0, 1, 2), f"{what}: exit {result.exit_code}\n{result.output}"
    if result.exit_code == 2:
        assert result.output.startswith("error: ") and result.output.count("\n") == 1, f"{what}:\n{result.output}"


def write_mutant(tmp_path, path, action, value) -> tuple[str, str]:
    original = tmp_path / "original.json"
    original.write_text(json.dumps(EXAMPLE))
    mutant = tmp_path / "mutant.json"
    mutant.write_text(json.dumps(mutate(EXAMPLE, path, action, value)))
    return str(mutant), str(original)


@FUZZ
@given(
    path=st.sampled_from(ALL_PATHS),
    action=st.sampled_from(["delete", "replace", "add"]),
    value=json_values,
    command=st.sampled_from(sorted(COMMANDS)),
)
def test_review_commands_on_mutated_plans(tmp_path, path, action, value, command):
    plan, original = write_mutant(tmp_path, path, action, value)
    cmd, args = COMMANDS[command](plan, original)
    assert_clean_exit(CliRunner().invoke(cmd, args), f"{command} after {action} at {path}")


@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
@given(path=st.sampled_from(ALL_PATHS), action=st.sampled_from(["delete", "replace", "add"]), value=json_values)
def test_check_on_mutated_plans(tmp_path, path, action, value):
    plan, _ = write_mutant(tmp_path, path, action, value)
    result = CliRunner().invoke(check, [plan, "plans/gpt/model.py", "--no-trace", "-q"])
    assert_clean_exit(result, f"check after {action} at {path}")


def test_a_deeply_nested_note_is_one_error_line(tmp_path):
    path = tmp_path / "deep.json"
    path.write_text(json.dumps(dict(EXAMPLE, notes="NOTES")).replace('"NOTES"', "[" + "[" * 5000 + "]" * 5000 + "]"))
    for cmd, args in [COMMANDS[c](str(path), str(path)) for c in COMMANDS]:
        assert_clean_exit(CliRunner().invoke(cmd, args), cmd.name)
