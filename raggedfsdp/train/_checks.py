"""Every check of ``python -m raggedfsdp train``'s arguments that can run before a rank starts.

An error found inside the ranks costs 10-20 s and prints three tracebacks; found here,
it is one line and nothing is written (``_cli`` turns the ``ValueError`` into a usage
error). What is checked: the launch (ranks, nodes, rendezvous), each number's range,
the data (readable text, long enough for a sequence in each split that is used), the
block size against the model's shapes (``_policy.check_block_rows``) and the run
folder (``_rundir.check_out``: ownership, ``--resume``).
"""

from __future__ import annotations

import importlib.util
import math
import re

__all__ = ["check_args"]

TRAIN_MODELS = ("llama-tiny", "llama-tiny-tied", "llama-small", "moe-tiny", "moe-small")
_ENDPOINT = re.compile(r"^[A-Za-z0-9_.\-\[\]:]+:\d{1,5}$")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _at_least(args, low: int, *names: str) -> None:
    for name in names:
        value = getattr(args, name)
        if value < low:
            raise ValueError(f"train: {_flag(name)} must be >= {low}, got {value}")


def _finite_at_least_zero(args, *names: str) -> None:
    for name in names:
        value = getattr(args, name)
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"train: {_flag(name)} must be a finite number >= 0, got {value}")


def _check_launch(args) -> int:
    """Ranks, nodes and rendezvous; returns the world size."""
    _at_least(args, 1, "nproc")
    nnodes = args.nnodes
    if not (nnodes.isdigit() and int(nnodes) >= 1):
        raise ValueError(
            f"train: --nnodes must be an int >= 1, got {nnodes!r} (elastic ranges such as 1:4 "
            "are not supported: the global batch is split over a fixed world size)"
        )
    nnodes = int(nnodes)
    if not 0 <= args.node_rank < nnodes:
        raise ValueError(
            f"train: --node-rank must be in [0, {nnodes}) for --nnodes {nnodes}, "
            f"got {args.node_rank}"
        )
    if nnodes > 1 and not args.rdzv_endpoint:
        raise ValueError(
            f"train: --nnodes {nnodes} needs --rdzv-endpoint host:port (the same on every "
            "machine: where node 0 listens), else each machine waits for the others forever"
        )
    if args.rdzv_endpoint and not _ENDPOINT.match(args.rdzv_endpoint):
        raise ValueError(f"train: --rdzv-endpoint must be host:port, got {args.rdzv_endpoint!r}")
    return args.nproc * nnodes


def _check_numbers(args, world: int) -> None:
    _at_least(args, 1, "steps", "seq_len", "batch_size", "val_batches", "keep_last")
    _at_least(args, 0, "warmup", "val_every", "ckpt_every", "stop_after")
    _finite_at_least_zero(args, "lr", "weight_decay", "clip")
    if not math.isfinite(args.timeout) or args.timeout <= 0:
        raise ValueError(f"train: --timeout must be a number of seconds > 0, got {args.timeout}")
    if args.batch_size % world:
        raise ValueError(
            f"train: --batch-size {args.batch_size} is not divisible by the world size {world} "
            f"(--nproc {args.nproc} x --nnodes {args.nnodes}); use a multiple of {world}"
        )
    raf = args.reshard_after_forward.lower()
    if raf not in ("auto", "true", "false"):
        if not raf.isdigit() or int(raf) < 1 or world % int(raf):
            raise ValueError(
                "train: --reshard-after-forward must be auto, true, false or a factor of the "
                f"world size {world}, got {args.reshard_after_forward!r}"
            )
    if args.block_rows != "whole" and not (args.block_rows.isdigit() and int(args.block_rows) > 0):
        raise ValueError(
            f"train: --block-rows must be a positive int or 'whole', got {args.block_rows!r}"
        )
    if args.backend == "fsdp2":
        if args.optim in ("flat-adamw", "muon", "adamw8bit"):
            raise ValueError(f"train: --optim {args.optim} runs on the raggedfsdp backend only")
        if args.block_rows != "1":
            raise ValueError(
                "train: --block-rows applies to the raggedfsdp backend only (FSDP2 shards "
                "every parameter on dim 0); drop it or pass --backend raggedfsdp"
            )


def _check_packages(args) -> None:
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


def _check_data(args):
    """The corpus, with a sequence's worth of bytes in each split that is used."""
    from pathlib import Path

    from raggedfsdp.train.data import DataConfig, load_corpus

    corpus = load_corpus(DataConfig(path=args.data, max_bytes=args.max_bytes))
    if args.data is not None and Path(args.data).is_file():
        with open(args.data, "rb") as f:  # load_corpus takes any bytes; this is a text demo
            if b"\0" in f.read(8192):
                raise ValueError(
                    f"train: --data '{args.data}' is not text (it holds NUL bytes: a binary "
                    "file?); pass a text file or a folder (whose binary files are skipped)"
                )
    need = args.seq_len + 1
    splits = [("training", corpus.train)] + ([("validation", corpus.val)] if args.val_every else [])
    for name, data in splits:
        if data.numel() < need:
            hint = " or --val-every 0" if name == "validation" else ""
            raise ValueError(
                f"train: the {name} split of '{corpus.source}' has {data.numel()} bytes, fewer "
                f"than --seq-len + 1 = {need}; give more text (--data, --max-bytes), a "
                f"smaller --seq-len{hint}"
            )
    return corpus


def _check_model(args, world: int) -> None:
    """The block size against the model's shapes, on a model without storage."""
    import torch

    from raggedfsdp.models import get_config
    from raggedfsdp.models.transformer import Transformer
    from raggedfsdp.train._policy import check_block_rows

    if args.backend != "raggedfsdp":
        return
    with torch.device("meta"):
        model = Transformer(get_config(args.model), max_seq_len=args.seq_len, seed=args.seed)
    check_block_rows(args, model, world)


def check_args(args) -> tuple[int, str]:
    """Raise ValueError for arguments that would fail inside the ranks; read-only.

    Returns:
        ``(start, digest)``: the step the job starts at (0, or the checkpoint's on
        ``--resume``) and the sha256 of the data (``_rundir.data_digest``).
    """
    from raggedfsdp.models import CATALOGUE

    if args.model not in TRAIN_MODELS:
        known = ", ".join(TRAIN_MODELS)
        hint = " (a catalogue shape, too big to train here)" if args.model in CATALOGUE else ""
        raise ValueError(f"train: unknown --model {args.model!r}{hint}; choose one of {known}")
    world = _check_launch(args)
    _check_numbers(args, world)
    _check_packages(args)
    corpus = _check_data(args)
    _check_model(args, world)
    from raggedfsdp.train._rundir import check_out, data_digest

    digest = data_digest(corpus)
    return check_out(args, digest), digest
