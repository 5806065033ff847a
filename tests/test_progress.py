"""Progress on stderr: shown on a terminal, silent in pipes and with --quiet."""

from __future__ import annotations

import io

import pytest

from autodist.planner.progress import Progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_terminal_shows_steps():
    out = Terminal()
    progress = Progress(stream=out)
    with progress.step("tracing"):
        pass
    text = out.getvalue()
    assert "tracing ... done (" in text


def test_failure_is_reported_and_raised():
    out = Terminal()
    with pytest.raises(KeyError), Progress(stream=out).step("searching"):
        raise KeyError("x")
    assert out.getvalue().endswith("searching ... failed\n")


@pytest.mark.parametrize("stream, quiet", [(io.StringIO(), False), (Terminal(), True)])
def test_pipe_or_quiet_is_silent(stream, quiet):
    progress = Progress(quiet=quiet, stream=stream)
    with progress.step("tracing"):
        pass
    assert stream.getvalue() == ""
