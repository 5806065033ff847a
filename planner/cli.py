"""The ``autodist-plan`` command line.

``autodist-plan TARGET -o plan.json`` plans a model (the default command); subcommands work
with plans: ``schema`` prints the plan format's JSON Schema.

Example::

    autodist-plan plans/llama_docstring/model.py --dp 2 --mp 2 -o plan.json
    autodist-plan schema > plan.schema.json
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import click

from autodist.schemas import plan_json_schema

from .errors import PlannerError

#: Exit status for a problem in what the user gave us (target, specs, degrees).
USAGE_ERROR = 2


class PlannerFailure(click.ClickException):
    """A :class:`PlannerError` on its way out of the CLI: ``error: <message>``, exit status 2."""

    exit_code = USAGE_ERROR

    def __init__(self, error: PlannerError):
        super().__init__(error.message)
        self.detail = error.detail

    def show(self, file=None) -> None:
        click.echo(f"error: {self.message}", err=True)
        if self.detail:
            click.echo("\n".join("  " + line for line in self.detail.splitlines()), err=True)


def reports_planner_errors(command):
    """Turn a command's PlannerError into one ``error:`` line and exit status 2."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except PlannerError as error:
            raise PlannerFailure(error) from None

    return wrapper


input_spec_option = click.option(
    "--input-spec",
    "input_specs",
    multiple=True,
    metavar="NAME:DTYPE:BxS",
    help="A model input, e.g. input_ids:int64:4x1024 (repeatable; replaces the file's input_spec()).",
)


class DefaultCommandGroup(click.Group):
    """A group whose first argument, when it names no subcommand, goes to ``plan``:
    ``autodist-plan model.py`` means ``autodist-plan plan model.py``."""

    default_command = "plan"

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if args and args[0] not in self.commands and args[0] not in ("--help", "-h", "--version"):
            args = [self.default_command, *args]
        return super().parse_args(ctx, args)


@click.group(cls=DefaultCommandGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="paddle-autodist")
def cli() -> None:
    """Plan how a PaddlePaddle model runs on many devices; review and check plans.

    \b
    Example:
      autodist-plan model.py --devices 4 -o plan.json
      autodist-plan schema
    """


@cli.command()
def schema() -> None:
    """Print the JSON Schema of the plan format (for editors and CI).

    \b
    Example:
      autodist-plan schema > plan.schema.json
    """
    click.echo(json.dumps(plan_json_schema(), indent=2, sort_keys=True))


@cli.command()
@click.argument("target")
@input_spec_option
@click.option("--format", "fmt", type=click.Choice(["dot", "json"]), default="dot", show_default=True)
@click.option("-o", "--output", type=click.Path(dir_okay=False), help="Write here instead of stdout.")
@reports_planner_errors
def graph(target: str, input_specs: tuple[str, ...], fmt: str, output: str | None) -> None:
    """Dump the traced dataflow graph of TARGET (for debugging the matcher).

    \b
    Example:
      autodist-plan graph plans/llama_docstring/model.py --format dot -o llama.dot
    """
    from .graph import build_graph, graph_to_dot, graph_to_json
    from .load import load_target
    from .trace import trace_model

    loaded = load_target(target, list(input_specs) or None)
    dataflow = build_graph(trace_model(loaded.model, loaded.input_specs))
    if fmt == "json":
        text = json.dumps(graph_to_json(dataflow), indent=1, sort_keys=True) + "\n"
    else:
        text = graph_to_dot(dataflow)
    if output:
        Path(output).write_text(text)
    else:
        click.echo(text, nl=False)


def main() -> None:
    """Entry point of the ``autodist-plan`` console script."""
    cli(prog_name="autodist-plan")


if __name__ == "__main__":
    sys.exit(main())
