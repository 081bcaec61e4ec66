"""The accelerator check (``make gpu-check``): its device, its runs, and its results page.

``pytest tests/gpu`` runs on the accelerator torch finds, with every visible device (one
rank each); without one, every test is skipped. ``pytest tests/gpu --device cpu`` is the
dry run: the same tests, the same commands and code paths, on 2 gloo ranks of the CPU,
with the checks only an accelerator can answer (streams, reserved memory) skipped with
their reason. Only a run on an accelerator writes ``benchmarks/results/gpu.md``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results" / "gpu.md"
# What every run of the check trains: small enough for a few minutes on one device.
MODEL = "llama-small"
STEPS = 12
SEQ_LEN = 128
ROWS_PER_RANK = 4
CPU_WORLD = 2  # the dry run's gloo ranks
RUN_TIMEOUT_S = 240


def pytest_addoption(parser):
    parser.addoption(
        "--device",
        default=None,
        help="tests/gpu: the device to check (default: the accelerator torch finds; cpu: "
        "the dry run on gloo ranks)",
    )


class Check:
    """The session's device, its ranks, and the rows of the results page."""

    def __init__(self, device: str, world: int):
        self.device = device
        self.world = world
        self.accelerated = device != "cpu"
        self.rows: list[tuple[str, str]] = []  # (what, result)
        self.started = time.monotonic()
        self.out: Path | None = None

    def note(self, what: str, result: str) -> None:
        self.rows.append((what, result))

    def train(self, name: str, *flags: str) -> dict:
        """``python -m raggedfsdp train`` on this device and its ranks; its summary, with
        its per-step losses as ``"losses"``."""
        out = self.out / name
        cmd = [
            sys.executable, "-m", "raggedfsdp", "train", "--device", self.device,
            "--nproc", str(self.world), "--model", MODEL, "--steps", str(STEPS),
            "--seq-len", str(SEQ_LEN), "--batch-size", str(ROWS_PER_RANK * self.world),
            "--max-bytes", "400000", "--val-every", "0", "--warmup", "2", "--lr", "1e-3",
            "--no-progress", "--no-plot", "--out", str(out), *flags,
        ]  # fmt: skip
        _run(cmd)
        summary = json.loads((out / "summary.json").read_text())
        rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        summary["losses"] = [r["loss"] for r in rows if "loss" in r]
        return summary

    def profile(self) -> Path:
        """``profile_step.py`` on this device and its ranks (torchrun); its output folder."""
        out = self.out / "profile"
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={self.world}", str(ROOT / "tests" / "gpu" / "profile_step.py"),
            "--device", self.device, "--model", MODEL, "--seq-len", str(SEQ_LEN),
            "--rows", str(ROWS_PER_RANK), "--out", str(out),
        ]  # fmt: skip
        _run(cmd)
        return out


def _run(cmd: list[str]) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    done = subprocess.run(
        cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, check=False
    )
    if done.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} exited with {done.returncode}:\n{done.stderr[-4000:]}"
        )


def _device_name(device: str) -> str:
    if device == "cpu":
        return f"the CPU ({os.cpu_count()} cores)"
    module = torch.get_device_module(device)
    names = {module.get_device_name(i) for i in range(torch.accelerator.device_count())}
    return f"{torch.accelerator.device_count()} x {', '.join(sorted(names))}"


@pytest.fixture(scope="session")
def check(request, tmp_path_factory) -> Check:
    """The device under check; skips every test where there is none."""
    wanted = request.config.getoption("--device", default=None)
    found = torch.accelerator.current_accelerator(check_available=True)
    if wanted in (None, "auto"):
        if found is None:
            pytest.skip("no accelerator here: `make gpu-check DEVICE=cpu` is the dry run")
        wanted = found.type
    if wanted != "cpu" and (found is None or found.type != wanted):
        pytest.fail(f"--device {wanted}: this machine has {found or 'no accelerator'}")
    world = CPU_WORLD if wanted == "cpu" else torch.accelerator.device_count()
    session = Check(wanted, world)
    session.out = tmp_path_factory.mktemp("gpu-check")
    yield session
    if session.accelerated:
        _write_results(session)
    else:
        print("\n# dry run on the CPU (not written to benchmarks/results/gpu.md)")
        for what, result in session.rows:
            print(f"- {what}: {result}")


def _write_results(session: Check) -> None:
    spec = importlib.util.spec_from_file_location("_common", ROOT / "benchmarks" / "_common.py")
    common = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec.loader.exec_module(common)
    lines = common.header(
        f"GPU check: raggedfsdp on {_device_name(session.device)}",
        "make gpu-check",
        time.monotonic() - session.started,
    )
    lines += [
        f"Configuration: `python -m raggedfsdp train --device {session.device} --nproc "
        f"{session.world} --model {MODEL} --steps {STEPS} --seq-len {SEQ_LEN} --batch-size "
        f"{ROWS_PER_RANK * session.world}`, one rank per device, process-group backend "
        f"{torch.distributed.get_default_backend_for_device(session.device)}.",
        "",
        "| check | result |",
        "|---|---|",
        *(f"| {what} | {result} |" for what, result in session.rows),
        "",
        "## Analysis",
        "",
    ]
    common.write_results(RESULTS, "\n".join(lines))
