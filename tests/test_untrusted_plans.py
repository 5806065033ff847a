"""Plans are untrusted input: names have a grammar, nothing generated from a plan runs its text.

Five ways plan text reached generated Python (``export --to paddle-parallelize``): the model's
class name, a parameter key, a model-own parameter name, a hook's layer and the plan's file name.
Each is tried twice: ``load_plan`` refuses the name with its JSON path, and the exporter, handed
the same name in a Plan built directly (as a Python caller could), writes it as a literal, so
importing the exported module runs no code and the module holds the name unchanged.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import msgspec
import pytest

from autodist.planner.review.export import ExportError, export_parallelize, paddle_key_matches
from autodist.schemas import Reshard, ParamPlan, PlanError, dump_plan, load_plan

from test_show import layered_plan


def code(marker: Path) -> str:
    """A Python expression that leaves ``marker`` behind when it runs. It has no dot, so it also
    fits a model-own parameter name (no dot: not a sub-layer's)."""
    assert "." not in str(marker)
    return f'getattr(getattr(__import__("pathlib"), "Path")({str(marker)!r}), "touch")()'


def import_file(path: Path) -> dict:
    spec = importlib.util.spec_from_file_location(f"exported_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return vars(module)


def with_param(plan, old: str, new: str):
    params = {new if k == old else k: v for k, v in plan.params.items()}
    return msgspec.structs.replace(plan, params=params)


def vectors(marker: Path) -> dict:
    """name -> (plan, plan file name, the untrusted name, JSON path load_plan must name)."""
    run = code(marker)
    base = layered_plan(layers=2, dp=1, mp=2, pp=2)
    q = "llama.layers.0.self_attn.q_proj.weight"
    evil_class = f'Llama"""\n{run}\n"""'
    evil_key = f'llama.layers.0.q"+str({run})+".weight'
    evil_own = f'w"+str({run})+"'
    evil_layer = f'llama.layers.0.q"+str({run})+"'
    evil_file = f'plan"""\n{run}\n""".json'
    own = ParamPlan(shape=[8, 32], dtype="float32", placements=["R", "S(1)"])
    hook = Reshard(layer=evil_layer, when="post", placements=["R", "R"])
    return {
        "class_name": (
            msgspec.structs.replace(base, model=msgspec.structs.replace(base.model, class_name=evil_class)),
            "plan.json",
            evil_class,
            "$.model.class_name",
        ),
        "param_key": (with_param(base, q, evil_key), "plan.json", evil_key, f"$.params[{json.dumps(evil_key)}]"),
        "model_own_param": (
            msgspec.structs.replace(base, params={**base.params, evil_own: own}),
            "plan.json",
            evil_own,
            f"$.params[{json.dumps(evil_own)}]",
        ),
        "hook_layer": (
            msgspec.structs.replace(base, hooks=[*base.hooks, hook]),
            "plan.json",
            evil_layer,
            f"$.hooks[{len(base.hooks)}].layer",
        ),
        "plan_file_name": (base, evil_file, evil_file, None),
    }


VECTORS = ["class_name", "param_key", "model_own_param", "hook_layer", "plan_file_name"]


@pytest.mark.parametrize("vector", VECTORS)
def test_load_plan_refuses_a_name_outside_the_grammar(vector, tmp_path):
    plan, _, name, path = vectors(tmp_path / "ran")[vector]
    if path is None:  # a file name is not plan content; the exporter must cope (next test)
        return
    with pytest.raises(PlanError) as refused:
        load_plan(dump_plan(plan))
    assert str(refused.value).startswith(f"plan: invalid plan: {path}"), str(refused.value)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("vector", VECTORS)
def test_exported_module_holds_names_as_literals_and_runs_no_plan_text(vector, tmp_path):
    marker = tmp_path / "ran"
    plan, source, name, _ = vectors(marker)[vector]
    exported = tmp_path / "config.py"
    exported.write_text(export_parallelize(plan, source))
    namespace = import_file(exported)
    assert not marker.exists(), f"importing the exported module ran code from the plan's {vector}"
    # the name arrived whole, as data
    texts = {"class_name": namespace["MODEL_CLASS"], "plan_file_name": namespace["PLAN_FILE"]}
    if vector in texts:
        assert texts[vector] == name
    elif vector == "model_own_param":
        assert name in namespace["MODEL_PARAMETERS"]
    else:
        layer = name.rpartition(".")[0] if vector == "param_key" else name
        attrs = {"weight"} if vector == "param_key" else set()
        keys = namespace["CONFIG"]["mp_config"]["parallelize_plan"]
        assert [k for k in keys if paddle_key_matches(k, layer, attrs)], keys


def test_a_dot_in_a_key_is_a_dot_not_any_character():
    """``h.0.fc`` read as a regular expression also names ``h_0.fc``: Paddle would shard both."""
    plan = layered_plan(layers=1, dp=1, mp=2)
    sharded = ParamPlan(shape=[8, 8], dtype="float32", placements=["S(1)"], style="ColWiseParallel")
    plain = ParamPlan(shape=[8, 8], dtype="float32", placements=["R"])
    plan = msgspec.structs.replace(plan, params={**plan.params, "h.0.fc.weight": sharded, "h_0.fc.weight": plain})
    keys = import_keys(export_parallelize(plan))
    assert [k for k in keys if paddle_key_matches(k, "h.0.fc", {"weight"})]
    assert not [k for k in keys if paddle_key_matches(k, "h_0.fc", {"weight"})], keys


@pytest.mark.parametrize("name", ["layers.0.mlp(", "layers.[0].mlp", "layers.0.m*lp", "a\\.b", "x{1-2}"])
def test_regex_syntax_in_a_name_does_not_crash_export(name):
    """Outside the grammar (a Plan built in Python): a literal key naming exactly the layer, or
    an ExportError, never re.error."""
    plan = layered_plan(layers=1, dp=1, mp=2)
    sharded = ParamPlan(shape=[8, 8], dtype="float32", placements=["S(1)"], style="ColWiseParallel")
    plan = msgspec.structs.replace(plan, params={**plan.params, f"{name}.weight": sharded})
    try:
        keys = import_keys(export_parallelize(plan))
    except ExportError as err:
        assert name in str(err)
        return
    assert [k for k in keys if paddle_key_matches(k, name, {"weight"})], keys
    for key in keys:
        re.compile(key)


def import_keys(source: str) -> dict:
    namespace: dict = {}
    exec(compile(source, "exported", "exec"), namespace)
    return namespace["CONFIG"]["mp_config"]["parallelize_plan"]


# -- terminal control: plan text is escaped in every human output -------------------------------------

#: Clear the screen, set the window title, a forged line, right-to-left override, line separator.
HOSTILE = "x\x1b[2J\x1b]0;owned\x07\nplacements  R R  forged\u202e\u2028y"


def hostile_plan():
    """A plan whose free-text and name fields hold terminal control (built directly, as a Python
    caller could; load_plan refuses most of it, see below)."""
    plan = layered_plan(layers=2, dp=1, mp=2)
    q = "llama.layers.0.self_attn.q_proj.weight"
    plan = with_param(plan, q, f"llama.layers.0.{HOSTILE}.weight")
    return msgspec.structs.replace(
        plan,
        model=msgspec.structs.replace(plan.model, class_name=HOSTILE, traced_layer=HOSTILE),
        cluster=msgspec.structs.replace(
            plan.cluster, device=msgspec.structs.replace(plan.cluster.device, name=HOSTILE)
        ),
        hooks=[Reshard(layer=HOSTILE, when="post", placements=["R"], reason=HOSTILE)],
        notes=[HOSTILE],
    )


def assert_no_control(text: str) -> None:
    bad = sorted({c for c in text if not c.isprintable() and c != "\n"})
    assert not bad, f"unescaped characters {bad!r} in:\n{text}"
    assert "forged" not in "".join(line for line in text.splitlines() if line.startswith("placements"))


def test_show_escapes_plan_text():
    from autodist.planner.review.show import show_text

    text = show_text(hostile_plan())
    assert_no_control(text)
    assert "\\x1b[2J" in text and "\\u202e" in text  # visible, not hidden


def test_diff_escapes_plan_text():
    from autodist.planner.review.diff import diff_plans

    lines = diff_plans(layered_plan(layers=2, dp=1, mp=2), hostile_plan())
    assert lines
    for line in lines:
        assert_no_control(line)
        assert "\n" not in line


def test_render_is_well_formed_xml_whatever_the_plan_says():
    import xml.etree.ElementTree as ET

    from autodist.planner.review.render import render_svg

    svg = render_svg(hostile_plan())
    root = ET.fromstring(svg)  # a control character makes the document ill-formed
    title = next(e for e in root.iter() if e.get("class") == "title")
    assert "\\x1b[2J" in title.text


def test_plan_errors_escape_plan_text(tmp_path):
    from click.testing import CliRunner

    from autodist.planner.cli.review import show

    data = json.loads(dump_plan(layered_plan(layers=2, dp=1, mp=2)))
    data["notes"] = [HOSTILE]  # control characters: refused, and the message says where
    path = tmp_path / f"plan{HOSTILE[:12]}.json"
    path.write_text(json.dumps(data))
    with pytest.raises(PlanError) as refused:
        load_plan(path)
    assert_no_control(str(refused.value))
    assert "$.notes[0]" in str(refused.value)
    result = CliRunner().invoke(show, [str(path)])
    assert result.exit_code == 2
    assert result.output.startswith("error: ") and result.output.count("\n") == 1
    assert_no_control(result.output)


def test_show_escapes_what_the_grammar_lets_through(tmp_path):
    """Free text may hold printable-looking format characters (right-to-left override, line
    separator): load_plan accepts them, show prints them escaped."""
    from click.testing import CliRunner

    from autodist.planner.cli.review import show

    plan = msgspec.structs.replace(layered_plan(layers=2, dp=1, mp=2), notes=["abc\u202edef\u2028ghi"])
    path = tmp_path / "plan.json"
    path.write_bytes(dump_plan(plan))
    result = CliRunner().invoke(show, [str(path)])
    assert result.exit_code == 0, result.output
    assert_no_control(result.output)
    assert "abc\\u202edef\\u2028ghi" in result.output


def test_show_bounds_the_name_column(tmp_path):
    """One very long name must not pad every row to its length (a 738 KB plan printed 1 GB)."""
    from click.testing import CliRunner

    from autodist.planner.cli.review import show
    from autodist.planner.review.format import MAX_NAME_WIDTH

    long_name = "llama." + "very_long_layer_name." * 2000 + "weight"
    plan = layered_plan(layers=4, dp=1, mp=2)
    params = {**plan.params, long_name: plan.params["llama.embed_tokens.weight"]}
    path = tmp_path / "plan.json"
    path.write_bytes(dump_plan(msgspec.structs.replace(plan, params=params)))
    result = CliRunner().invoke(show, [str(path)])
    assert result.exit_code == 0, result.output
    assert max(map(len, result.output.splitlines())) < MAX_NAME_WIDTH + 60
    assert "…" in result.output
    result = CliRunner().invoke(show, [str(path), "--json"])
    assert long_name in {row["pattern"] for row in json.loads(result.output)["placements"]}


def test_duplicate_keys_are_refused_with_their_path():
    text = dump_plan(layered_plan(layers=2, dp=1, mp=2)).decode()
    q = '"llama.layers.0.self_attn.q_proj.weight": {'
    twice = text.replace(q, q + '\n      "stage": 0,', 1)
    with pytest.raises(
        PlanError,
        match=r'\$\.params\["llama\.layers\.0\.self_attn\.q_proj\.weight"\]: the key "stage" appears more than once',
    ):
        load_plan(twice.encode())
    top = text.rstrip().removesuffix("}") + ', "notes": ["a"]}'
    with pytest.raises(PlanError, match=r'^plan: invalid plan: \$: the key "notes" appears more than once'):
        load_plan(top.encode())


def test_two_plans_that_differ_do_not_diff_as_the_same(tmp_path):
    """The reason duplicate keys matter: with the last key winning, both read as one plan."""
    from click.testing import CliRunner

    from autodist.planner.cli.review import diff

    text = dump_plan(layered_plan(layers=2, dp=1, mp=2)).decode()
    (tmp_path / "a.json").write_text(text)
    (tmp_path / "b.json").write_text(text.replace('"notes": []', '"notes": ["x"], "notes": []'))
    result = CliRunner().invoke(diff, [str(tmp_path / "a.json"), str(tmp_path / "b.json")])
    assert result.exit_code == 2 and "appears more than once" in result.output


def test_a_trailing_newline_does_not_pass_a_pattern():
    """Python's ``$`` matches before a final newline: ``"R\\n"`` passed as a placement."""
    data = json.loads(dump_plan(layered_plan(layers=2, dp=1, mp=2)))
    data["params"]["llama.layers.0.self_attn.q_proj.weight"]["placements"] = ["S(1)\n"]
    with pytest.raises(PlanError, match=r"placements\[0\]: Expected `str` \(a placement"):
        load_plan(json.dumps(data).encode())


@pytest.mark.parametrize(
    "name", ["layers.0.q²", "layers.0.q proj", "layers..0", ".layers", "layers.0.", "layers.0\x00"]
)
def test_names_outside_the_grammar_are_refused(name):
    data = json.loads(dump_plan(layered_plan(layers=2, dp=1, mp=2)))
    data["params"][name] = data["params"].pop("llama.layers.0.self_attn.q_proj.weight")
    with pytest.raises(PlanError, match=r"the key is not a name"):
        load_plan(json.dumps(data).encode())


def test_review_formatting_takes_only_ascii_digits_for_indices():
    """``"²".isdigit()`` is true but ``int("²")`` raises: show, diff and export crashed on it."""
    from autodist.planner.review.diff import diff_plans
    from autodist.planner.review.show import show_text

    plan = layered_plan(layers=2, dp=1, mp=2)
    odd = with_param(plan, "llama.layers.0.self_attn.q_proj.weight", "llama.layers.².self_attn.q_proj.weight")
    assert "llama.layers.².self_attn.q_proj.weight" in show_text(odd)
    assert diff_plans(plan, odd)
    export_parallelize(odd)


@pytest.mark.parametrize("field", ["num_parameters", "input_specs"])
def test_an_absurd_integer_is_refused_at_load_and_by_every_review_command(field, tmp_path):
    """A 401-digit integer: before, show, diff and render crashed with a traceback."""
    from click.testing import CliRunner

    from autodist.planner.cli.review import diff, render, show

    data = json.loads(dump_plan(layered_plan(layers=2, dp=1, mp=2)))
    if field == "num_parameters":
        data["model"]["num_parameters"] = int("9" * 401)
    else:
        data["model"]["input_specs"] = [{"name": "input_ids", "dtype": "int64", "shape": [4, int("9" * 401)]}]
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    with pytest.raises(
        PlanError, match=r"\$\.model\.(num_parameters|input_specs\[0\]\.shape\[1\]).*<= 9007199254740992"
    ):
        load_plan(path)
    for command, args in ((show, [path]), (diff, [path, path]), (render, [path, "-o", tmp_path / "p.svg"])):
        result = CliRunner().invoke(command, [str(a) for a in args])
        assert result.exit_code == 2 and result.output.startswith("error: ") and result.output.count("\n") == 1, (
            result.output
        )
