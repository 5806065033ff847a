"""The ``autodist-plan`` command line.

``autodist-plan TARGET -o plan.json`` plans a model (the default command); subcommands work
with plans: ``schema`` prints the plan format's JSON Schema.

Example::

    autodist-plan plans/llama_docstring/model.py --dp 2 --mp 2 -o plan.json
    autodist-plan schema > plan.schema.json
"""

from __future__ import annotations

import json
import sys

import click

from autodist.schemas import plan_json_schema


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


def main() -> None:
    """Entry point of the ``autodist-plan`` console script."""
    cli(prog_name="autodist-plan")


if __name__ == "__main__":
    sys.exit(main())
