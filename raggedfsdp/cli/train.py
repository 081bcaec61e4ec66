"""``python -m raggedfsdp train``: launch N ranks with torchrun and train a catalogue model.

Arguments are checked here, before any process is spawned (``checks``: the launch,
every number's range, the data, the block size against the model, the run folder);
then the launcher takes the run folder (``rundir``: [Note: a run owns its folder])
and starts the ranks, which run ``raggedfsdp.train.loop``. The launcher is
``torch.distributed.run`` itself, so ``--nnodes``/``--node-rank``/``--rdzv-endpoint``
scale the same command to several machines. A failure inside the ranks ends the job
with their own one-line messages and one line from the launcher (see [Note: how a rank
fails] in ``guard``): the launcher's line says how the first failed rank ended (its exit
code, or the signal that killed it) and what the run's checkpoints on disk are.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path

from raggedfsdp.planner import DEFAULT_MAX_BUFFERS
from raggedfsdp.train.checks import TRAIN_MODELS, check_args, start_notes

BACKENDS = ("raggedfsdp", "fsdp2")
OPTIMIZERS = ("adamw", "flat-adamw", "muon", "shampoo", "adamw8bit", "sgd")
DEFAULT_TIMEOUT_S = 300.0


class _ResumeFrom(argparse.Action):
    """``--resume-from DIR`` is a ``--resume`` that names its checkpoint."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        namespace.resume = True


def build_parser() -> argparse.ArgumentParser:
    """The ``train`` command's parser: its argument groups in the order ``--help`` lists them."""
    p = argparse.ArgumentParser(
        prog="python -m raggedfsdp train",
        description="Train a catalogue model with fully sharded data parallelism on N ranks "
        "(NCCL on CUDA, gloo on the CPU), launched through torch.distributed.run.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    _add_model_args(p)
    _add_launch_args(p)
    _add_optimisation_args(p)
    _add_shampoo_args(p)
    _add_data_args(p)
    _add_output_args(p)
    return p


def _add_model_args(p: argparse.ArgumentParser) -> None:
    """Add "model and sharding": the model, the FSDP implementation, its layout, the mesh."""
    g = p.add_argument_group("model and sharding")
    g.add_argument(
        "--model",
        default="llama-tiny",
        help=f"one of {', '.join(TRAIN_MODELS)}, or hf:DIR, a local Hugging Face causal LM "
        "(DIR/config.json, and its *.safetensors weights if any, else a seeded random init; "
        "needs transformers: pip install 'raggedfsdp[hf]')",
    )
    g.add_argument("--backend", default="raggedfsdp", choices=BACKENDS, help="FSDP implementation")
    g.add_argument("--block-rows", default="1", help="rows per block (int or 'whole')")
    g.add_argument(
        "--reshard-after-forward",
        default="auto",
        help="auto (all but the root, FSDP2's default), true, false, or an int that "
        "divides the world size (1-D mesh only)",
    )
    g.add_argument(
        "--max-buffers",
        type=int,
        default=DEFAULT_MAX_BUFFERS,
        help="raggedfsdp: at most K communication buffers per fully_shard group, split where "
        "that saves more padding than a collective costs (fully_shard(max_buffers=))",
    )
    g.add_argument(
        "--member-gaps",
        default="off",
        choices=("off", "on", "always"),
        help="raggedfsdp: padding between the members of a stack of experts, each rank holding "
        "whole experts: on where it lowers the padding, always to exercise the layout "
        "(fully_shard(member_gaps=))",
    )
    g.add_argument(
        "--bf16",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="bf16 parameters, fp32 gradient reduction; --no-bf16: fp32 throughout (default: "
        "bf16 on an accelerator, fp32 on the CPU)",
    )
    g.add_argument(
        "--mesh",
        default=None,
        help="the device mesh, its sizes' product the ranks W (default: a 1-D mesh of all "
        "ranks, plain FSDP). HSDP: replicate=R,shard=S shards every group over the S ranks of "
        "a shard group and all-reduces the shard gradients over the R replicas. FSDP x TP: "
        "tp=T or dp=D,tp=T (D = W / T; leave dp out to imply it) splits attention heads (and "
        "dense feed-forwards) over T ranks that read the same rows, FSDP over the D others; "
        "replicate=R,shard=S,tp=T is HSDP x TP. FSDP x EP (MoE models): ep=E or dp=W,ep=E "
        "splits each MoE layer's experts over E ranks (every rank reads its own rows; dp "
        "counts all W ranks) and shards them over the W / E others. tp with ep, and HSDP "
        "with ep, are not supported yet",
    )


def _add_launch_args(p: argparse.ArgumentParser) -> None:
    """Add "launch": the device, the ranks per machine, the machines, the collective timeout."""
    g = p.add_argument_group("launch")
    g.add_argument(
        "--device",
        default="auto",
        help="auto (the accelerator torch finds, else the CPU), cpu, or an accelerator's "
        "device type (cuda, xpu, ...); one rank per device, with the process-group backend "
        "torch pairs with it",
    )
    g.add_argument("--nproc", type=int, default=4, help="ranks on this machine")
    g.add_argument("--nnodes", default="1", help="machines (torchrun --nnodes)")
    g.add_argument("--node-rank", type=int, default=0, help="this machine's rank")
    g.add_argument("--rdzv-endpoint", default=None, help="host:port of the rendezvous (multi-node)")
    g.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        help="seconds a collective may wait for the other ranks before the job stops with "
        "a message naming it (a stopped or dead rank)",
    )


def _add_optimisation_args(p: argparse.ArgumentParser) -> None:
    """Add "optimisation": the optimizer, its schedule and clip, the steps, batch and seed."""
    g = p.add_argument_group("optimisation")
    g.add_argument("--optim", default="adamw", choices=OPTIMIZERS, help="optimizer")
    g.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    g.add_argument("--weight-decay", type=float, default=0.1, help="decoupled weight decay")
    g.add_argument("--warmup", type=int, default=10, help="linear warm-up steps")
    g.add_argument("--clip", type=float, default=1.0, help="gradient-norm clip (0: off)")
    g.add_argument("--steps", type=int, default=200, help="training steps")
    g.add_argument("--batch-size", type=int, default=16, help="global batch (rows, all ranks)")
    g.add_argument("--seq-len", type=int, default=64, help="tokens per row")
    g.add_argument("--seed", type=int, default=0, help="init and data seed")


def _add_shampoo_args(p: argparse.ArgumentParser) -> None:
    """Add "shampoo": its blocks, preconditioning schedule, grafting and root dtype."""
    g = p.add_argument_group("shampoo (--optim shampoo)")
    g.add_argument("--shampoo-block-size", type=int, default=1024, help="a Shampoo block's columns")
    g.add_argument(
        "--shampoo-row-block",
        type=int,
        default=None,
        help="a Shampoo block's rows (<= --shampoo-block-size); default: square blocks",
    )
    g.add_argument(
        "--precondition-frequency", type=int, default=20, help="steps between root updates"
    )
    g.add_argument(
        "--start-preconditioning-step",
        type=int,
        default=None,
        help="first preconditioned step (before it: the grafted Adam direction); default: "
        "--precondition-frequency",
    )
    g.add_argument(
        "--shampoo-grafting",
        default="block",
        choices=("block", "parameter", "none"),
        help="Adam grafting per block, per matrix (every matrix whole on a rank), or none",
    )
    g.add_argument(
        "--shampoo-root-dtype",
        default="float32",
        choices=("float32", "float64"),
        help="dtype of the inverse roots' eigendecompositions",
    )


def _add_data_args(p: argparse.ArgumentParser) -> None:
    """Add "data": the training text, its tokenizer, how much to read, the validation."""
    g = p.add_argument_group("data")
    g.add_argument(
        "--data",
        default=None,
        help='a text file, a JSON-lines file (*.jsonl, *.json: a "text" field a line), a folder of '
        "both, or a token file (python -m raggedfsdp tokenize); default: the Python standard "
        "library's sources",
    )
    g.add_argument(
        "--tokenizer",
        default=None,
        metavar="DIR",
        help="a folder holding a tokenizer.json (Hugging Face tokenizers; nothing is "
        "downloaded) that turns --data's text into ids; None: byte-level ids 0..255",
    )
    g.add_argument(
        "--max-bytes",
        type=int,
        default=8 << 20,
        help="bytes of text to read (a token file is mapped whole)",
    )
    g.add_argument("--val-every", type=int, default=50, help="validation every K steps (0: off)")
    g.add_argument("--val-batches", type=int, default=4, help="batches per validation")


def _add_output_args(p: argparse.ArgumentParser) -> None:
    """Add "output": the run folder, checkpoints, resuming, the job's length, progress, plot."""
    g = p.add_argument_group("output")
    g.add_argument("--out", default="out/train", help="directory for metrics, plots, checkpoints")
    g.add_argument("--ckpt-every", type=int, default=0, help="checkpoint every K steps (0: off)")
    g.add_argument("--keep-last", type=int, default=2, help="checkpoints to keep")
    g.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in --out from its latest checkpoint (the arguments that "
        "decide its numbers must be the run's; the checkpoint's files are checked before any "
        "rank starts: a damaged one is refused, see --resume-from)",
    )
    g.add_argument(
        "--resume-from",
        default=None,
        action=_ResumeFrom,
        metavar="DIR",
        help="continue the run in --out from this checkpoint of it (a step_XXXXXXXX folder of "
        "--out/ckpt; e.g. when the newest is damaged). Implies --resume. The newer checkpoints "
        "and the metrics of the steps after it are moved to --out/superseded/job_N/",
    )
    g.add_argument(
        "--overwrite",
        action="store_true",
        help="start a new run in an --out that holds something else (deletes another run's "
        "checkpoints and metrics)",
    )
    g.add_argument(
        "--stop-after",
        type=int,
        default=0,
        help="end this job after K steps (0: run to --steps); --resume continues it",
    )
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g.add_argument("--no-plot", action="store_true", help="no loss-curve PNG")


def main(argv: list[str], launch: Callable[[argparse.Namespace], int] | None = None) -> int:
    """Check the arguments, take the run folder, start the ranks; the exit code.

    Args:
        argv: the command line after ``train``.
        launch: starts the ranks for the checked arguments and returns 0 when they all
            succeed. Default: torchrun (``launch``). The test suite passes one that forks
            them from a process that has imported torch already.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    from raggedfsdp.train.devices import resolve_train_device

    try:
        resolve_train_device(args)  # --device auto and the default precision, once
        _, digest = check_args(args)
    except (ValueError, NotImplementedError) as e:
        parser.error(str(e))
    for line in start_notes(args):
        print(f"train: {line}", file=sys.stderr)
    from raggedfsdp.train.rundir import OutLock, check_out, prepare

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lock = OutLock(out)
    if args.node_rank == 0:  # node 0 owns the run folder; see [Note: a run owns its folder]
        try:
            lock.acquire()
            check_out(args, digest)  # again, holding the folder: a job may have ended since
        except ValueError as e:
            lock.release()
            parser.error(str(e))
        prepare(args, digest)
    try:
        return (launch or torchrun_launch)(args)
    finally:
        lock.release()


def torchrun_launch(args) -> int:
    """Start the ranks through torchrun; 0 when they all succeed, else 1 (and say so)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    from raggedfsdp.train.guard import ARGS_ENV, LAUNCHER_PID

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ[ARGS_ENV] = json.dumps(vars(args))  # checked: the ranks read, never parse
    os.environ[LAUNCHER_PID] = str(os.getpid())  # the ranks die with this process
    launch = [f"--nproc-per-node={args.nproc}", f"--nnodes={args.nnodes}"]
    if args.rdzv_endpoint:
        launch += [f"--node-rank={args.node_rank}", f"--rdzv-endpoint={args.rdzv_endpoint}"]
        launch += ["--rdzv-backend=c10d"]
    else:
        launch += ["--standalone"]
    try:
        run(parse_args([*launch, "-m", "raggedfsdp.train.loop"]))
    except ChildFailedError as err:
        from raggedfsdp.train.rundir import checkpoint_state

        rank, failure = first_failure(err.failures)
        others = len(err.failures) - 1
        after = f" ({others} other rank{'s' * (others > 1)} failed with it)" if others else ""
        print(
            f"train: failed: {rank_exit(rank, failure.exitcode)}{after}. {checkpoint_state(args)}",
            file=sys.stderr,
        )
        return 1
    return 0


def first_failure(failures: dict) -> tuple[int, object]:
    """The rank whose failure caused the others, from torchrun's ``{rank: ProcessFailure}``:
    one killed by a signal (it leaves no message), else one that failed on its own, else
    one that lost a peer (``PEER_LOST_EXIT``); the earliest, then the lowest, among equals.
    torchrun's own pick (the earliest timestamp, to the second) names the lowest rank of a
    job whose ranks all ended within a second: most often a rank that only lost its peer.
    A SIGTERM no earlier than another rank's own exit is torchrun's teardown of the ranks
    still running (a stopped or hung one among them), not a cause: it comes last."""
    from raggedfsdp.train.guard import PEER_LOST_EXIT

    def cause(rank: int) -> tuple:
        code, at = failures[rank].exitcode, failures[rank].timestamp
        teardown = code == -signal.SIGTERM and any(
            f.exitcode >= 0 and f.timestamp <= at for r, f in failures.items() if r != rank
        )
        kind = 3 if teardown else 0 if code < 0 else 2 if code == PEER_LOST_EXIT else 1
        return kind, at, rank

    rank = min(failures, key=cause)
    return rank, failures[rank]


# What most often sends a rank each signal: a rank killed by one prints nothing itself.
_SIGNAL_CAUSES = {
    signal.SIGKILL: "most often the kernel's out-of-memory killer; see `dmesg`",
    signal.SIGTERM: "stopped from outside (a job scheduler, kill)",
    signal.SIGINT: "interrupted (Ctrl-C)",
    signal.SIGSEGV: "a crash in native code",
    signal.SIGBUS: "a crash in native code (a file it mapped was truncated?)",
    signal.SIGABRT: "an abort in native code (its message, if any, is above)",
}


def rank_exit(rank: int, code: int) -> str:
    """How ``rank`` ended, from its exit code as torchrun reports it (negative: a signal)."""
    from raggedfsdp.train.guard import PEER_LOST_EXIT

    if code == PEER_LOST_EXIT:
        return (
            f"rank {rank} lost a peer in a collective (a rank stopped or died without a "
            "word; its message is above)"
        )
    if code >= 0:
        return f"rank {rank} exited with code {code} (its message is above)"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = "unknown"
    cause = _SIGNAL_CAUSES.get(-code, "a signal from outside the job")
    return f"rank {rank} was killed by signal {-code} ({name}): {cause}"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
