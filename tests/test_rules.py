"""``--rules``: placements by layer glob in dist.parallelize words, merged into the plan,
recorded in its provenance, and checked by the same SPMD replay as inferred ones."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from autodist.planner.cli import cli
from autodist.planner.cost.search import SearchRequest
from autodist.planner.driver import plan_target
from autodist.planner.errors import PlannerError
from autodist.planner.recognise.rules import load_rules

#: Blocks whose MLP normalises its hidden features: inference refuses to split it (a LayerNorm
#: over a split axis needs a gather), so only rules can.
MODEL = """
import paddle
import paddle.nn as nn


class Block(nn.Layer):
    def __init__(self):
        super().__init__()
        self.fc1, self.norm, self.fc2 = nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 16)
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x):
        x = x + self.fc2(self.norm(self.fc1(x)))
        return x + self.down(paddle.nn.functional.relu(self.up(x)))


class Net(nn.Layer):
    def __init__(self):
        super().__init__()
        self.blocks = nn.LayerList([Block() for _ in range(2)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def build_model():
    return Net()


def input_spec():
    return [paddle.static.InputSpec([2, 4, 16], "float32", "x")]
"""


@pytest.fixture
def target(tmp_path):
    path = tmp_path / "net.py"
    path.write_text(MODEL)
    return str(path)


def mp2(target, rules=None):
    return plan_target(
        target, None, SearchRequest(devices_per_node=2, dp=1, mp=2, pp=1), {"target": target}, rules=rules
    )


def placement(plan, fqn):
    return plan.params[fqn].placements[plan.mesh.axes.index("mp")]


def test_a_rule_merges_with_inferred_placements_and_is_recorded(target):
    inferred = mp2(target).plan
    assert placement(inferred, "blocks.0.up.weight") == "S(1)" and placement(inferred, "blocks.0.fc1.weight") == "R"
    ruled = mp2(target, {"blocks.*.up": "replicate", "blocks.*.down": "replicate"}).plan
    assert placement(ruled, "blocks.1.up.weight") == "R" and placement(ruled, "blocks.1.down.weight") == "R"
    assert ruled.provenance.arguments["rules"] == "blocks.*.down=replicate;blocks.*.up=replicate"
    # in dist.parallelize's class names too; the same as inference, so accepted by the replay
    same = mp2(target, {"blocks.0.up": "ColWiseParallel", "blocks.0.down": "RowWiseParallel"}).plan
    assert [placement(same, f"blocks.0.{n}.weight") for n in ("up", "down")] == ["S(1)", "S(0)"]


def test_a_rule_that_would_make_paddle_communicate_is_refused_with_the_reason(target):
    with pytest.raises(PlannerError) as refused:
        mp2(target, {"blocks.*.fc1": "colwise", "blocks.*.fc2": "rowwise"})
    # the rule refused alone is named (fc2 rowwise alone slices a whole input: no collective)
    assert refused.value.message == (
        'rule "blocks.*.fc1" = "colwise": with it pd_op.layer_norm in blocks.0.norm would need an all_gather of '
        "operand 0 (S(2) -> R) that Paddle adds on its own; split the projections that feed it and the one that "
        "contracts it together (in blocks.0)"
    )


def test_rules_name_unknown_words_and_unmatched_globs(target, tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('"blocks.*.fc1" = "columnwise"\n')
    with pytest.raises(PlannerError, match='line 1: "blocks.*.fc1" = "columnwise": a placement is one of'):
        mp2(target, load_rules(bad))
    with pytest.raises(PlannerError, match="matches no layer"):
        mp2(target, {"blocks.*.nothing": "colwise"})


def test_cli_rules_file(target, tmp_path):
    rules = tmp_path / "rules.toml"
    rules.write_text('"blocks.*.up" = "replicate"\n"blocks.*.down" = "replicate"\n')
    out = tmp_path / "plan.json"
    result = CliRunner().invoke(
        cli, [target, "--devices", "2", "--mp", "2", "--rules", str(rules), "-q", "-o", str(out)]
    )
    assert result.exit_code == 0, result.output
    assert '"rules": "blocks.*.down=replicate;blocks.*.up=replicate"' in out.read_text()
    broken = tmp_path / "broken.toml"
    broken.write_text("not toml ===")
    result = CliRunner().invoke(cli, [target, "--devices", "2", "--mp", "2", "--rules", str(broken), "-q"])
    assert result.exit_code == 2 and "error: --rules" in result.output


def test_cli_warns_once_per_layer_kind(target, tmp_path):
    result = CliRunner().invoke(cli, [target, "--devices", "2", "--mp", "2", "-o", str(tmp_path / "p.json")])
    assert result.exit_code == 0, result.output
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert warnings == [
        "warning: blocks.*.fc2: op layer_norm (first seen in blocks.0.norm) stops the tensor-parallel split "
        "before this projection; it and the projections feeding it stay replicated; model code: Block.forward "
        f"at {target}:12",
        "warning: layer blocks.*.fc1: no pattern matched it; its parameters stay replicated",
        "warning: layer blocks.*.fc2: no pattern matched it; its parameters stay replicated",
    ]
