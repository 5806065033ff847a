"""`autodist-plan render`: a plain SVG that parses, shows every rank, every stage and a memory bar
per group of identical ranks, and converts to PNG where a converter is installed."""

from __future__ import annotations

import shutil
import subprocess
import xml.etree.ElementTree as ET

import msgspec
import pytest
from click.testing import CliRunner
from test_show import EXAMPLE, layered_plan

from autodist.planner.review.render import rank_param_elements, render_svg
from autodist.planner.cli.review import render
from autodist.schemas import MemoryEstimate, load_plan, save_plan

SVG = "{http://www.w3.org/2000/svg}"


def with_memory(plan, **kinds):
    memory = MemoryEstimate(**kinds, total=sum(kinds.values()))
    return msgspec.structs.replace(plan, estimate=msgspec.structs.replace(plan.estimate, memory=memory))


def elements(root, cls):
    return [e for e in root.iter() if e.get("class") == cls]


def test_every_rank_and_stage_is_drawn():
    plan = layered_plan(layers=8, dp=2, mp=2, pp=2)
    root = ET.fromstring(render_svg(plan))
    assert root.tag == f"{SVG}svg"
    assert sorted(int(e.get("data-rank")) for e in elements(root, "rank")) == list(range(8))
    stages = elements(root, "stage-label")
    assert [e.text.split(":")[0] for e in stages] == ["stage 0", "stage 1"]
    assert "llama.layers.{0-3}" in stages[0].text and "llama.layers.{4-7}" in stages[1].text


@pytest.mark.parametrize("dp, mp", [(1024, 1), (128, 8)])
def test_large_meshes_fit_the_page(dp, mp):
    root = ET.fromstring(render_svg(layered_plan(layers=2, dp=dp, mp=mp)))
    ranks = elements(root, "rank")
    assert len(ranks) == dp * mp
    right = max(float(r.get("x")) + float(r.get("width")) for r in ranks)
    bottom = max(float(r.get("y")) + float(r.get("height")) for r in ranks)
    assert right <= float(root.get("width")) and bottom <= float(root.get("height")) <= 1200


def test_memory_bars_follow_the_parameter_share():
    plan = with_memory(layered_plan(layers=8, dp=2, mp=2, pp=2), params=400, grads=400, optimizer=800, activations=100)
    root = ET.fromstring(render_svg(plan))
    # stage 0 also holds the embedding, so its ranks carry more than stage 1's: two groups of bars
    labels = [e.text for e in elements(root, "bar-label")]
    assert labels == ["ranks 0-3", "ranks 4-7"]
    share = rank_param_elements(plan)
    assert share[0] > share[4] and len(set(share[:4])) == 1
    widths = {}
    for bar in elements(root, "memory"):
        widths.setdefault(bar.get("data-kind"), []).append(float(bar.get("data-bytes")))
    assert widths["params"][0] == 400 and widths["params"][1] == pytest.approx(400 * share[4] / share[0], abs=1)
    assert widths["activations"] == [100, 100]


def test_over_memory_is_marked():
    plan = layered_plan(layers=2, mp=2)
    device = plan.cluster.device.memory_bytes
    root = ET.fromstring(render_svg(with_memory(plan, params=device, activations=device // 2)))
    assert all(e.get("stroke") == "#d62728" for e in elements(root, "device-memory"))
    assert "(over!)" in elements(root, "bar-total")[0].text


def test_cli_writes_svg(tmp_path):
    out = tmp_path / "plan.svg"
    result = CliRunner().invoke(render, [str(EXAMPLE), "-o", str(out)])
    assert result.exit_code == 0, result.output
    root = ET.parse(out).getroot()
    assert len(elements(root, "rank")) == len(load_plan(EXAMPLE).mesh.process_ids)


def test_cli_error_exit_2(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("[]")
    result = CliRunner().invoke(render, [str(bad), "-o", str(tmp_path / "x.svg")])
    assert result.exit_code == 2 and result.output.startswith("error: ")
    assert not (tmp_path / "x.svg").exists()


def _converter():
    """A command line that turns an SVG into a PNG, if one really works here."""
    for command in (["rsvg-convert", "{svg}", "-o", "{png}"], ["convert", "{svg}", "{png}"]):
        if shutil.which(command[0]):
            yield command


def test_converts_to_png(tmp_path):
    svg = tmp_path / "plan.svg"
    plan = with_memory(
        layered_plan(layers=8, dp=2, mp=2, pp=2), params=3 << 30, grads=3 << 30, optimizer=6 << 30, activations=2 << 30
    )
    save_plan(plan, tmp_path / "plan.json")
    svg.write_text(render_svg(plan))
    tried = []
    for command in _converter():
        png = tmp_path / f"plan.{command[0]}.png"
        run = subprocess.run([a.format(svg=svg, png=png) for a in command], capture_output=True, text=True, timeout=60)
        if run.returncode == 0 and png.exists():
            assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
            return
        tried.append(f"{command[0]}: {(run.stderr or run.stdout).strip()[:120]}")
    pytest.skip(
        "no working SVG to PNG converter (rsvg-convert or ImageMagick convert)" + (f": {tried}" if tried else "")
    )


def test_a_small_models_bars_are_scaled_to_its_largest_rank():
    """Kilobytes against a 16 GiB device once drew bars 0 wide; the largest rank's bar now spans
    the bar width and the heading says the scale (no outline: no rank reaches the device)."""
    plan = with_memory(layered_plan(layers=8, dp=2, mp=2, pp=2), params=400, grads=400, optimizer=800, activations=100)
    root = ET.fromstring(render_svg(plan))
    spans: dict[str, float] = {}
    for bar in elements(root, "memory"):
        spans[bar.get("y")] = spans.get(bar.get("y"), 0.0) + float(bar.get("width"))  # one row per group
    assert max(spans.values()) == pytest.approx(900 - 2 * 20 - 150 - 70)  # render.py's bar width
    assert min(spans.values()) > 100, spans
    assert elements(root, "device-memory") == []
    heading = next(e.text for e in elements(root, "heading") if e.text.startswith("estimated memory"))
    assert heading == "estimated memory per rank (device: 16.0 GiB; bars to the largest rank's 1.7 KiB)"
