"""Multi-process test harness: N gloo ranks on this machine, one spawn per grid.

Starting ranks is the slow part, so a test spawns once per world size and runs a
whole grid of sub-configurations inside it (ranks fork from a server that has
imported torch already: [Note: forkserver]):

    def _grid(rank, world):            # module level, so spawn can pickle it
        run_cases({f"units={u}": partial(_check, u) for u in UNITS})

    @pytest.mark.parametrize("world", [1, 2, 3, 4])
    def test_something(world):
        spawn(world, _grid)

``spawn`` raises with the failing rank's traceback (every failing rank's, in
rank order), and kills all ranks after ``timeout`` seconds or as soon as one rank
dies, so a rank blocked in a collective never hangs the suite.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import tempfile
import time
import traceback
from collections.abc import Callable

DEFAULT_TIMEOUT = 180.0


def _worker(rank, world, init_file, payload, queue):
    from tests.numerics import THREADS, configure_torch

    os.environ.setdefault("OMP_NUM_THREADS", str(THREADS))
    try:
        with open(payload, "rb") as f:  # (fn, args), pickled by value: see spawn
            fn, args, init = pickle.load(f)
        import torch.distributed as dist

        configure_torch()
        if not init:  # fn makes its own process group
            fn(rank, world, *args)
            queue.put((rank, None))
            return
        dist.init_process_group(
            "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world
        )
        try:
            fn(rank, world, *args)
        finally:
            dist.destroy_process_group()
        queue.put((rank, None))
    except BaseException:  # report everything, including assertion errors
        queue.put((rank, traceback.format_exc()))


# [Note: forkserver] Each rank is a fresh process, as with "spawn", but forked from one
# server process per pytest run that has already imported torch and raggedfsdp: a rank
# starts in a fraction of a second instead of re-importing torch (several seconds each,
# most of a small test's time on 2 cores). The server is started once, before any test
# touches torch state, so ranks inherit only imported modules, no process group or
# threads.
_PRELOAD = ["torch", "torch.distributed", "torch.distributed.tensor", "raggedfsdp"]
_CTX = None


def _context():
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(_PRELOAD)
    return _CTX


def spawn(
    world: int, fn: Callable, *args, timeout: float = DEFAULT_TIMEOUT, init: bool = True
) -> None:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks; raise if any rank fails.

    Args:
        world: number of ranks.
        fn: a module-level function (it is pickled by name into each rank).
        *args: picklable arguments passed after ``rank, world``.
        timeout: seconds before every rank is killed and the test fails.
        init: make the default process group (gloo) around ``fn``; False when ``fn``
            makes its own.
    """
    ctx = _context()
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        # The arguments go through a file with plain pickle (tensors by value): the process
        # pickler would send every tensor's shared memory as a file descriptor, and a
        # forkserver passes at most a few hundred.
        payload = os.path.join(tmp, "payload.pkl")
        with open(payload, "wb") as f:
            pickle.dump((fn, args, init), f)
        procs = [
            ctx.Process(target=_worker, args=(r, world, init_file, payload, queue), daemon=True)
            for r in range(world)
        ]
        for p in procs:
            p.start()
        results: dict[int, str | None] = {}
        deadline = time.monotonic() + timeout
        try:
            while len(results) < world:
                try:
                    rank, err = queue.get(timeout=0.5)
                    results[rank] = err
                    if err is not None:
                        # give the other ranks a moment to report their own errors
                        deadline = min(deadline, time.monotonic() + 5)
                except Exception:  # queue.Empty
                    pass
                dead = [
                    r
                    for r, p in enumerate(procs)
                    if p.exitcode not in (None, 0) and r not in results
                ]
                for r in dead:
                    results[r] = f"rank {r} died with exit code {procs[r].exitcode}"
                if time.monotonic() > deadline:
                    for r in range(world):
                        results.setdefault(r, f"rank {r} timed out after {timeout:.0f}s")
                    break
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join(timeout=10)
    failures = [f"--- rank {r} ---\n{err}" for r, err in sorted(results.items()) if err]
    if failures:
        raise AssertionError(f"{len(failures)} of {world} ranks failed:\n" + "\n".join(failures))


def run_cases(cases: dict[str, Callable[[], None]]) -> None:
    """Run every case (inside one rank) and raise one error naming all that failed.

    Every rank runs every case in the same order, so collectives stay matched; a
    case that fails on one rank only can leave the others blocked, which the
    ``spawn`` timeout then reports.
    """
    failed = []
    for name, case in cases.items():
        try:
            case()
        except Exception:
            failed.append(f"[{name}]\n{traceback.format_exc()}")
    if failed:
        raise AssertionError(f"{len(failed)} of {len(cases)} cases failed:\n" + "\n".join(failed))


# ---- the train CLI, its ranks forked ----------------------------------------------------------
def train_cli(argv: list[str], timeout: float = 600.0, nudge_seed: int | None = None) -> None:
    """``python -m raggedfsdp train ARGV`` in this process, its ranks forked from the warm
    server instead of started by torchrun (which imports torch again in every rank: most
    of a small job's time). Everything else is the CLI's own: argument checks, the run
    folder and its lock, each rank's ``_loop.main``. Tests of the launcher itself (exit
    codes, killed or stopped ranks) run the real command.

    Args:
        argv: the arguments after ``train``.
        timeout: seconds before every rank is killed.
        nudge_seed: every rank's gradients nudged before each optimizer step
            (``tests.numerics.nudged_gradients``): the reference's sensitivity.

    Raises:
        AssertionError: a rank failed (its traceback and message included).
        SystemExit: the CLI refused the arguments.
    """
    import json
    import socket

    from raggedfsdp.cli import train as train_command

    def launch(args) -> int:
        with socket.socket() as s:  # a free port for the ranks' rendezvous
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        spawn(
            args.nproc,
            _train_rank,
            json.dumps(vars(args)),
            port,
            nudge_seed,
            timeout=timeout,
            init=False,
        )
        return 0

    assert train_command.main(list(argv), launch=launch) == 0


def _train_rank(rank: int, world: int, args_json: str, port: int, nudge_seed) -> None:
    from contextlib import nullcontext

    from raggedfsdp.train import loop
    from raggedfsdp.train.guard import ARGS_ENV
    from tests.numerics import nudged_gradients

    os.environ.update(
        {
            ARGS_ENV: args_json,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world),
        }
    )
    with nullcontext() if nudge_seed is None else nudged_gradients(nudge_seed):
        code = loop.main()
    assert code == 0, f"rank {rank}: train exited with {code} (its message is above)"
