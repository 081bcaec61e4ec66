"""Every benchmark, one after the other (``make bench``).

    .venv/bin/python benchmarks/run_all.py                  # planner, step, optim, peers
    .venv/bin/python benchmarks/run_all.py --only planner   # a selection, comma-separated

Each benchmark is its own script, run as a subprocess with this interpreter, and writes
its own ``benchmarks/results/<name>.md`` (keeping the page's hand-written analysis). The
peers comparison needs DeepSpeed and Megatron-FSDP, which live in the optional
environment ``.venv-peers`` (``make bench-peers`` builds it and runs them): when it
exists, peers run there and write ``benchmarks/results/peers.md``; otherwise they run here
with the systems torch itself has (raggedfsdp, FSDP2, FSDP1) and write
``out/bench/peers.md``, so that the committed five-system report is not replaced by a
smaller one.

Exits non-zero if any benchmark that ran failed.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ("planner", "step", "optim", "peers")
PEERS_PYTHON = ROOT / ".venv-peers" / "bin" / "python"
TORCH_SYSTEMS = "raggedfsdp,fsdp2,fsdp1"


def command(name: str) -> tuple[list[str], str]:
    """The command line that runs benchmark ``name``, and a note on how it is run."""
    script = f"benchmarks/{name}.py"
    if name != "peers":
        return [sys.executable, script], ""
    if PEERS_PYTHON.exists():
        return [str(PEERS_PYTHON), script], "in .venv-peers, every system"
    cmd = [sys.executable, script, "--systems", TORCH_SYSTEMS]
    cmd += ["--out", "out/bench/peers.md", "--runs", "out/bench/peers"]
    return cmd, "no .venv-peers (`make bench-peers` builds it): torch's systems only"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="benchmarks/run_all.py", description=__doc__.split("\n")[0])
    p.add_argument(
        "--only",
        default=",".join(BENCHMARKS),
        help="comma-separated, from " + ", ".join(BENCHMARKS),
    )
    args = p.parse_args(argv)
    chosen = args.only.split(",")
    unknown = sorted(set(chosen) - set(BENCHMARKS))
    if unknown:
        p.error(f"--only: unknown benchmark(s) {', '.join(unknown)}; choose from {BENCHMARKS}")
    outcomes = []
    for name in chosen:
        cmd, how = command(name)
        print(f"== {name}: {' '.join(cmd)}" + (f"  ({how})" if how else ""), flush=True)
        t0 = time.perf_counter()
        code = subprocess.run(cmd, cwd=ROOT).returncode
        outcomes.append(
            (name, "ok" if code == 0 else f"FAILED (exit {code})", time.perf_counter() - t0)
        )
    print("\n| benchmark | outcome | seconds |\n|---|---|---:|")
    for name, outcome, seconds in outcomes:
        print(f"| {name} | {outcome} | {seconds:.0f} |")
    return 1 if any(o.startswith("FAILED") for _, o, _ in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
