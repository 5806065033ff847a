"""autodist-run on GPUs passes each launch the healthy GPU ids (Paddle's launcher ``--devices``), so
a lost GPU is not used again: the supervisor's own command, checked on CPU (a GPU run needs GPUs)."""

from __future__ import annotations


import pytest

from autodist.run import Family, Launch, Supervisor, main


def test_each_launch_names_the_healthy_gpus(tmp_path):
    family = Family({2: tmp_path / "p2.json", 4: tmp_path / "p4.json"})
    supervisor = Supervisor(["train.py", "--plan", "{plan}"], family, [4, 5, 6, 7], None, gpus=True)
    command = supervisor.command(Launch([4, 5, 7], family.plans[2], None, 0.0), tmp_path / "log")
    at = command.index("--devices")
    assert command[at + 1] == "4,5,7"
    assert command[command.index("--nproc_per_node") + 1] == "3"
    assert command[-1] == str((tmp_path / "p2.json").resolve())


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--devices", "0,0", "--plans", "p", "train.py"], "distinct GPU ids"),
        (["--devices", "0,x", "--plans", "p", "train.py"], "distinct GPU ids"),
        (["--devices", "0,1", "--nproc-per-node", "4", "--plans", "p", "train.py"], "disagree"),
        (["--plans", "p", "train.py"], "--nproc-per-node N (CPU ranks) or --devices"),
    ],
)
def test_bad_device_arguments_are_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err
