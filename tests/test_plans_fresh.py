"""The checked-in example plans and the plan-format docs are kept honest.

Every ``plans/*/plan_*.json`` is re-made, into a temporary folder, with the planner arguments
recorded in its own ``provenance.arguments``; a plan that differs from what the planner now
makes fails with a unified diff (re-make them with ``make plans``). And docs/plan-format.md
describes every field of every plan Struct, with an example that is a valid plan.
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path

import click
import msgspec
import pytest
from click.testing import CliRunner

import autodist.schemas.plan as plan_module
from autodist.schemas import load_plan

REPO = Path(__file__).resolve().parents[1]
PLANS = sorted(REPO.glob("plans/*/plan_*.json"))
PLAN_FORMAT_DOC = REPO / "docs" / "plan-format.md"
MAX_DIFF_LINES = 80


def command_line(arguments: dict[str, str]) -> list[str]:
    """Planner arguments as recorded in a plan -> the ``autodist-plan`` command line that makes it.

    The record holds the ``plan`` command's parameter names and values as strings (see
    ``planner_arguments`` in cli/main.py); the command's own parameter list turns them back into options.
    """
    from autodist.planner.cli.main import plan as plan_command

    args: list[str] = []
    known = {param.name for param in plan_command.params}
    unknown = sorted(set(arguments) - known)
    assert not unknown, f"provenance names arguments the planner no longer has: {unknown}"
    for param in plan_command.params:
        if param.name not in arguments:
            continue
        value = arguments[param.name]
        if isinstance(param, click.Argument):
            args.insert(0, value)
        elif param.is_flag and param.secondary_opts:  # --x/--no-x
            args.append(param.opts[0] if value == "True" else param.secondary_opts[0])
        elif param.is_flag:
            if value == "True":
                args.append(param.opts[0])
        elif param.multiple:
            for item in value.split(","):
                args += [param.opts[0], item]
        else:
            args += [param.opts[0], value]
    return args


def test_there_are_plans_to_check():
    folders = {path.parent.name for path in PLANS}
    assert {"llama_docstring", "gpt", "paddleformers_llama"} <= folders, folders


@pytest.mark.parametrize("checked_in", PLANS, ids=[str(p.relative_to(REPO / "plans")) for p in PLANS])
def test_checked_in_plan_is_fresh(checked_in, tmp_path, monkeypatch):
    from autodist.planner.cli import cli

    args = command_line(load_plan(checked_in).provenance.arguments)
    fresh = tmp_path / checked_in.name
    monkeypatch.chdir(REPO)  # recorded targets are relative to the repository root
    result = CliRunner().invoke(cli, [*args, "--quiet", "-o", str(fresh)])
    assert result.exit_code == 0, f"autodist-plan {' '.join(args)} failed:\n{result.output}"
    old, new = checked_in.read_text(), fresh.read_text()
    if old != new:
        diff = list(
            difflib.unified_diff(
                old.splitlines(), new.splitlines(), str(checked_in.relative_to(REPO)), "re-made now", lineterm=""
            )
        )
        more = len(diff) - MAX_DIFF_LINES
        shown = "\n".join(diff[:MAX_DIFF_LINES]) + (f"\n... {more} more lines" if more > 0 else "")
        pytest.fail(f"{checked_in.relative_to(REPO)} is stale; run `make plans` and review the diff:\n{shown}")


# -- docs/plan-format.md --------------------------------------------------------------------------------


def plan_structs() -> dict[str, type]:
    return {
        name: obj
        for name, obj in vars(plan_module).items()
        if isinstance(obj, type) and issubclass(obj, msgspec.Struct) and obj is not plan_module.Base
    }


def encoded_keys(struct: type) -> list[str]:
    """The JSON keys of a Struct in the order a plan file writes them: the tag of a tagged union
    first (``action`` of hooks), then its fields."""
    tag = struct.__struct_config__.tag_field
    return ([tag] if tag else []) + [f.encode_name for f in msgspec.structs.fields(struct)]


def doc_sections() -> dict[str, str]:
    """``### `Name` ...`` sections of the doc, by Struct name."""
    text = PLAN_FORMAT_DOC.read_text()
    parts = re.split(r"^### `(\w+)`.*$", text, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def test_doc_describes_every_field_of_every_struct():
    sections, structs = doc_sections(), plan_structs()
    missing = []
    for name, struct in structs.items():
        if name not in sections:
            missing.append(f"no section for {name}")
            continue
        listed = re.findall(r"^\| `(\w+)` \|", sections[name], flags=re.M)
        # A subclass's section describes only what it adds to a Struct above it (the hook kinds).
        inherited = {key for base in struct.__mro__[1:] if base in structs.values() for key in encoded_keys(base)}
        declared = [key for key in encoded_keys(struct) if key not in inherited]
        rows, fields = set(listed), set(declared)
        missing += [f"{name}.{field}" for field in sorted(fields - rows)]
        missing += [f"{name}.{row} is described but is no field" for row in sorted(rows - fields)]
        if rows == fields and listed != declared:  # a plan file writes the fields in declared order
            missing.append(f"{name}: fields described in the order {listed}, written in the order {declared}")
    assert not missing, "docs/plan-format.md is out of step with schemas/plan.py: " + ", ".join(missing)


def test_doc_example_is_a_valid_plan():
    text = PLAN_FORMAT_DOC.read_text()
    example = re.search(r"```json\n(.*?)```", text, flags=re.S).group(1)
    plan = load_plan(example.encode())
    assert plan.mesh.axes == ["dp", "mp"]
