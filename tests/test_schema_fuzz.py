"""Random and mutated plan documents: load_plan returns a Plan or raises PlanError, nothing else."""

from __future__ import annotations

import json
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autodist.schemas import Plan, PlanError, dump_plan, load_plan

EXAMPLE = json.loads((Path(__file__).parent / "data" / "example_plan.json").read_text())

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


def paths(node, prefix=()):
    """Every path into a JSON document, so a mutation can land anywhere in it."""
    yield prefix
    if isinstance(node, dict):
        for key, value in node.items():
            yield from paths(value, prefix + (key,))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from paths(value, prefix + (i,))


ALL_PATHS = [p for p in paths(EXAMPLE) if p]


def mutate(doc, path, action, value):
    doc = json.loads(json.dumps(doc))
    *parents, last = path
    node = doc
    for key in parents:
        node = node[key]
    if action == "delete":
        del node[last]
    elif action == "replace":
        node[last] = value
    elif isinstance(node, dict):
        node[f"{last}_extra"] = value
    else:
        node.append(value)
    return doc


def loads_or_plan_error(data: bytes) -> None:
    try:
        plan = load_plan(data)
    except PlanError as err:
        assert err.problems and all(isinstance(p, str) and p for p in err.problems)
        return
    assert isinstance(plan, Plan)
    assert dump_plan(load_plan(dump_plan(plan))) == dump_plan(plan)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(path=st.sampled_from(ALL_PATHS), action=st.sampled_from(["delete", "replace", "add"]), value=json_values)
def test_mutated_plans_give_a_plan_or_a_plan_error(path, action, value):
    loads_or_plan_error(json.dumps(mutate(EXAMPLE, path, action, value)).encode())


@settings(max_examples=200, deadline=None)
@given(doc=json_values)
def test_random_json_gives_a_plan_error(doc):
    loads_or_plan_error(json.dumps(doc).encode())


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=64))
def test_random_bytes_give_a_plan_error(data):
    loads_or_plan_error(data)
