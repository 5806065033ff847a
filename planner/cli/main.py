"""The ``autodist-plan`` command line.

``autodist-plan TARGET -o plan.json`` plans a model (the default command, ``plan``); ``graph``
dumps the traced dataflow graph; ``schema`` prints the plan format's JSON Schema; the review
commands (``show``, ``diff``, ``check``, ``export``, ``render``, ``ckpt info``) come from
:mod:`autodist.planner.cli.review`; ``calibrate`` (measure this cluster, write a cluster.toml)
from :mod:`autodist.planner.cli.calibrate`. A problem in what the user gave (click's own usage
errors included) prints ``error: <one line>`` and exits 2.

Example::

    autodist-plan plans/llama_docstring/model.py --dp 2 --mp 2 -o plan.json
    autodist-plan graph plans/llama_docstring/model.py --format dot -o llama.dot
    autodist-plan schema > plan.schema.json
"""

from __future__ import annotations

import contextlib
import difflib
import importlib.util
import json
import os
from pathlib import Path

import click

from autodist.schemas import PlanError, dump_plan, load_plan, plan_json_schema, printable, save_plan

from autodist.planner.errors import PlannerError
from autodist.planner.cli.errors import (
    OneLineError,
    ToldProgress,
    contained_command,
    one_line_errors,
    quiet_paddle_crashes,
    unexpected,
)
from autodist.planner.cli.calibrate import calibrate
from autodist.planner.quiet import held_stderr, silence_library_noise
from autodist.planner.cli.review import REVIEW_COMMANDS, check_output, write_output


@contextlib.contextmanager
def click_errors_in_our_style():
    """Re-raise click's own errors (unknown option, bad value, missing argument or file) as
    :class:`OneLineError`: ``error: no such option '--bogus' (see autodist-plan plan --help)``
    rather than click's usage block ending in ``Error: ...``. Bare ``autodist-plan`` still shows
    the help."""
    try:
        yield
    except (OneLineError, click.exceptions.NoArgsIsHelpError):
        raise
    except click.ClickException as error:
        message = error.format_message().rstrip(".")
        message = message[:1].lower() + message[1:]
        context = getattr(error, "ctx", None)
        if context is not None:
            message += f" (see {context.command_path} --help)"
        raise OneLineError(message) from None


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
            mistyped = mistyped_command(args[0], list(self.commands))
            if mistyped:
                raise OneLineError(
                    f"no such command {args[0]!r}; did you mean {mistyped!r}? (see autodist-plan --help)"
                )
            args = [self.default_command, *args]
        with click_errors_in_our_style():
            return super().parse_args(ctx, args)

    def invoke(self, ctx: click.Context):
        with click_errors_in_our_style():  # the subcommand's own arguments are parsed in here
            return super().invoke(ctx)


def mistyped_command(word: str, commands: list[str]) -> str | None:
    """The command ``word`` is a typo of, or None when it may be a model: ``autodist-plan shwo
    plan.json`` means ``show``, not a model file called ``shwo``. A word that names an existing
    file, has a path's or a target's punctuation, or names an importable module is a model.

    >>> mistyped_command("shwo", ["plan", "show", "diff"]), mistyped_command("model.py", ["plan", "show"])
    ('show', None)
    """
    close = difflib.get_close_matches(word, commands, n=1, cutoff=0.6)
    if not close or not word.isidentifier() or os.path.exists(word):  # model.py, pkg.mod:factory, a/b
        return None
    try:
        if importlib.util.find_spec(word) is not None:
            return None
    except (ImportError, ValueError):
        pass
    return close[0]


@click.group(cls=DefaultCommandGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="paddle-autodist")
def cli() -> None:
    """Plan how a PaddlePaddle model runs on many devices; review and check plans.

    \b
    Example:
      autodist-plan model.py --nproc-per-node 4 -o plan.json
      autodist-plan show plan.json
    """


@cli.command()
@click.argument("target")
@input_spec_option
@click.option("-o", "--output", type=click.Path(dir_okay=False), help="Plan file to write (default: stdout).")
@click.option(
    "--nproc-per-node",
    "--nproc_per_node",
    "--devices",
    "devices",
    type=int,
    metavar="N",
    help="Processes per node, one per device: what you will give paddle.distributed.launch --nproc_per_node "
    "(alias --devices; default: the --cluster file's, else 1).",
)
@click.option(
    "--nnodes",
    "--nodes",
    "nodes",
    type=int,
    metavar="N",
    help="Number of nodes, as paddle.distributed.launch --nnodes (alias --nodes; default: the --cluster file's, "
    "else 1). The plan is for nnodes x nproc-per-node ranks.",
)
@click.option("--dp", type=int, help="Data-parallel degree (searched when left out).")
@click.option("--mp", "--tp", "mp", type=int, help="Tensor (model) parallel degree (searched when left out).")
@click.option("--pp", type=int, help="Pipeline-parallel degree (searched when left out).")
@click.option("--sequence-parallel/--no-sequence-parallel", default=None, help="Force sequence parallelism on or off.")
@click.option(
    "--sharding-stage",
    "--zero",
    "sharding_stage",
    type=click.IntRange(0, 3),
    help="ZeRO stage over the dp group (0-3).",
)
@click.option(
    "--ep",
    metavar="N|auto",
    help="Expert-parallel degree over dp for MoE blocks, or auto to search it "
    "(default 1: every rank holds every expert).",
)
@click.option(
    "--micro-batches",
    type=int,
    help="Micro-batches per optimizer step (pipeline micro-batches, or gradient accumulation without a pipeline).",
)
@click.option("--schedule", type=click.Choice(["sequential", "1F1B", "VPP"]), help="Pipeline schedule.")
@click.option(
    "--device",
    "device_name",
    metavar="NAME",
    help="Device profile: a100-40g, a100-80g, h100-sxm, h200, cpu (default: this machine's GPU, else cpu).",
)
@click.option(
    "--cluster",
    "cluster_file",
    type=click.Path(exists=True, dir_okay=False),
    help="cluster.toml with the device's figures.",
)
@click.option(
    "--global-batch-size",
    type=int,
    help="Samples per optimizer step over all ranks (what the loader yields); default: the input spec's batch.",
)
@click.option("--micro-batch-size", type=int, help="Samples per micro-batch per rank.")
@click.option("--seq-len", type=int, help="Sequence length to price (default: the input spec's).")
@click.option(
    "--dtype",
    type=click.Choice(["bf16", "fp16", "fp32"]),
    help="What to train in (default: the model's parameters' dtype; bf16 or fp16 with fp32 parameters: "
    "mixed precision).",
)
@click.option("--optimizer", type=click.Choice(["adam", "sgd"]), default="adam", show_default=True)
@click.option("--recompute", type=click.Choice(["none", "selective", "full"]), default="none", show_default=True)
@click.option(
    "--attention",
    type=click.Choice(["auto", "flash", "eager"]),
    default="auto",
    show_default=True,
    help="Price attention cores as one fused flash kernel or as traced (eager); auto: what the model "
    "selects (F.scaled_dot_product_attention, use_flash_attention, ...) on a device with fused kernels.",
)
@click.option(
    "--local-view/--no-local-view",
    default=True,
    show_default=True,
    help="Run sub-layers with a fused q|k|v or gate|up projection on local tensors (Megatron's layout: "
    "heads or intermediate features split, one all-reduce) where the planner proves it by running them, "
    "under tensor and data parallelism (with ZeRO 1/2, micro-batches, full recompute, 1F1B), and a vocabulary-split "
    "token lookup Megatron's way; "
    "--no-local-view gathers the projection's output and lets Paddle gather the table instead.",
)
@click.option(
    "--rules",
    "rules_file",
    type=click.Path(dir_okay=False),
    help='rules.toml: placements by layer glob, e.g. "blocks.*.mlp.fc1" = "colwise" (docs/recognition.md).',
)
@click.option("--explain", is_flag=True, help="Print the ranked strategies and why on stderr.")
@click.option(
    "-q",
    "--quiet",
    is_flag=True,
    help="Nothing on stderr but errors (and --explain): no summary, no warnings, no library log lines.",
)
@click.pass_context
@one_line_errors
def plan(
    ctx: click.Context,
    target: str,
    input_specs: tuple[str, ...],
    output: str | None,
    explain: bool,
    quiet: bool,
    device_name: str | None,
    cluster_file: str | None,
    rules_file: str | None,
    local_view: bool,
    **options,
) -> None:
    """Plan how TARGET (model.py, model.py:factory or pkg.module:factory) runs on the cluster.

    \b
    Example:
      autodist-plan plans/llama_docstring/model.py --nproc-per-node 4 -o plan.json
      autodist-plan model.py --nnodes 2 --nproc-per-node 8 --mp 8 --device h100-sxm --explain -o plan.json
    """
    from autodist.schemas.describe import strategy_text

    if output and not Path(output).resolve().parent.is_dir():  # checked before the planning work, not after
        raise PlannerError(f"{output}: the folder {Path(output).parent} does not exist; create it first")
    # --quiet: what Paddle, PaddleFormers and the model print on import and trace is held back
    with held_stderr(expected=(PlannerError, PlanError)) if quiet else contextlib.nullcontext():
        from autodist.planner.cost.hardware import cluster_shape, planned_device
        from autodist.planner.cost.search import SearchRequest
        from autodist.planner.driver import plan_target
        from autodist.planner.recognise.rules import load_rules

        quiet_paddle_crashes()

        devices, nodes = cluster_shape(cluster_file, options.pop("devices"), options.pop("nodes"))
        ctx.params.update(devices=devices, nodes=nodes)  # the provenance records what was planned for
        ep = expert_degree(options.pop("ep"))
        profile, device_note = planned_device(device_name, cluster_file, devices)  # a note when it is this machine's
        request = SearchRequest(
            devices_per_node=devices,
            nodes=nodes,
            device=profile,
            ep=ep,
            device_note=device_note,
            **options,
        )
        rules = load_rules(rules_file) if rules_file else None
        try:
            made = plan_target(
                target,
                list(input_specs) or None,
                request,
                planner_arguments(ctx),
                ToldProgress(quiet=quiet),
                rules=rules,
                local_view=local_view,
            )
        except (PlannerError, PlanError):
            raise
        except Exception as err:  # never a traceback: one line saying what failed, and where
            raise unexpected(err, target) from None
    if output:
        save_plan(made.plan, output)
    else:
        data = dump_plan(made.plan)
        load_plan(data)  # checked as save_plan checks a file
        click.echo(data.decode(), nl=False)
    if explain:
        from autodist.planner.review.explain import explain_table, sublayer_lines

        click.echo(explain_table(made.result), err=True)
        for line in sublayer_lines(made.analysis, made.plan):
            click.echo(printable(line), err=True)
        if made.kept_whole:
            click.echo("why these stay gathered or replicated, and what to change:", err=True)
        for line in made.kept_whole:
            click.echo(printable(f"  {line}"), err=True)
    if not quiet:
        from autodist.planner.emit import unmatched, unmatched_note
        from autodist.planner.review.format import collapse

        # one line per kind of layer (indices collapsed), not one per layer
        for line in [*made.loading, *made.kept_whole, *made.crashes]:
            click.echo(printable(f"warning: {line}"), err=True)
        for row in collapse(dict.fromkeys(unmatched(made.analysis, made.plan.local_view), 0)):
            click.echo(
                printable(f"warning: {unmatched_note(row.pattern)}"),
                err=True,
            )
        traced = made.traced
        fallback = f"; {traced.fallback_text()}" if traced.fallback_reason else ""
        assumed = f" ({request.device_note})" if request.device_note else ""
        click.echo(
            printable(
                f"plan for {request.world} devices: {strategy_text(made.plan.strategy)}"
                + (f" -> {output}" if output else "")
                + assumed
                + fallback
            ),
            err=True,
        )


def expert_degree(text: str | None) -> int | None:
    """``--ep``: None when left out -> 1; ``auto`` -> None (searched); else a positive integer.

    >>> expert_degree(None), expert_degree("auto"), expert_degree("2")
    (1, None, 2)
    """
    if text is None:
        return 1
    if text == "auto":
        return None
    if not text.isdigit() or int(text) < 1:
        raise PlannerError(f"--ep must be a positive integer or auto, got {text!r}")
    return int(text)


def planner_arguments(ctx: click.Context) -> dict[str, str]:
    """The options that shape a plan, as strings, for its provenance (not where it is written)."""
    skipped = {"output", "quiet", "explain", "rules_file"}  # the rules themselves are recorded instead
    return {
        name: ",".join(value) if isinstance(value, tuple) else str(value)
        for name, value in sorted(ctx.params.items())
        if name not in skipped and value not in (None, ())
    }


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
@one_line_errors
def graph(target: str, input_specs: tuple[str, ...], fmt: str, output: str | None) -> None:
    """Dump the traced dataflow graph of TARGET (for debugging the matcher).

    \b
    Example:
      autodist-plan graph plans/llama_docstring/model.py --format dot -o llama.dot
    """
    from autodist.planner import driver
    from autodist.planner.graph import graph_to_dot, graph_to_json

    check_output(output)
    loaded = driver.load(target, input_specs)
    dataflow = driver.trace(loaded.model, loaded.input_specs).graph
    if fmt == "json":
        text = json.dumps(graph_to_json(dataflow), indent=1, sort_keys=True) + "\n"
    else:
        text = graph_to_dot(dataflow)
    if output:
        write_output(text, output)
    else:
        click.echo(text, nl=False)


# show / diff / check / export / render / ckpt live in their own module (light imports: no paddle).
for _review_command in REVIEW_COMMANDS:
    cli.add_command(_review_command)
if calibrate.callback is not None:  # (click types a command's callback as optional)
    calibrate.callback = one_line_errors(calibrate.callback)
cli.add_command(calibrate)


def main() -> None:
    """Entry point of the ``autodist-plan`` console script: the command runs in a child process,
    so a Paddle crash the planner does not contain ends in one ``error:`` line naming the step
    (:func:`~autodist.planner.cli.errors.contained_command`), not a signal."""
    silence_library_noise()  # before Paddle is imported: glog's environment is read then
    contained_command(lambda: cli(prog_name="autodist-plan"))
