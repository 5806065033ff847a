"""The commands the README and the docs show exist as written, and the cheap ones run.

Every ``autodist-plan ...`` line of a code block in README.md, docs/*.md and plans/*/README.md
(``$ `` prompts, ``\\`` continuations, ``# comments``, ``$(which autodist-plan)`` and pre-commit's
``entry:`` included) is checked against the command line itself: its subcommand exists, every
option is one of that subcommand's, every choice is allowed, and it has the arguments the
subcommand takes. ``examples/train.py`` flags and ``make`` targets are checked the same way.
Then the commands that are quick on a tiny model run, in the order the page gives them, in a
temporary folder holding what they name (``model.py``: the docstring Llama at a tiny size;
``cluster.toml``: docs/cluster.md's example; ``pkg/module.py``), as a user following the page
would run them: each must exit 0 (``diff`` and ``check`` may say 1: "different", "stale").
"""

from __future__ import annotations

import re
import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from autodist.planner.cli import cli

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "plans").glob("*/README.md"))]
TINY = dict(VOCAB_SIZE=64, HIDDEN_SIZE=32, INTERMEDIATE_SIZE=64, NUM_HEADS=4, NUM_LAYERS=2, SEQ_LENGTH=16)

#: Documented commands not run here, and why (each is still checked against the command line).
NOT_RUN = {
    "calibrate": "needs a launched multi-process job (tests/test_calibrate.py runs it)",
    "ckpt": "needs a saved checkpoint (tests/test_checkpoint_info.py runs it)",
    "plans/": "re-makes a checked-in plan at full size (tests/test_plans_fresh.py re-makes them all)",
}


@dataclass(frozen=True)
class Documented:
    page: str
    line: str
    program: str  # "autodist-plan", "train.py" or "make"
    args: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.page}: {self.line}"


def documented_commands() -> list[Documented]:
    found = []
    for page in PAGES:
        name = str(page.relative_to(ROOT))
        for block in re.findall(r"^```[a-z]*\n(.*?)^```", page.read_text(), flags=re.S | re.M):
            for line in re.sub(r"\\\n\s*", " ", block).splitlines():
                line = re.sub(r"^\s*(\$ |- |entry: )?", "", line).strip()
                try:
                    tokens = shlex.split(line.replace("$(which autodist-plan)", "autodist-plan"), comments=True)
                except ValueError:  # not shell (a diagram, Python)
                    continue
                if not tokens:
                    continue
                launched = tokens[0].startswith("python")  # python -m paddle.distributed.launch ... PROGRAM
                for program, marker in (
                    ("autodist-plan", "autodist-plan"),
                    ("train.py", "examples/train.py"),
                    ("make", "make"),
                ):
                    if tokens[0] == marker or (launched and marker in tokens[1:] and program != "make"):
                        args = tuple(tokens[tokens.index(marker) + 1 :])
                        found.append(Documented(name, line, program, args))
                        break
    return found


COMMANDS = documented_commands()
PLAN_COMMANDS = [c for c in COMMANDS if c.program == "autodist-plan"]


def test_the_docs_show_the_commands_we_expect_to_check():
    # a change in how pages write commands must not silently leave them unchecked
    subcommands = {resolve(c.args)[0].name for c in PLAN_COMMANDS}
    assert {"plan", "show", "diff", "check", "render", "export", "graph", "schema", "calibrate", "info"} <= subcommands
    assert any(c.program == "train.py" for c in COMMANDS) and any(c.program == "make" for c in COMMANDS)


def resolve(args: tuple[str, ...]) -> tuple[click.Command, list[str]]:
    """The subcommand ``autodist-plan ARGS`` runs, and the arguments it gets."""
    command: click.Command = cli
    rest = list(args)
    if not rest or rest[0] not in cli.commands:  # the default command
        rest.insert(0, "plan")
    while isinstance(command, click.Group):
        assert rest and rest[0] in command.commands, f"no subcommand {rest[:1]} in {command.name}"
        command, rest = command.commands[rest[0]], rest[1:]
    return command, rest


@pytest.mark.parametrize("documented", PLAN_COMMANDS, ids=str)
def test_every_documented_autodist_plan_command_exists_as_written(documented):
    command, rest = resolve(documented.args)
    options = {opt: p for p in command.params if isinstance(p, click.Option) for opt in p.opts + p.secondary_opts}
    positional = []
    while rest:
        token = rest.pop(0)
        if not token.startswith("-") or token == "-":
            positional.append(token)
            continue
        name, _, value = token.partition("=")
        assert name in options or name in ("-h", "--help"), f"{documented}: {name} is no option of {command.name}"
        option = options.get(name)
        if option is None or option.is_flag or option.count:
            continue
        value = value or rest.pop(0)
        if isinstance(option.type, click.Choice):
            assert value in option.type.choices, f"{documented}: {value!r} is not a choice of {name}"
    arguments = [p for p in command.params if isinstance(p, click.Argument)]
    assert len(positional) == len(arguments), f"{documented}: {command.name} takes {[a.name for a in arguments]}"


@pytest.mark.parametrize("documented", [c for c in COMMANDS if c.program != "autodist-plan"], ids=str)
def test_every_documented_train_flag_and_make_target_exists(documented):
    if documented.program == "make":
        targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), flags=re.M))
        assert set(documented.args) <= targets, f"{documented}: no such make target"
        return
    flags = set(re.findall(r'add_argument\(\s*"(--[\w-]+)"', (ROOT / "examples" / "train.py").read_text()))
    used = {token.partition("=")[0] for token in documented.args if token.startswith("--")}
    assert used <= flags, f"{documented}: examples/train.py has no {sorted(used - flags)}"


@pytest.fixture
def workspace(tmp_path, monkeypatch):
    """A folder with what the documented commands name, as a user's project would have it."""
    for field, value in TINY.items():
        monkeypatch.setenv(f"LLAMA_DOCSTRING_{field}", str(value))
    model = (ROOT / "plans" / "llama_docstring" / "model.py").read_text()
    (tmp_path / "model.py").write_text(model + "\n\nmake_model = build_model\n")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "module.py").write_text(model + "\n\nfactory = build_model\n")
    cluster_doc = (ROOT / "docs" / "cluster.md").read_text()
    (tmp_path / "cluster.toml").write_text(re.search(r"```toml\n(.*?)```", cluster_doc, flags=re.S).group(1))
    (tmp_path / "plans").mkdir()
    for plan in ROOT.glob("plans/gpt/plan_*.json"):  # docs/workflow.md diffs two checked-in plans
        (tmp_path / "plans" / "gpt").mkdir(exist_ok=True)
        shutil.copy(plan, tmp_path / "plans" / "gpt" / plan.name)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def runnable(page: str) -> list[Documented]:
    return [c for c in PLAN_COMMANDS if c.page == page and not skipped(c)]


def skipped(documented: Documented) -> str:
    """Why a documented command is not run here ('' when it is)."""
    command, _ = resolve(documented.args)
    for key in (command.name, "ckpt" if command.name == "info" else None):
        if key in NOT_RUN:
            return NOT_RUN[key]
    if any(arg.startswith("plans/") and "model.py" in arg for arg in documented.args):
        return NOT_RUN["plans/"]
    return ""


@pytest.mark.parametrize("page", sorted({c.page for c in PLAN_COMMANDS if not skipped(c)}))
def test_the_documented_commands_run(page, workspace):
    prepared = False
    for documented in runnable(page):
        args = [str(workspace / Path(a).name) if a.startswith("/tmp/") else a for a in documented.args]
        if not prepared and any(Path(a).suffix == ".json" and not Path(a).exists() for a in args[1:]):
            # a page that reviews plan.json / old.json / new.json it did not make: make them
            for name in ("plan.json", "old.json", "new.json"):
                devices = "2" if name == "old.json" else "4"
                made = CliRunner().invoke(
                    cli, ["model.py", "--devices", devices, "--device", "h100-sxm", "-q", "-o", name]
                )
                assert made.exit_code == 0, made.output
            prepared = True
        result = CliRunner().invoke(cli, args, prog_name="autodist-plan")
        allowed = {0, 1} if resolve(documented.args)[0].name in ("diff", "check") else {0}
        assert result.exit_code in allowed, f"{documented}\n{result.output}"


def test_the_documented_diff_output_is_what_diff_prints(workspace):
    """docs/workflow.md shows the diff of two checked-in plans (abridged with '...'): every line
    it shows, but the estimates (which move with the cost model), is in what diff prints."""
    text = (ROOT / "docs" / "workflow.md").read_text()
    shown = re.search(r"```\n\$ autodist-plan diff (\S+) (\S+)\n(.*?)```", text, flags=re.S)
    result = CliRunner().invoke(cli, ["diff", shown.group(1), shown.group(2)])
    assert result.exit_code == 1, result.output
    printed = result.output.splitlines()
    for line in shown.group(3).splitlines():
        if line.strip() != "..." and not line.startswith("estimate:"):
            assert line in printed, f"docs/workflow.md shows {line!r}; diff prints:\n{result.output}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_code_fence_is_closed(page):
    """A fence left open (plans/llama_docstring/README.md had one) turns the rest of the page
    into code, and hides its commands from the tests above."""
    fences = [line for line in page.read_text().splitlines() if line.lstrip().startswith("```")]
    assert len(fences) % 2 == 0, f"{page.name}: {len(fences)} fence lines, one is not closed"
    assert all(fence.strip() == "```" for fence in fences[1::2]), f"{page.name}: a closing fence has a language"
