"""The ``autodist-plan`` command line: planning (``main``) and the review commands (``review``)."""

from autodist.planner.cli.main import cli, main

__all__ = ["cli", "main"]
