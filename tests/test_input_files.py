"""Every input file is bounded and typed (issue #23, item 7): plans, ``--rules`` and ``--cluster``
TOML are regular files of bounded size, nesting and line length; anything else is one ``error:``
line and exit 2 within seconds. Runs that could hang or eat memory on a regression (a FIFO,
``/dev/zero``) run in a subprocess with a short timeout and a memory limit."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from harness.cli import DOCSTRING, run, tiny_docstring  # noqa: F401 (autouse fixture)
from test_show import EXAMPLE, layered_plan

from autodist.planner.cost.hardware import load_cluster_file
from autodist.planner.errors import PlannerError
from autodist.planner.recognise.rules import load_rules
from autodist.planner.review.render import render_svg
from autodist.schemas import PlanError, load_plan, save_plan
from autodist.schemas.inputs import InputFileError, load_toml, read_input_file
from autodist.schemas.io import MAX_PLAN_BYTES

CLI = [sys.executable, "-m", "autodist.planner.cli"]
#: A regression must fail the test, not hang the suite or fill the machine's memory.
TIMEOUT_S = 60
MEMORY_LIMIT = 4 << 30


def limited(cmd: list[str]) -> subprocess.CompletedProcess:
    def cap_memory() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))

    return subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, preexec_fn=cap_memory)


def assert_one_error_line(result, *fragments: str) -> None:
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, result.stderr[-2000:]
    for fragment in fragments:
        assert fragment in result.stderr, result.stderr


@pytest.fixture
def fifo(tmp_path) -> Path:
    path = tmp_path / "input.fifo"
    os.mkfifo(path)
    return path


# -- what is not a regular file: refused by type, never read -----------------------------------------


@pytest.mark.parametrize("command", ["show", "diff", "render"])
def test_a_fifo_or_a_device_is_not_a_plan(fifo, tmp_path, command):
    """A FIFO hung `show` forever (waiting for a writer); /dev/zero ate memory to MemoryError."""
    extra = {"show": [], "diff": [str(EXAMPLE)], "render": ["-o", str(tmp_path / "plan.svg")]}[command]
    for source in (fifo, "/dev/zero"):
        result = limited([*CLI, command, str(source), *extra])
        assert_one_error_line(result, "not a regular file", "give a plan file")
    assert not (tmp_path / "plan.svg").exists()


def test_a_fifo_or_a_device_is_not_a_rules_or_cluster_file(fifo):
    """The same for the TOML inputs, end to end through `autodist-plan` (Paddle imported and all)."""
    result = limited([*CLI, DOCSTRING, "--rules", str(fifo), "--cluster", "/dev/zero"])
    assert_one_error_line(result, "/dev/zero: not a regular file (a character device); give a cluster file")
    result = limited([*CLI, DOCSTRING, "--rules", str(fifo), "--devices", "2"])
    assert_one_error_line(result, "not a regular file (a FIFO (named pipe)); give a rules file")


def test_load_plan_refuses_a_fifo_within_seconds(fifo):
    script = f"from autodist.schemas import load_plan\nload_plan({str(fifo)!r})"
    result = limited([sys.executable, "-c", script])
    assert result.returncode != 0 and "PlanError" in result.stderr and "not a regular file" in result.stderr


# -- size ---------------------------------------------------------------------------------------------


def test_a_plan_larger_than_the_cap_is_refused_before_it_is_read(tmp_path):
    big = tmp_path / "plan.json"
    with open(big, "wb") as f:  # sparse: costs no disk
        f.truncate(MAX_PLAN_BYTES + 1)
    with pytest.raises(PlanError, match="larger than 64 MiB, the most a plan file may be"):
        load_plan(big)
    result = run("show", big)
    assert result.exit_code == 2 and "larger than 64 MiB" in result.stderr


def test_a_file_that_grows_past_the_cap_while_read_is_refused(tmp_path):
    path = tmp_path / "grows"
    path.write_bytes(b"x" * 100)
    with pytest.raises(InputFileError, match="larger than 50 B"):
        read_input_file(path, what="file", max_bytes=50)
    assert read_input_file(path, what="file", max_bytes=100) == b"x" * 100


# -- hostile TOML: nesting, key length, numbers ---------------------------------------------------------

HOSTILE_TOML = {
    # 3,000 nested arrays on one line, and one bracket a line: RecursionError in tomllib
    "deep_arrays": ("x = " + "[" * 3000 + "]" * 3000 + "\n", "line 1 is longer than 1000 characters"),
    "deep_arrays_one_a_line": ("x = " + "[\n" * 3000 + "]\n" * 3000, "nested deeper than 16 levels"),
    "deep_inline_tables": ("x = " + "{a = " * 30 + "1" + "}" * 30 + "\n", "nested deeper than 16 levels"),
    # a 100,000-part dotted header: RecursionError after seconds; as a key, a minute of parsing
    "dotted_header": ("[" + ".".join(["a"] * 100_000) + "]\n", "line 1 is longer than 1000 characters"),
    "dotted_key": (".".join(["a"] * 50_000) + " = 1\n", "line 1 is longer than 1000 characters"),
    "short_dotted_headers": ("[" + ".".join(["a"] * 40) + "]\n", "nested deeper than 16 levels"),
    # a 5,000-digit integer: ValueError (Python's int-from-string digit limit)
    "huge_integer": ("x = " + "9" * 5000 + "\n", "line 1 is longer than 1000 characters"),
    "binary": ("\x00\udcff", "not a text file"),
    "not_toml": ("x = = 1\n", "not valid TOML"),
}


@pytest.mark.parametrize("name", list(HOSTILE_TOML))
@pytest.mark.parametrize("reader", ["rules", "cluster"])
def test_hostile_toml_is_one_planner_error(tmp_path, name, reader):
    text, fragment = HOSTILE_TOML[name]
    path = tmp_path / f"{name}.toml"
    path.write_bytes(text.encode("utf-8", "surrogateescape"))
    load = load_rules if reader == "rules" else load_cluster_file
    with pytest.raises(PlannerError) as caught:
        load(str(path))
    assert fragment in caught.value.message and str(path) in caught.value.message


def test_the_toml_caps_leave_real_files_alone(tmp_path):
    """A rules file with long globs and a nested cluster-style table read as before."""
    path = tmp_path / "ok.toml"
    path.write_text('"model.layers.*.self_attn.q_proj" = "colwise"\n[device]\nbase = "h100-sxm"\nx = [[1, 2], [3]]\n')
    assert load_toml(path, what="rules file")["device"]["x"] == [[1, 2], [3]]


def test_a_denormal_bandwidth_is_refused_by_name(tmp_path):
    """5e-324 GB/s passed as positive and made every estimate infinite: `estimate.step_time_s ... got null`."""
    path = tmp_path / "cluster.toml"
    path.write_text('[device]\nbase = "h100-sxm"\ninter_node_bandwidth_gb_s = 5e-324\n')
    with pytest.raises(PlannerError, match=r"\[device\].inter_node_bandwidth_gb_s must be .* at least 1e-06"):
        load_cluster_file(str(path))
    result = run(DOCSTRING, "--cluster", path, "--devices", 2)
    assert result.exit_code == 2 and "inter_node_bandwidth_gb_s" in result.stderr and "null" not in result.stderr


# -- render is bounded like show ----------------------------------------------------------------------


def test_render_of_a_million_rank_mesh_is_abridged(tmp_path):
    """A valid plan with a 1,000,000-rank mesh wrote a 155 MB SVG in 34 s (890 MB RSS)."""
    plan = layered_plan(layers=2, dp=1_000_000, mp=1)
    svg = render_svg(plan)
    assert len(svg) < 2_000_000
    root = ET.fromstring(svg)
    drawn = [int(e.get("data-rank")) for e in root.iter() if e.get("class") == "rank"]
    assert drawn[0] == 0 and drawn[-1] == 999_999 and len(drawn) < 5000
    assert any(e.get("class") == "ellipsis" for e in root.iter())
    path = tmp_path / "plan.json"
    save_plan(plan, path)
    assert run("render", path, "-o", tmp_path / "plan.svg").exit_code == 0
    assert (tmp_path / "plan.svg").stat().st_size < 2_000_000


def test_render_of_a_small_plan_draws_every_rank():
    root = ET.fromstring(render_svg(load_plan(EXAMPLE)))
    assert not any(e.get("class") == "ellipsis" for e in root.iter())
