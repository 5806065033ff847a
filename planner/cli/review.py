"""The review subcommands of ``autodist-plan``: show, diff, check, export, render for plans,
``ckpt info`` for checkpoints.

They are plain click commands collected in :data:`REVIEW_COMMANDS`; the ``autodist-plan`` group
registers them with ``for c in REVIEW_COMMANDS: cli.add_command(c)``. Every command prints a
problem as one ``error: ...`` line on stderr and exits 2.

Example::

    autodist-plan show plans/llama_docstring/plan_4dev.json
    autodist-plan diff old.json new.json || echo "the plan changed"
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
import click

from autodist.schemas import load_plan
from autodist.schemas.io import write_atomically
from autodist.schemas.checkpoint import read_checkpoint

from autodist.planner.cli.errors import one_line_errors
from autodist.planner.review.check import check_plan_for_target
from autodist.planner.review.checkpoint_info import checkpoint_data, checkpoint_text
from autodist.planner.review.diff import diff_plans
from autodist.planner.errors import PlannerError
from autodist.planner.review.export import export_parallelize
from autodist.planner.progress import Progress
from autodist.planner.review.format import printable
from autodist.planner.review.render import render_svg
from autodist.planner.review.show import TOP_ALTERNATIVES, show_data, show_text


def check_output(output: str | None) -> None:
    """Refuse an output path whose folder does not exist, before any work (click's
    ``dir_okay=False`` already refuses a folder). Raises :class:`PlannerError` (one line, exit 2)."""
    if output is None:
        return
    path = Path(output)
    if not (path.parent if str(path.parent) else Path(".")).is_dir():
        raise PlannerError(f"cannot write {output}: no folder {str(path.parent)!r}")


def write_output(text: str | bytes, output: str | None) -> None:
    """Write to ``output`` atomically (:func:`~autodist.schemas.io.write_atomically`) or to
    stdout when it is None."""
    if output is None:
        click.echo(text if isinstance(text, str) else text.decode(), nl=False)
        return
    try:
        write_atomically(output, text.encode() if isinstance(text, str) else text)
    except OSError as err:
        raise PlannerError(f"cannot write {output}: {err.strerror or err}") from None


_SETTINGS = {"help_option_names": ["-h", "--help"]}


@click.command(context_settings=_SETTINGS)
@click.argument("plan", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON for machines.")
@click.option("--top", default=TOP_ALTERNATIVES, show_default=True, help="How many alternatives to list.")
@one_line_errors
def show(plan: str, as_json: bool, top: int) -> None:
    """Summarise PLAN: model, cluster, the mesh as a grid of ranks, strategy, stages,
    placements collapsed into patterns, estimates and the best alternatives.

    \b
    Example:
      autodist-plan show plans/llama_docstring/plan_4dev.json
      autodist-plan show plan.json --json | jq .strategy
    """
    loaded = load_plan(plan)
    if as_json:
        click.echo(json.dumps(show_data(loaded, top), indent=2, sort_keys=True))
    else:
        click.echo(show_text(loaded, top), nl=False)


@click.command(context_settings=_SETTINGS)
@click.argument("old", type=click.Path(dir_okay=False))
@click.argument("new", type=click.Path(dir_okay=False))
@one_line_errors
def diff(old: str, new: str) -> None:
    """Say in words what changed from plan OLD to plan NEW.

    Exit status like diff: 0 when the plans are the same, 1 when they differ, 2 on error.

    \b
    Example:
      autodist-plan diff plan.json new_plan.json
      git show HEAD:plan.json > /tmp/old.json && autodist-plan diff /tmp/old.json plan.json
    """
    lines = diff_plans(load_plan(old), load_plan(new))
    if not lines:
        click.echo("the plans are the same")
        return
    click.echo("\n".join(lines))
    sys.exit(1)


@click.command(context_settings=_SETTINGS)
@click.argument("plan", type=click.Path(dir_okay=False))
@click.argument("target")
@click.option("--no-trace", is_flag=True, help="Check parameters only (fast); skip re-tracing the forward.")
@click.option("-q", "--quiet", is_flag=True, help="No progress on stderr.")
@one_line_errors
def check(plan: str, target: str, no_trace: bool, quiet: bool) -> None:
    """Check that PLAN is still valid for the model TARGET builds (model.py, model.py:factory or
    pkg.module:factory): same parameters, shapes and dtypes, same traced structure.

    Exit status: 0 valid, 1 stale (the reasons are printed), 2 error. Meant for CI and pre-commit.

    \b
    Example:
      autodist-plan check plans/llama_docstring/plan_4dev.json plans/llama_docstring/model.py
    """
    loaded = load_plan(plan)
    reasons = check_plan_for_target(loaded, target, trace=not no_trace, progress=Progress(quiet=quiet))
    if not reasons:
        click.echo(printable(f"{plan}: valid for {target}"))
        return
    click.echo(printable(f"{plan}: stale for {target}, re-plan it:"))
    click.echo("\n".join(printable(f"  - {reason}") for reason in reasons))
    sys.exit(1)


#: Export formats: name -> function(plan, plan path, paddle only) -> file text.
EXPORTERS = {"paddle-parallelize": export_parallelize}


@click.command(context_settings=_SETTINGS)
@click.argument("plan", type=click.Path(dir_okay=False))
@click.option("--to", "target", type=click.Choice(sorted(EXPORTERS)), required=True, help="The format to write.")
@click.option("-o", "--output", type=click.Path(dir_okay=False), help="Write here instead of stdout.")
@click.option(
    "--paddle-only",
    is_flag=True,
    help="Paddle alone, no autodist at run time: sub-layers the plan runs on local tensors run in the "
    "global view instead (fused outputs gathered, the table gathered), each with a comment on what it costs.",
)
@one_line_errors
def export(plan: str, target: str, output: str | None, paddle_only: bool) -> None:
    """Write PLAN in another tool's format, e.g. as a dist.parallelize config.

    paddle-parallelize: a Python module with the equivalent dist.parallelize config (MESH, CONFIG
    and a parallelize(model, optimizer) function), for adopting a plan in hand-written code. A
    plan with local views or a local token lookup calls autodist.apply_local_views for them, unless
    --paddle-only.

    \b
    Example:
      autodist-plan export plan.json --to paddle-parallelize -o parallel_config.py
      # then, on every rank: from parallel_config import parallelize
      #                      model, optimizer = parallelize(model, optimizer)
    """
    check_output(output)
    loaded = load_plan(plan)
    # the path as given: a module for a plan with local views reads it at run time (apply_local_views)
    write_output(EXPORTERS[target](loaded, plan, paddle_only), output)


@click.command(context_settings=_SETTINGS)
@click.argument("plan", type=click.Path(dir_okay=False))
@click.option("-o", "--output", type=click.Path(dir_okay=False), help="SVG file to write (default: stdout).")
@one_line_errors
def render(plan: str, output: str | None) -> None:
    """Draw PLAN as an SVG picture: the mesh, the pipeline stages with their blocks, and each
    rank's estimated memory by kind, scaled to the largest rank, with the plan's dtype.

    \b
    Example:
      autodist-plan render plan.json -o plan.svg
      rsvg-convert plan.svg -o plan.png      # or: convert plan.svg plan.png
    """
    check_output(output)
    write_output(render_svg(load_plan(plan)), output)


@click.group(context_settings=_SETTINGS)
def ckpt() -> None:
    """Inspect checkpoints written by autodist.save_checkpoint.

    \b
    Example:
      autodist-plan ckpt info ckpt
    """


@ckpt.command(context_settings=_SETTINGS)
@click.argument("path", type=click.Path(file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON for machines.")
@one_line_errors
def info(path: str, as_json: bool) -> None:
    """Show what the checkpoint folder PATH holds: step, model, the plan it was saved under
    (fingerprint, mesh, strategy), optimizer states, LR scheduler, files, and every parameter's
    shape, dtype and number of shards. Reads the metadata only.

    \b
    Example:
      autodist-plan ckpt info checkpoints/step_1000
      autodist-plan ckpt info ckpt --json | jq .plan.strategy
    """
    meta = read_checkpoint(path)
    if as_json:
        click.echo(json.dumps(checkpoint_data(meta), indent=2, sort_keys=True))
    else:
        click.echo(checkpoint_text(meta, path), nl=False)


#: The commands the ``autodist-plan`` group registers.
REVIEW_COMMANDS: list[click.Command] = [show, diff, check, export, render, ckpt]
