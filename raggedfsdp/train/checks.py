"""Every check of ``python -m raggedfsdp train``'s arguments that can run before a rank starts.

An error found inside the ranks costs 10-20 s and prints three tracebacks; found here,
it is one line and nothing is written (``cli.train`` turns the ``ValueError`` into a usage
error). What is checked: the launch (ranks, nodes, rendezvous), each number's range,
the mesh (``parse_train_mesh``: its dims, their product, the model's heads and experts
against them), the data (readable text or a sound token file, its ids within the model's
vocabulary, long enough for a sequence in each split that is used), the block size
against the model's shapes (``policy.check_block_rows``), the memory a step needs
(``resources.check_memory``), the run folder (``rundir.check_out``: ownership,
``--resume``, ``--resume-from``) and what it can hold (``resources.check_storage``:
writable, room for a checkpoint).

The mesh forms ``--mesh`` takes: [Note: mesh specs] in ``raggedfsdp/models/mesh.py``.
"""

from __future__ import annotations

import importlib.util
import math
import re

from raggedfsdp.models.parallelize import MeshSpec, parse_mesh_spec
from raggedfsdp.planner import DEFAULT_MAX_BUFFERS

__all__ = ["MeshSpec", "check_args", "parse_train_mesh", "start_notes"]

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
    _check_shampoo(args)
    if args.backend == "fsdp2":
        if args.optim in ("flat-adamw", "muon", "shampoo", "adamw8bit"):
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


# The Shampoo flags, and the values that leave Shampoo's defaults (getattr: a namespace
# made before they existed has none of them)
_SHAMPOO_FLAGS = {
    "shampoo_block_size": 1024,
    "shampoo_row_block": None,
    "precondition_frequency": 20,
    "start_preconditioning_step": None,
    "shampoo_grafting": "block",
    "shampoo_root_dtype": "float32",
}


def _check_shampoo(args) -> None:
    """The Shampoo flags: in range, and given only with ``--optim shampoo``."""
    for name, default in _SHAMPOO_FLAGS.items():
        value = getattr(args, name, default)
        if value != default and args.optim != "shampoo":
            raise ValueError(
                f"train: {_flag(name)} applies to --optim shampoo only (got --optim "
                f"{args.optim}); drop it or pass --optim shampoo"
            )
    if args.optim != "shampoo":
        return
    _at_least(args, 1, "shampoo_block_size", "precondition_frequency")
    row_block = getattr(args, "shampoo_row_block", None)
    if row_block is not None and not 1 <= row_block <= args.shampoo_block_size:
        raise ValueError(
            "train: --shampoo-row-block must be in [1, --shampoo-block-size "
            f"{args.shampoo_block_size}] (a block is at most that square), got {row_block}"
        )
    if getattr(args, "start_preconditioning_step", None) is not None:
        _at_least(args, 1, "start_preconditioning_step")


def start_notes(args) -> list[str]:
    """What a user should know before the ranks start, though nothing is wrong."""
    notes = []
    if args.optim == "shampoo":
        start = getattr(args, "start_preconditioning_step", None)
        start = start if start is not None else getattr(args, "precondition_frequency", 20)
        if args.steps < start:
            notes.append(
                f"--optim shampoo: the run has {args.steps} steps, fewer than the first "
                f"preconditioned step {start} (--start-preconditioning-step), so Shampoo never "
                "preconditions: every step takes the grafted Adam direction; pass "
                f"--start-preconditioning-step {max(1, args.steps)} or more --steps"
            )
    return notes


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


def _model_vocab(model: str) -> int:
    """The vocabulary of ``--model``: ids at or above it have no embedding row."""
    if model.startswith("hf:"):
        from raggedfsdp.models.hf import hf_config

        return int(hf_config(model, who="train").vocab_size)
    from raggedfsdp.models import get_config

    return get_config(model).vocab_size


def _check_vocab(args, vocab: int, what: str) -> None:
    """Every id the data can hold has a row of ``--model``'s embedding."""
    model_vocab = _model_vocab(args.model)
    if vocab <= model_vocab:
        return
    larger = [m for m in TRAIN_MODELS if _model_vocab(m) >= vocab]
    models = f" ({', '.join(larger)})" if larger else ""
    raise ValueError(
        f"train: {what} has a vocabulary of {vocab} ids, more than the {model_vocab} of "
        f"--model {args.model}'s embedding; pass a model with a vocabulary of at least "
        f"{vocab}{models}, or a tokenizer of at most {model_vocab} ids"
    )


def _check_data(args):
    """The corpus, its ids within the model's vocabulary, with a sequence's worth of ids
    in each split that is used."""
    from pathlib import Path

    from raggedfsdp.train.data import DataConfig, head, is_json, is_pipe, load_corpus
    from raggedfsdp.train.outputs import check_not_input
    from raggedfsdp.train.tokens import is_token_file, load_tokenizer, tokenizer_file

    tokenizer = getattr(args, "tokenizer", None)
    if args.data is not None and is_pipe(args.data):
        raise ValueError(
            f"train: --data '{args.data}' is a pipe (a FIFO, or <(command)), which can be read "
            "once, but the launcher and every rank read --data; write it to a file first, or "
            f"tokenize it once (python -m raggedfsdp tokenize '{args.data}' --out data.tok) and "
            "pass --data data.tok"
        )
    inputs = [("--data", args.data)]
    if tokenizer is not None:
        inputs.append(("--tokenizer", tokenizer_file(tokenizer)))
    check_not_input(args.out, inputs, who="train")
    token_file = args.data is not None and is_token_file(args.data)
    if tokenizer is not None and not token_file:  # before the text is encoded with it
        _check_vocab(args, load_tokenizer(tokenizer).vocab_size, f"--tokenizer '{tokenizer}'")
    corpus = load_corpus(DataConfig(path=args.data, max_bytes=args.max_bytes, tokenizer=tokenizer))
    if token_file:
        _check_vocab(args, corpus.vocab_size, f"the token file --data '{args.data}'")
    elif args.data is not None and Path(args.data).is_file() and not is_json(args.data):
        if b"\0" in head(args.data):  # load_corpus takes any bytes; this is a text demo
            raise ValueError(
                f"train: --data '{args.data}' is not text (it holds NUL bytes: a binary "
                "file?); pass a text file, a folder (whose binary files are skipped), a "
                "JSON-lines file, or a token file written by python -m raggedfsdp tokenize"
            )
    need = args.seq_len + 1
    splits = [("training", corpus.train)] + ([("validation", corpus.val)] if args.val_every else [])
    for name, data in splits:
        if data.numel() < need:
            hint = " or --val-every 0" if name == "validation" else ""
            raise ValueError(
                f"train: the {name} split of '{corpus.source}' has {data.numel()} "
                f"{corpus.unit}, fewer than --seq-len + 1 = {need}; give more text (--data, "
                f"--max-bytes), a smaller --seq-len{hint}"
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
    if mesh.tp > 1 and args.optim == "shampoo":
        raise ValueError(
            "train: --optim shampoo does not compose with tensor parallelism (tp > 1 in "
            "--mesh): a tp cut would cut Shampoo's blocks, which each rank preconditions whole "
            "without communication; pass a mesh without tp, or --optim muon"
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


def _check_hf_config(args):
    """``--model hf:DIR``: a readable ``DIR/config.json`` of a causal LM, transformers
    installed (``raggedfsdp.models.hf``); its config."""
    from raggedfsdp.models.hf import check_hf_causal_lm

    try:
        return check_hf_causal_lm(args.model, who="train")
    except ImportError as e:  # the launcher's errors are usage errors
        raise ValueError(str(e)) from None


def _check_hf_model(args, mesh: MeshSpec, config, data_vocab: int) -> None:
    """What ``--model hf:DIR`` needs of the other arguments and of ``DIR``, on the model
    built on ``meta``: a 1-D or HSDP mesh, an optimizer that needs no block list, the
    data's ids within its vocabulary, ``--seq-len`` within its positions, weights (if any)
    in safetensors files, and ``--block-rows`` against its shapes."""
    from raggedfsdp.models.hf import (
        build_hf_model,
        check_hf_weights,
        hf_directory,
        hf_weight_files,
    )
    from raggedfsdp.train.policy import check_block_rows

    model, directory = args.model, hf_directory(args.model)
    if mesh.tp > 1 or mesh.ep > 1:
        raise NotImplementedError(
            f"train: --mesh {args.mesh} with --model {model}: tensor and expert parallel "
            "split the catalogue models' modules; a Hugging Face model trains on a 1-D mesh "
            "or HSDP (replicate=R,shard=S)"
        )
    if args.optim == "muon":
        raise NotImplementedError(
            f"train: --optim muon with --model {model}: Muon's block policy reads the "
            "catalogue Transformer's blocks; pass --optim adamw, flat-adamw or adamw8bit"
        )
    if data_vocab > config.vocab_size:
        raise ValueError(
            f"train: --model {model} has a vocabulary of {config.vocab_size} ids, fewer than "
            f"the data's {data_vocab} (bytes are 256 ids); set vocab_size >= {data_vocab} in "
            f"{directory / 'config.json'}, or pass a tokenizer whose ids fit (--tokenizer)"
        )
    positions = getattr(config, "max_position_embeddings", None)
    if positions is not None and args.seq_len > positions:
        raise ValueError(
            f"train: --seq-len {args.seq_len} exceeds max_position_embeddings={positions} of "
            f"{directory / 'config.json'}; pass --seq-len <= {positions}"
        )
    if not hf_weight_files(directory) and any(directory.glob("*.bin")):
        raise ValueError(
            f"train: --model {model}: '{directory}' holds PyTorch *.bin weights, which are not "
            "read (each rank reads its rows of safetensors files); convert them "
            "(save_pretrained(safe_serialization=True)) or remove them to start from a "
            "random init"
        )
    meta = build_hf_model(model, config=config)
    check_hf_weights(meta, directory)  # every rank would fail alike: say it once, here
    if args.backend == "raggedfsdp":
        check_block_rows(args, meta, mesh.shard)


def check_args(args) -> tuple[int, str]:
    """Raise ValueError (NotImplementedError: a valid but unsupported mesh) for arguments
    that would fail inside the ranks; read-only.

    Returns:
        ``(start, digest)``: the step the job starts at (0, or the checkpoint's on
        ``--resume``) and the sha256 of the data (``rundir.data_digest``).
    """
    from raggedfsdp.models import CATALOGUE
    from raggedfsdp.models.hf import is_hf_model

    hf = is_hf_model(args.model)
    if hf:
        hf_config = _check_hf_config(args)
    elif args.model not in TRAIN_MODELS:
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
        if not hf:  # a Hugging Face model's mesh: _check_hf_model
            _check_mesh(args, mesh)
    except ValueError as e:
        raise ValueError(f"train: {e}") from None
    except NotImplementedError as e:
        raise NotImplementedError(f"train: {e}") from None
    _check_packages(args)
    from raggedfsdp.train.devices import resolve_device

    resolve_device(getattr(args, "device", "cpu"))  # an absent accelerator: refused here
    corpus = _check_data(args)
    if hf:
        _check_hf_model(args, mesh, hf_config, corpus.vocab_size)
    else:
        _check_model(args, mesh)
    from raggedfsdp.train.resources import check_memory, check_storage
    from raggedfsdp.train.rundir import check_out, data_digest

    check_memory(args, mesh, corpus.train.nbytes + corpus.val.nbytes)
    digest = data_digest(corpus)
    start = check_out(args, digest)
    check_storage(args, mesh)
    return start, digest


def parse_train_mesh(text: str | None, world: int) -> MeshSpec:
    """``--mesh`` as a ``MeshSpec`` (``parse_mesh_spec``)."""
    return parse_mesh_spec(text, world)
