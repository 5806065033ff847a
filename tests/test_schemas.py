"""The plan format: strict decode, exact error paths, canonical encode, atomic save."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from autodist.schemas import VERSION, Plan, PlanError, dump_plan, load_plan, parameter_fingerprint, save_plan

EXAMPLE = Path(__file__).parent / "data" / "example_plan.json"
#: plans/paddleformers_llama/plan_4x8dev_mp8_pp2.json as the version 1 planner wrote it.
V1_PLAN = Path(__file__).parent / "data" / "plan_v1_pp2_mp8.json"


@pytest.fixture
def doc() -> dict:
    """The hand-written example plan as plain JSON data, ready to be broken."""
    return json.loads(EXAMPLE.read_text())


def load_doc(doc: dict) -> Plan:
    return load_plan(json.dumps(doc).encode())


def problems_of(doc: dict) -> list[str]:
    with pytest.raises(PlanError) as info:
        load_doc(doc)
    return info.value.problems


# -- round trip and determinism ---------------------------------------------------------------------


def test_example_plan_loads_with_its_values():
    plan = load_plan(EXAMPLE)
    assert plan.mesh.shape == [2, 2]
    assert plan.params["layers.0.mlp.fc_in.weight"].placements == ["R", "S(1)"]
    assert plan.params["layers.0.mlp.fc_out.weight"].style == "RowWiseParallel"
    assert plan.hooks[0].when == "post"


def test_dump_is_canonical_and_round_trips():
    plan = load_plan(EXAMPLE)
    data = dump_plan(plan)
    assert dump_plan(load_plan(data)) == data
    assert data.endswith(b"}\n")
    # Two-space indent; the fields in the order a reader wants them, maps sorted by key.
    assert data.startswith(b'{\n  "format": "autodist.plan",\n  "version": 2,\n  "model": {')
    parsed = json.loads(data)
    assert list(parsed)[:7] == ["format", "version", "model", "cluster", "mesh", "strategy", "estimate"]
    assert list(parsed)[-1] == "alternatives"
    assert list(parsed["strategy"])[:3] == ["dp", "mp", "pp"]
    assert list(parsed["params"]) == sorted(parsed["params"])


def test_a_plan_written_with_sorted_keys_reads_the_same():
    """Plans written before the reader's order (every key sorted) still load, to the same plan."""
    plan = load_plan(EXAMPLE)
    sorted_keys = msgspec.json.format(msgspec.json.Encoder(order="sorted").encode(plan), indent=2)
    assert sorted_keys.startswith(b'{\n  "alternatives"')
    assert load_plan(sorted_keys) == plan
    assert dump_plan(load_plan(sorted_keys)) == dump_plan(plan)


def test_dump_does_not_depend_on_construction_order(doc):
    reordered = dict(reversed(list(doc.items())))
    reordered["params"] = dict(reversed(list(doc["params"].items())))
    assert dump_plan(load_doc(reordered)) == dump_plan(load_doc(doc))


def test_floats_are_stable_through_round_trips(doc):
    doc["estimate"]["step_time_s"] = 0.1 + 0.2  # 0.30000000000000004: shortest repr must survive
    data = dump_plan(load_doc(doc))
    assert b"0.30000000000000004" in data
    assert dump_plan(load_plan(data)) == data


# -- strict decode with exact paths ------------------------------------------------------------------------


def test_unknown_field_is_named_with_its_path(doc):
    doc["params"]["layers.0.norm.weight"]["placement"] = ["R", "R"]
    (problem,) = problems_of(doc)
    assert problem.startswith('$.params["layers.0.norm.weight"]')
    assert "unknown field `placement`" in problem


def test_bad_placement_names_the_parameter_and_index(doc):
    doc["params"]["layers.0.mlp.fc_in.weight"]["placements"][1] = "S(x)"
    (problem,) = problems_of(doc)
    assert problem.startswith('$.params["layers.0.mlp.fc_in.weight"].placements[1]:')


def test_wrong_type_is_named(doc):
    doc["strategy"]["mp"] = "two"
    (problem,) = problems_of(doc)
    assert problem.startswith("$.strategy.mp:") and "Expected `int`" in problem


def test_missing_field_is_named(doc):
    del doc["mesh"]["process_ids"]
    (problem,) = problems_of(doc)
    assert problem.startswith("$.mesh:") and "process_ids" in problem


def test_newer_version_asks_to_upgrade(doc):
    doc["version"] = VERSION + 1
    doc["a_field_from_the_future"] = True  # a newer plan may carry fields we do not know
    (problem,) = problems_of(doc)
    assert f"format version {VERSION + 1}" in problem and "upgrade autodist" in problem


def assert_contains(new, old, path):
    """``new`` holds every value of ``old`` (objects may have more keys)."""
    if isinstance(old, dict):
        assert isinstance(new, dict), path
        for key, value in old.items():
            assert key in new, f"{path}.{key} lost"
            assert_contains(new[key], value, f"{path}.{key}")
    elif isinstance(old, list):
        assert isinstance(new, list) and len(new) == len(old), path
        for i, (a, b) in enumerate(zip(new, old)):
            assert_contains(a, b, f"{path}[{i}]")
    else:
        assert new == old, path


def test_a_version_1_plan_still_loads():
    """A plan written by the version 1 planner (every hook carried both ``placements`` and
    ``to_stage``; mesh axes were ``mesh.dim_names`` and ``data.shard_dims``) loads as version 2:
    each hook keeps only the field of its kind, the two keys are renamed in place, all else is
    unchanged."""
    raw = json.loads(V1_PLAN.read_text())
    assert raw["version"] == 1
    plan = load_plan(V1_PLAN)
    again = json.loads(dump_plan(plan))
    assert again["version"] == VERSION == 2
    assert "dim_names" not in again["mesh"] and "shard_dims" not in again["data"]
    assert plan.mesh.axes == raw["mesh"]["dim_names"] == ["pp", "dp", "mp"]
    assert plan.data.shard_axes == raw["data"]["shard_dims"] == ["dp"]
    raw["mesh"]["axes"] = raw["mesh"].pop("dim_names")
    raw["data"]["shard_axes"] = raw["data"].pop("shard_dims")
    # Every other value as written (fields added since with a default, e.g. the device profile's
    # dispatch_overhead_s, are read as their default).
    for key in raw.keys() - {"version", "hooks"}:
        assert_contains(again[key], raw[key], f"$.{key}")
    kinds = {h["action"] for h in raw["hooks"]}
    assert kinds == {"reshard", "stage_handoff", "sequence_parallel_begin", "sequence_parallel_end"}
    for old, new in zip(raw["hooks"], again["hooks"], strict=True):
        common = {"action", "layer", "when", "reason"}
        assert {k: old[k] for k in common} == {k: new[k] for k in common}
        assert ("placements" in new) == (old["action"] == "reshard")
        assert ("to_stage" in new) == (old["action"] == "stage_handoff")
        assert all(new[k] == old[k] for k in ("placements", "to_stage") if k in new)


@pytest.mark.parametrize("where, old", [("mesh", "dim_names"), ("data", "shard_dims")])
def test_a_version_2_plan_with_version_1_key_names_is_refused(doc, where, old):
    """Only version 1 files are upgraded: version 2 spells mesh axes ``axes``, and the old name
    is an unknown field, named by its JSON path."""
    new = {"dim_names": "axes", "shard_dims": "shard_axes"}[old]
    doc[where][old] = doc[where].pop(new)
    with pytest.raises(PlanError, match=rf"\$\.{where}: Object contains unknown field `{old}`"):
        load_plan(json.dumps(doc).encode())


@pytest.mark.parametrize(
    "action, field, value",
    [
        ("stage_handoff", "placements", ["R", "R"]),
        ("reshard", "to_stage", 1),
        ("sequence_parallel_begin", "placements", []),
    ],
)
def test_a_hook_has_only_the_fields_of_its_kind(doc, action, field, value):
    """Hooks are a tagged union: a field of another kind of hook is refused, by its JSON path."""
    doc["hooks"][0]["action"] = action
    doc["hooks"][0][field] = value
    doc["hooks"][0].pop("placements", None) if field != "placements" and action != "reshard" else None
    assert any(p.startswith("$.hooks[0]") and repr(field) in p or f"`{field}`" in p for p in problems_of(doc))


def test_a_hook_of_unknown_kind_is_refused(doc):
    doc["hooks"][0]["action"] = "teleport"
    (problem,) = problems_of(doc)
    assert problem.startswith("$.hooks[0].action") and "teleport" in problem


def test_not_a_plan_and_not_json_are_refused():
    with pytest.raises(PlanError, match="not an autodist plan"):
        load_plan(b'{"format": "something.else"}')
    with pytest.raises(PlanError, match="not valid JSON"):
        load_plan(b'{"format": "autodist.plan", ')
    with pytest.raises(PlanError, match="cannot read the plan file"):
        load_plan("/nonexistent/plan.json")


# -- cross-field checks -------------------------------------------------------------------------------------


def test_mesh_size_must_match_process_ids_and_cluster(doc):
    doc["mesh"]["process_ids"] = [0, 1, 2]
    problems = problems_of(doc)
    assert any(p.startswith("$.mesh.shape: 2 x 2 = 4 ranks but 3 process ids") for p in problems)


def test_a_mesh_with_fewer_sizes_than_names_is_reported_not_crashed(doc):
    # Found by the fuzz test: the parameter checks used to look up the missing dim's size.
    del doc["mesh"]["shape"][0]
    problems = problems_of(doc)
    assert "$.mesh: 2 axes for 1 sizes in shape" in problems


def test_placements_must_cover_every_mesh_axis(doc):
    doc["params"]["layers.0.norm.weight"]["placements"] = ["R"]
    (problem,) = problems_of(doc)
    assert problem == "$.params[\"layers.0.norm.weight\"].placements: 1 placements for a mesh of 2 axes ['dp', 'mp']"


def test_stage_must_be_below_pp(doc):
    doc["params"]["layers.0.norm.weight"]["stage"] = 1
    problem, disagreement = problems_of(doc)
    assert problem == '$.params["layers.0.norm.weight"].stage: 1 but pp is 1'
    assert disagreement == '$.params["layers.0.norm.weight"].stage: 1 but its block layers.0 is on stage 0'


def test_blocks_params_and_handoffs_agree_on_stages():
    """A pp2 plan: moving a block's parameter, dropping a hand-off or sending it elsewhere are
    each named (before, such a plan loaded and the applier put the parameter on the wrong mesh)."""
    doc = json.loads(
        (Path(__file__).parents[1] / "plans" / "paddleformers_llama" / "plan_4x8dev_mp8_pp2.json").read_text()
    )
    assert load_doc(doc)
    block = doc["blocks"][0]
    fqn = next(name for name in doc["params"] if name.startswith(block["layer"] + "."))
    moved = copy.deepcopy(doc)
    moved["params"][fqn]["stage"] = 1 - block["stage"]
    assert problems_of(moved) == [
        f'$.params["{fqn}"].stage: {1 - block["stage"]} but its block {block["layer"]} is on stage {block["stage"]}'
    ]
    ((i, handoff),) = [(i, h) for i, h in enumerate(doc["hooks"]) if h["action"] == "stage_handoff"][:1]
    dropped = copy.deepcopy(doc)
    del dropped["hooks"][i]
    assert load_doc(dropped)  # VPP moves activations itself; the sequential schedule needs the hook
    dropped["strategy"].update(schedule="sequential", virtual_stages=1, micro_batches=1)
    assert problems_of(dropped) == [
        f"$.hooks: no stage_handoff after {handoff['layer']}, whose next block runs on stage {handoff['to_stage']}"
    ]
    elsewhere = copy.deepcopy(doc)
    elsewhere["hooks"][i]["layer"] = doc["blocks"][-1]["layer"]
    assert problems_of(elsewhere) == [
        f"$.hooks[{i}]: a stage_handoff after {doc['blocks'][-1]['layer']} to stage "
        f"{handoff['to_stage']}, but the blocks do not change stage there"
    ]


def test_strategy_must_agree_with_the_mesh(doc):
    doc["strategy"]["mp"] = 4
    problems = problems_of(doc)
    assert "$.strategy.mp: 4 but the mesh's mp axis has size 2" in problems


def test_shard_must_divide_and_fit_the_parameter(doc):
    doc["params"]["layers.0.norm.weight"]["placements"] = ["R", "S(1)"]
    doc["params"]["layers.0.mlp.fc_in.weight"]["shape"] = [16, 63]
    problems = problems_of(doc)
    assert '$.params["layers.0.norm.weight"].placements[1]: S(1) but the parameter has 1 dims' in problems
    assert any(
        p.startswith('$.params["layers.0.mlp.fc_in.weight"].placements[1]: S(1) splits size 63') for p in problems
    )


def test_all_problems_are_reported_at_once(doc):
    doc["params"]["layers.0.norm.weight"]["stage"] = 3
    doc["hooks"][0]["placements"] = ["R"]
    doc["data"]["shard_axes"] = ["pp"]
    err_problems = problems_of(doc)
    assert len(err_problems) == 4  # the stage is also not its block's
    with pytest.raises(PlanError, match="4 problems"):
        load_doc(doc)


# -- saving --------------------------------------------------------------------------------------------------


def test_save_plan_writes_canonical_bytes_and_leaves_no_temp_file(tmp_path):
    plan = load_plan(EXAMPLE)
    target = tmp_path / "plan.json"
    save_plan(plan, target)
    assert target.read_bytes() == dump_plan(plan)
    assert os.listdir(tmp_path) == ["plan.json"]


def test_saved_plan_gets_ordinary_file_permissions(tmp_path):
    umask = os.umask(0o022)
    try:
        save_plan(load_plan(EXAMPLE), tmp_path / "plan.json")
    finally:
        os.umask(umask)
    assert (tmp_path / "plan.json").stat().st_mode & 0o777 == 0o644


def test_interrupted_save_keeps_the_old_plan(tmp_path, monkeypatch):
    plan = load_plan(EXAMPLE)
    target = tmp_path / "plan.json"
    target.write_bytes(b"old contents\n")

    def fail_fsync(fd):
        raise KeyboardInterrupt  # the user pressed Ctrl-C half-way through the write

    monkeypatch.setattr(os, "fsync", fail_fsync)
    with pytest.raises(KeyboardInterrupt):
        save_plan(plan, target)
    assert target.read_bytes() == b"old contents\n"
    assert os.listdir(tmp_path) == ["plan.json"]


# -- fingerprint ----------------------------------------------------------------------------------------------


def test_parameter_fingerprint_sees_renames_and_resizes_but_not_order():
    table = {"a.weight": ([4, 8], "float32"), "b.bias": ([8], "float32")}
    base = parameter_fingerprint(table)
    assert parameter_fingerprint(dict(reversed(list(table.items())))) == base
    assert parameter_fingerprint({"a.w": ([4, 8], "float32"), "b.bias": ([8], "float32")}) != base
    assert parameter_fingerprint({"a.weight": ([4, 9], "float32"), "b.bias": ([8], "float32")}) != base
    assert parameter_fingerprint({"a.weight": ([4, 8], "float16"), "b.bias": ([8], "float32")}) != base
    assert parameter_fingerprint({"a.weight": ([4, 8], "float32")}) != base


# -- lightness -------------------------------------------------------------------------------------------------


def test_import_autodist_and_schemas_is_light():
    code = (
        "import sys, autodist, autodist.schemas\n"
        "heavy = [m for m in ('paddle', 'networkx', 'click', 'numpy', 'autodist.planner', 'autodist.applier')"
        " if m in sys.modules]\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_plan_is_plain_data_not_code():
    # msgspec never builds arbitrary objects: a pickle-ish payload is just a wrong type.
    with pytest.raises(PlanError):
        load_plan(b'{"format": "autodist.plan", "version": 1, "model": {"__reduce__": "os.system"}}')
    assert msgspec.json.decode(dump_plan(load_plan(EXAMPLE)))["format"] == "autodist.plan"


def test_example_document_is_not_mutated_by_loading(doc):
    before = copy.deepcopy(doc)
    load_doc(doc)
    assert doc == before
