"""``python -m raggedfsdp train``: launch N ranks with torchrun and train a catalogue model.

Arguments are checked here, before any process is spawned (unknown model, a batch
the world size cannot split, unreadable data); the ranks then run
``raggedfsdp.train._loop``. The launcher is ``torch.distributed.run`` itself, so
``--nnodes``/``--node-rank``/``--rdzv-endpoint`` scale the same command to several
machines.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from pathlib import Path

BACKENDS = ("raggedfsdp", "fsdp2")
OPTIMIZERS = ("adamw", "flat-adamw", "muon", "adamw8bit", "sgd")
TRAIN_MODELS = ("llama-tiny", "llama-tiny-tied", "llama-small", "moe-tiny", "moe-small")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m raggedfsdp train",
        description="Train a catalogue model with fully sharded data parallelism on N ranks "
        "(gloo on CPU), launched through torch.distributed.run.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    g = p.add_argument_group("model and sharding")
    g.add_argument("--model", default="llama-tiny", help=f"one of {', '.join(TRAIN_MODELS)}")
    g.add_argument("--backend", default="raggedfsdp", choices=BACKENDS, help="FSDP implementation")
    g.add_argument("--block-rows", default="1", help="rows per block (int or 'whole')")
    g.add_argument(
        "--reshard-after-forward",
        default="auto",
        help="auto (all but the root, FSDP2's default), true, false, or an int that "
        "divides the world size",
    )
    g.add_argument("--bf16", action="store_true", help="bf16 parameters, fp32 gradient reduction")
    g = p.add_argument_group("launch")
    g.add_argument("--nproc", type=int, default=4, help="ranks on this machine")
    g.add_argument("--nnodes", default="1", help="machines (torchrun --nnodes)")
    g.add_argument("--node-rank", type=int, default=0, help="this machine's rank")
    g.add_argument("--rdzv-endpoint", default=None, help="host:port of the rendezvous (multi-node)")
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
    g = p.add_argument_group("data")
    g.add_argument(
        "--data",
        default=None,
        help="a text file or folder; default: the Python standard library's sources",
    )
    g.add_argument("--max-bytes", type=int, default=8 << 20, help="bytes of text to read")
    g.add_argument("--val-every", type=int, default=50, help="validation every K steps (0: off)")
    g.add_argument("--val-batches", type=int, default=4, help="batches per validation")
    g = p.add_argument_group("output")
    g.add_argument("--out", default="out/train", help="directory for metrics, plots, checkpoints")
    g.add_argument("--ckpt-every", type=int, default=0, help="checkpoint every K steps (0: off)")
    g.add_argument("--keep-last", type=int, default=2, help="checkpoints to keep")
    g.add_argument("--resume", action="store_true", help="resume from the latest checkpoint")
    g.add_argument(
        "--stop-after",
        type=int,
        default=0,
        help="end this job after K steps (0: run to --steps); --resume continues it",
    )
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g.add_argument("--no-plot", action="store_true", help="no loss-curve PNG")
    return p


def check_args(args: argparse.Namespace) -> None:
    """Raise ValueError for arguments that would fail inside the ranks."""
    from raggedfsdp.models import CATALOGUE

    if args.model not in TRAIN_MODELS:
        known = ", ".join(TRAIN_MODELS)
        hint = " (a catalogue shape, too big to train here)" if args.model in CATALOGUE else ""
        raise ValueError(f"train: unknown --model {args.model!r}{hint}; choose one of {known}")
    world = args.nproc * int(args.nnodes)
    if args.nproc < 1:
        raise ValueError(f"train: --nproc must be >= 1, got {args.nproc}")
    if args.batch_size % world:
        raise ValueError(
            f"train: --batch-size {args.batch_size} is not divisible by the world size {world} "
            f"(--nproc {args.nproc} x --nnodes {args.nnodes}); use a multiple of {world}"
        )
    raf = args.reshard_after_forward.lower()
    if raf not in ("auto", "true", "false"):
        if not raf.isdigit() or world % int(raf):
            raise ValueError(
                "train: --reshard-after-forward must be auto, true, false or a factor of the "
                f"world size {world}, got {args.reshard_after_forward!r}"
            )
    if args.block_rows != "whole" and not (args.block_rows.isdigit() and int(args.block_rows) > 0):
        raise ValueError(
            f"train: --block-rows must be a positive int or 'whole', got {args.block_rows!r}"
        )
    if args.backend == "fsdp2" and args.optim in ("flat-adamw", "muon", "adamw8bit"):
        raise ValueError(f"train: --optim {args.optim} runs on the raggedfsdp backend only")
    for name in ("steps", "seq_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"train: --{name.replace('_', '-')} must be >= 1")
    for package, option, what in (
        ("tqdm", "--no-progress", "the progress bar"),
        ("matplotlib", "--no-plot", "the loss plot"),
    ):
        wanted = not getattr(args, option[2:].replace("-", "_"))
        if wanted and importlib.util.find_spec(package) is None:
            raise ValueError(
                f"train: {what} needs {package}, which is not installed; install the "
                f"application's extra (pip install 'raggedfsdp[train]') or pass {option}"
            )
    from raggedfsdp.train.data import DataConfig, load_corpus

    load_corpus(DataConfig(path=args.data, max_bytes=args.max_bytes))  # raises on bad data


def main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        check_args(args)
    except ValueError as e:
        parser.error(str(e))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    args_file = Path(args.out) / "args.json"
    args_file.write_text(json.dumps(vars(args), indent=1))
    from torch.distributed.run import main as torchrun

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    launch = [f"--nproc-per-node={args.nproc}", f"--nnodes={args.nnodes}"]
    if args.rdzv_endpoint:
        launch += [f"--node-rank={args.node_rank}", f"--rdzv-endpoint={args.rdzv_endpoint}"]
        launch += ["--rdzv-backend=c10d"]
    else:
        launch += ["--standalone"]
    # The ranks read the checked arguments from args.json (a positional path: nothing
    # for torchrun's own option parser to mistake for one of its options).
    torchrun([*launch, "-m", "raggedfsdp.train._loop", str(args_file)])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
