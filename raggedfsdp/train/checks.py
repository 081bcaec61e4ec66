"""Every check of ``python -m raggedfsdp train``'s arguments that can run before a rank starts.

An error found inside the ranks costs 10-20 s and prints three tracebacks; found here,
it is one line and nothing is written (``_cli`` turns the ``ValueError`` into a usage
error). What is checked: the launch (ranks, nodes, rendezvous), each number's range,
the mesh (``parse_train_mesh``: its dims, their product, the model's heads and experts
against them), the data (readable text, long enough for a sequence in each split that
is used), the block size against the model's shapes (``_policy.check_block_rows``), the
memory a step needs (``_resources.check_memory``), the run folder (``_rundir.check_out``:
ownership, ``--resume``, ``--resume-from``) and what it can hold (``_resources.check_storage``:
writable, room for a checkpoint).

The mesh forms ``--mesh`` takes: [Note: mesh specs] in ``raggedfsdp/models/parallelize.py``.
"""

from __future__ import annotations

import importlib.util
import math
import re

from raggedfsdp.models.parallelize import MeshSpec, parse_mesh_spec
from raggedfsdp.planner import DEFAULT_MAX_BUFFERS

__all__ = ["MeshSpec", "check_args", "parse_train_mesh"]

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


def _check_numbers(args, world: int, mesh: MeshSpec) -> None:
    _at_least(args, 1, "steps", "seq_len", "batch_size", "val_batches", "keep_last")
    _at_least(args, 0, "warmup", "val_every", "ckpt_every", "stop_after")
    _finite_at_least_zero(args, "lr", "weight_decay", "clip")
    if not math.isfinite(args.timeout) or args.timeout <= 0:
        raise ValueError(f"train: --timeout must be a number of seconds > 0, got {args.timeout}")
    if mesh.tp > 1 and args.batch_size % mesh.data_ranks:
        raise ValueError(
            f"train: --batch-size {args.batch_size} is not divisible by the "
            f"{mesh.data_ranks} data-parallel ranks of --mesh {mesh.text} (tp ranks share "
            f"rows); use a multiple of {mesh.data_ranks}"
        )
    if mesh.tp == 1 and args.batch_size % world:
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
    if args.max_buffers < 1:
        raise ValueError(f"train: --max-buffers must be >= 1, got {args.max_buffers}")
    if args.backend == "fsdp2":
        if args.optim in ("flat-adamw", "muon", "adamw8bit"):
            raise ValueError(f"train: --optim {args.optim} runs on the raggedfsdp backend only")
        for flag, value, default in (
            ("--max-buffers", args.max_buffers, DEFAULT_MAX_BUFFERS),
            ("--member-gaps", args.member_gaps, "off"),
        ):
            if value != default:
                raise ValueError(
                    f"train: {flag} applies to the raggedfsdp backend only (FSDP2 gives each "
                    "parameter its own chunks); drop it or pass --backend raggedfsdp"
                )
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


def _check_mesh(args, mesh: MeshSpec) -> None:
    """What ``--mesh`` needs of the model and the other arguments."""
    from raggedfsdp.models import get_config

    config = get_config(args.model)
    where = f"--mesh {args.mesh}"
    if mesh.dims is not None and args.reshard_after_forward.isdigit():
        raise NotImplementedError(
            f"--reshard-after-forward {args.reshard_after_forward} with {where} is not "
            "supported yet (an int reshards to a smaller group on a 1-D mesh only); pass "
            "auto, true or false"
        )
    if mesh.tp > 1 and args.optim == "adamw8bit":
        # [Note: 8-bit states under TP and EP]: row-wise TP pieces must hold whole blocks
        from raggedfsdp.optim.adamw8bit import DEFAULT_BLOCK_SIZE

        rows = {"attention.wo": config.n_heads * config.head_dim // mesh.tp}
        if any(not config.is_moe_layer(i) for i in range(config.n_layers)):
            rows["feed_forward.w2"] = config.ffn_dim // mesh.tp
        bad = {k: v for k, v in rows.items() if v % DEFAULT_BLOCK_SIZE}
        if bad:
            pieces = ", ".join(f"{k}: {v}" for k, v in bad.items())
            raise ValueError(
                f"{where} with --optim adamw8bit: row-wise tensor parallel leaves each tp rank "
                f"rows of {pieces} elements of {args.model}, not whole quantization blocks of "
                f"{DEFAULT_BLOCK_SIZE} elements, which AdamW8bit keeps whole on every rank; "
                "pass another --optim (adamw, flat-adamw, muon), or a model whose row-wise "
                "pieces hold whole blocks"
            )
    if mesh.tp > 1:
        heads = (config.n_heads, config.n_kv_heads)
        if any(h % mesh.tp for h in heads) or config.attention != "gqa":
            raise ValueError(
                f"{where}: {args.model} has {heads[0]} query and {heads[1]} key/value heads "
                f"({config.attention} attention), which do not split over tp={mesh.tp}; tensor "
                "parallel splits whole heads: pick a tp that divides both, or a model whose "
                "heads it divides (llama-small, moe-small: 6 and 2)"
            )
        if config.ffn_dim % mesh.tp:
            raise ValueError(
                f"{where}: the feed-forward's {config.ffn_dim} hidden rows of {args.model} do "
                f"not split over tp={mesh.tp}; pick a tp that divides them"
            )
    if mesh.ep > 1:
        if not config.n_experts:
            raise ValueError(
                f"{where}: {args.model} is dense (no experts to split over ep); expert "
                "parallel needs an MoE model (moe-tiny, moe-small)"
            )
        if config.n_experts % mesh.ep:
            raise ValueError(
                f"{where}: the {config.n_experts} experts of {args.model} do not split evenly "
                f"over ep={mesh.ep}; pick an ep that divides the expert count"
            )


def _check_model(args, mesh: MeshSpec) -> None:
    """The block size against the model's shapes, on a model without storage."""
    import torch

    from raggedfsdp.models import get_config
    from raggedfsdp.models.transformer import Transformer
    from raggedfsdp.train.policy import check_block_rows

    if args.backend != "raggedfsdp":
        return
    with torch.device("meta"):
        model = Transformer(get_config(args.model), max_seq_len=args.seq_len, seed=args.seed)
    if mesh.tp > 1 and args.block_rows != "1":  # blocks are cut from the TP-local rows
        raise NotImplementedError(
            f"train: --block-rows {args.block_rows} with --mesh {args.mesh} is not supported "
            "yet (blocks of TP-local rows are not checked before the ranks start); pass "
            "--block-rows 1"
        )
    check_block_rows(args, model, mesh.shard)


def check_args(args) -> tuple[int, str]:
    """Raise ValueError (NotImplementedError: a valid but unsupported mesh) for arguments
    that would fail inside the ranks; read-only.

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
    try:
        mesh = parse_train_mesh(args.mesh, world)
    except ValueError as e:
        raise ValueError(f"train: {e}") from None
    except NotImplementedError as e:
        raise NotImplementedError(f"train: {e}") from None
    _check_numbers(args, world, mesh)
    try:
        _check_mesh(args, mesh)
    except ValueError as e:
        raise ValueError(f"train: {e}") from None
    except NotImplementedError as e:
        raise NotImplementedError(f"train: {e}") from None
    _check_packages(args)
    corpus = _check_data(args)
    _check_model(args, mesh)
    from raggedfsdp.train.resources import check_memory, check_storage
    from raggedfsdp.train.rundir import check_out, data_digest

    check_memory(args, mesh, corpus.train.numel() + corpus.val.numel())
    digest = data_digest(corpus)
    start = check_out(args, digest)
    check_storage(args, mesh)
    return start, digest


def parse_train_mesh(text: str | None, world: int) -> MeshSpec:
    """``--mesh`` as a ``MeshSpec`` (``parse_mesh_spec``)."""
    return parse_mesh_spec(text, world)
