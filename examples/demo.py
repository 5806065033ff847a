"""``make demo``: the whole product in one command, on any machine with the venv.

1. plan the docstring Llama (a tiny config) for 4 devices: ``autodist-plan ... -o plan.json``, with
   dp2 x mp2 and no sequence parallelism or ZeRO fixed, because Paddle's CPU collectives lack the
   reduce-scatter those need (on GPUs, leave the choice to the planner);
2. calibrate this machine on 4 ranks at the plan's matmul shapes, with a few real training
   steps of the model under the plan (``autodist-plan calibrate --model``, launched like
   training), and plan again with the measured ``cluster.toml``;
3. review the plan: ``autodist-plan show plan.json``;
4. train 5 steps on 4 CPU ranks: ``python -m paddle.distributed.launch --nproc_per_node 4
   examples/train.py --plan plan.json`` (``apply_plan`` on every rank), which prints the
   measured step time next to the plan's estimate;
5. train the same 5 steps on one device and print both losses side by side.

Exit status 0 when the losses agree (relative difference at most 1e-5), 1 when they do not, 2
when a step fails (its log tail is printed). The files stay in the printed folder.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODEL = "plans/llama_docstring/model.py"
TRAIN = "examples/train.py"  # commands run from the repository root
#: The docstring Llama at toy sizes (read by its build_model() and input_spec()).
TINY = {"NUM_LAYERS": 2, "HIDDEN_SIZE": 32, "INTERMEDIATE_SIZE": 64, "NUM_HEADS": 4, "VOCAB_SIZE": 64, "SEQ_LENGTH": 16}
RANKS, STEPS, RTOL = 4, 5, 1e-5
STEP_TIMEOUT_S = 300


def environment(sizes: dict[str, int] | None = None) -> dict[str, str]:
    """The demo's environment: the docstring Llama at ``sizes`` (default :data:`TINY`)."""
    env = dict(os.environ)
    env.update({f"LLAMA_DOCSTRING_{k}": str(v) for k, v in (sizes or TINY).items()})
    env.setdefault("OMP_NUM_THREADS", "1")  # 4 ranks on a 2-core machine
    return env


def run(title: str, command: list[str], workdir: Path, log_dir: Path | None = None) -> float:
    """Run one step quietly (its output to a log file); on failure print the log tail and exit 2."""
    shown = " ".join(a if " " not in a else repr(a) for a in command).replace(sys.executable, "python")
    print(f"\n== {title}\n$ {shown}", flush=True)
    log = workdir / f"{title.split()[0].lower()}.log"
    start = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen(
            command, cwd=REPO, env=environment(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )  # its own process group: a timeout kills every rank
        try:
            code = proc.wait(timeout=STEP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = None
    if code != 0:
        text = log.read_text(errors="replace")
        workers = sorted(log_dir.glob("workerlog.*")) if log_dir else []
        for worker in workers:
            text += f"\n[{worker.name}]\n" + worker.read_text(errors="replace")
        print(text[-3000:], file=sys.stderr)
        status = "timed out" if code is None else f"exit code {code}"
        print(f"demo: step '{title}' failed ({status}); logs in {workdir}", file=sys.stderr)
        sys.exit(2)
    return time.monotonic() - start


def plan_command(plan: Path, degrees: list[str]) -> list[str]:
    """The demo's planner command for its model on 4 ranks, with the degrees given and no sequence
    parallelism or ZeRO (the CPU wheel's collectives lack the reduce-scatter they need)."""
    return [
        sys.executable,
        "-m",
        "autodist.planner.cli",
        MODEL,
        "--devices",
        str(RANKS),
        *degrees,
        "--no-sequence-parallel",
        "--sharding-stage",
        "0",
        "--dtype",
        "fp32",
        "-o",
        str(plan),
    ]


def launch_command(log_dir: str | Path, *args: str, ranks: int = RANKS) -> list[str]:
    """``python -m paddle.distributed.launch`` on ``ranks`` ranks (the demo's 4), its logs in ``log_dir``."""
    launch = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", str(ranks)]
    return [*launch, "--log_dir", str(log_dir), *args]


def main(argv: list[str]) -> None:
    """``python examples/demo.py [WORKDIR]``: the files go to WORKDIR (default: a new temp folder)."""
    workdir = Path(argv[0]) if argv else Path(tempfile.mkdtemp(prefix="autodist-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    plan, python = workdir / "plan.json", sys.executable
    cluster = workdir / "cluster.toml"
    began = time.monotonic()
    planner = plan_command(plan, ["--dp", "2", "--mp", "2"])
    run("Plan the docstring Llama (tiny config) for 4 devices", [*planner, "--device", "cpu"], workdir)
    run(
        f"Calibrate this machine on {RANKS} ranks: the plan's matmul shapes, collectives, a few training steps",
        launch_command(
            str(workdir / "calibrate_logs"),
            str(Path(python).parent / "autodist-plan"),
            "calibrate",
            "--plan",
            str(plan),
            "--model",
            MODEL,
            "-o",
            str(cluster),
        ),
        workdir,
        workdir / "calibrate_logs",
    )
    run("Plan again with the measured cluster.toml", [*planner, "--cluster", str(cluster)], workdir)

    print(f"\n== Review\n$ autodist-plan show {plan}")
    from autodist.planner.cli.review import show

    show.main([str(plan)], prog_name="autodist-plan show", standalone_mode=False)

    log_dir = workdir / "launch_logs"
    run(
        f"Train {STEPS} steps on {RANKS} CPU ranks with apply_plan",
        launch_command(
            str(log_dir),
            TRAIN,
            "--model",
            MODEL,
            "--plan",
            str(plan),
            "--steps",
            str(STEPS),
            "--losses-out",
            str(workdir / "distributed.json"),
        ),
        workdir,
        log_dir,
    )
    run(
        f"Train the same {STEPS} steps on one device",
        [python, TRAIN, "--model", MODEL, "--steps", str(STEPS), "--losses-out", str(workdir / "single.json")],
        workdir,
    )

    single = json.loads((workdir / "single.json").read_text())["losses"]
    run_record = json.loads((workdir / "distributed.json").read_text())
    measured, estimated = run_record.get("step_time_s"), run_record.get("estimate_step_time_s")
    if measured and estimated:
        print(
            f"\n== Step time on {RANKS} ranks\nmeasured {measured * 1e3:.1f} ms, plan estimate {estimated * 1e3:.1f} ms "
            f"with the calibrated profile (measured / estimate {measured / estimated:.2f})"
        )
    sys.exit(report(single, run_record["losses"], workdir, time.monotonic() - began))


def report(single: list[float], distributed: list[float], workdir: Path, seconds: float) -> int:
    """Print the losses side by side; 0 when they agree within RTOL, else 1."""
    print(f"\n== Losses\n{'step':>4}  {'one device':>12}  {f'{RANKS} ranks':>12}  {'rel. diff':>9}")
    worst = 0.0
    for step, (a, b) in enumerate(zip(single, distributed), 1):
        rel = abs(a - b) / max(abs(a), 1e-12)
        worst = max(worst, rel)
        print(f"{step:>4}  {a:>12.6f}  {b:>12.6f}  {rel:>9.1e}")
    same = len(single) == len(distributed) == STEPS and worst <= RTOL
    verdict = "the same" if same else "DIFFERENT"
    print(
        f"\nlosses are {verdict} (largest relative difference {worst:.1e}, tolerance {RTOL:.0e}); "
        f"{seconds:.0f} s in all; files in {workdir}"
    )
    return 0 if same else 1


if __name__ == "__main__":
    main(sys.argv[1:])
