"""``python -m raggedfsdp export --run RUN --hf OUT``: a trained Hugging Face model as a
directory that ``transformers.AutoModelForCausalLM.from_pretrained(OUT)`` loads.

``RUN`` is the run folder of ``python -m raggedfsdp train --model hf:DIR`` (its ``--out``):
its ``run.json`` names the model (``hf:DIR``) and its ``ckpt/`` holds the checkpoints. The
newest complete one is exported (or the one ``--checkpoint`` names). The model is built on
``meta`` from ``DIR/config.json``, sharded as ``train`` shards it, filled from the
checkpoint (``raggedfsdp.checkpoint.load``: any world size reads it) and written by
``raggedfsdp.checkpoint.export_safetensors`` under the module's own names, which
transformers loads as they are; ``config.json`` (with the exported dtype) and
``generation_config.json`` come from ``DIR``. ``OUT`` appears whole or not at all: the
files are written to a hidden sibling, renamed to ``OUT`` once complete.

The command runs as one process (a one-rank process group of its own), so that process
holds the whole model once; started inside an N-rank job (a process group already made)
it shards the model over those ranks, each holding its part, and rank 0 writes the files.
Every argument is checked before anything is read or written.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

DTYPES = ("float32", "bfloat16", "float16")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m raggedfsdp export",
        description="Export a trained Hugging Face model (a run of train --model hf:DIR) as a "
        "directory that transformers' AutoModelForCausalLM.from_pretrained loads.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--run",
        required=True,
        metavar="RUN",
        help="the run folder of python -m raggedfsdp train (its --out): run.json names the "
        "model, ckpt/ holds the checkpoints",
    )
    p.add_argument(
        "--hf",
        required=True,
        metavar="OUT",
        help="the directory to write (must not exist): config.json, generation_config.json "
        "if DIR has one, and the weights as safetensors files with an index",
    )
    p.add_argument(
        "--checkpoint",
        default=None,
        metavar="DIR",
        help="a step_XXXXXXXX folder of RUN/ckpt to export (default: the newest complete one)",
    )
    p.add_argument(
        "--model",
        default=None,
        metavar="hf:DIR",
        help="the Hugging Face directory the run trained (default: run.json's --model; pass "
        "it when that path was relative to another working directory or has moved)",
    )
    p.add_argument(
        "--dtype", default="float32", choices=DTYPES, help="the dtype of the exported weights"
    )
    return p


def _check(args) -> tuple[str, Path, Path]:
    """``(model, checkpoint, out)``, or a ValueError naming the argument and the fix. The
    checkpoint is ``--checkpoint`` or the run's checkpoint root (its newest is picked and
    held by ``main``, then verified)."""
    from raggedfsdp.checkpoint import latest_checkpoint
    from raggedfsdp.models.hf import check_hf_causal_lm, hf_directory, is_hf_model
    from raggedfsdp.train.outputs import check_not_input
    from raggedfsdp.train.rundir import CKPT, RUN_FILE

    run = Path(args.run)
    try:
        saved = json.loads((run / RUN_FILE).read_text())["args"]
    except (OSError, ValueError, KeyError, TypeError):
        raise ValueError(
            f"export: --run '{run}' holds no readable {RUN_FILE}: it is not the --out of a "
            "python -m raggedfsdp train run; pass that folder"
        ) from None
    model = args.model or saved.get("model", "")
    if not is_hf_model(model):
        raise ValueError(
            f"export: --run '{run}' trained --model {model!r}, not a Hugging Face model "
            "(hf:DIR); --hf exports runs of train --model hf:DIR (its checkpoints load with "
            "raggedfsdp.checkpoint)"
        )
    try:
        check_hf_causal_lm(model, who="export")
    except ImportError as e:
        raise ValueError(str(e)) from None
    except ValueError as e:
        raise ValueError(f"{e} (pass --model hf:DIR where the run's directory is now)") from None
    if args.checkpoint is not None:
        ckpt = Path(args.checkpoint)
    else:
        ckpt = run / CKPT
        if latest_checkpoint(ckpt) is None:
            raise ValueError(
                f"export: '{ckpt}' holds no complete checkpoint; train with --ckpt-every "
                "K (a run saves its last step too), or pass --checkpoint DIR"
            )
    out = Path(args.hf)
    check_not_input(out, [("--run", run), ("--model", hf_directory(model))], who="export",
                    flag="--hf")  # fmt: skip
    _check_out(out)
    return model, ckpt, out


def _check_out(out: Path) -> None:
    if out.exists():
        raise ValueError(f"export: --hf '{out}' exists; pass a new directory")
    parent = out.absolute().parent
    if not parent.is_dir() or not os.access(parent, os.W_OK):
        raise ValueError(
            f"export: --hf '{out}': its parent '{parent}' is not a writable folder; create it "
            "or pass another --hf"
        )


def _verified(ckpt: Path, run: str) -> None:
    from raggedfsdp.checkpoint import verify_checkpoint

    problem = verify_checkpoint(ckpt)
    if problem is not None:
        raise ValueError(
            f"export: the checkpoint '{ckpt}' cannot be read: {problem}; pass another with "
            f"--checkpoint (the complete ones are the step_XXXXXXXX folders of '{run}/ckpt')"
        )


def export_hf(model_source: str, ckpt: Path, out: Path, dtype: str = "float32") -> int:
    """Write ``out`` from checkpoint ``ckpt`` of ``model_source`` (``hf:DIR``); collective
    over the default process group. Returns the checkpoint's step.

    Args:
        model_source: ``hf:DIR``.
        ckpt: a checkpoint directory of the run.
        out: the directory to write; must not exist.
        dtype: ``"float32"``, ``"bfloat16"`` or ``"float16"``. Default ``"float32"``.
    """
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from raggedfsdp import checkpoint
    from raggedfsdp.models.hf import (
        build_hf_model,
        hf_blocks,
        hf_directory,
        materialize_hf,
    )
    from raggedfsdp.models.parallelize import parallelize

    model = build_hf_model(model_source, who="export")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    parallelize(model, mesh, blocks=hf_blocks(model))
    materialize_hf(model, model_source, device="cpu", seed=0, weights="none")
    step, _ = checkpoint.load(ckpt, model)
    torch_dtype = getattr(torch, dtype)
    stage = out.absolute().parent / f".{out.name}.export"
    if dist.get_rank() == 0 and stage.exists():  # a killed export's leftovers
        shutil.rmtree(stage)
    dist.barrier()
    checkpoint.export_safetensors(model, stage, dtype=torch_dtype)
    if dist.get_rank() == 0:
        # the config as DIR has it (not training's: KV cache on), with the weights' dtype
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(str(hf_directory(model_source)), local_files_only=True)
        config.dtype = torch_dtype
        config.save_pretrained(stage)
        generation = hf_directory(model_source) / "generation_config.json"
        if generation.is_file():
            shutil.copy(generation, stage / generation.name)
        os.rename(stage, out)
    dist.barrier()
    return step


def main(argv: list[str]) -> int:
    """Check, hold ``--hf`` and the checkpoint, export; see [Note: a command holds its
    output] in ``raggedfsdp/train/outputs.py``."""
    from raggedfsdp.checkpoint import hold_checkpoint
    from raggedfsdp.train.outputs import OutputLock

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        model, source, out = _check(args)
        with contextlib.ExitStack() as held:
            held.enter_context(OutputLock(out, who="export", flag="--hf"))
            _check_out(out)  # again, holding it: another export may have written it since
            try:  # a save's keep_last does not delete it while we read
                step, ckpt = held.enter_context(hold_checkpoint(source))
            except ValueError as e:
                _verified(source, args.run)  # names what is wrong with it
                raise ValueError(f"export: {e}; pass another --checkpoint") from None
            _verified(ckpt, args.run)
            step = _export(model, ckpt, out, args.dtype)
    except (ValueError, NotImplementedError) as e:
        parser.error(str(e))
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"export: wrote '{out}' from '{ckpt}' (step {step}) of {model}")
    return 0


def _export(model: str, ckpt: Path, out: Path, dtype: str) -> int:
    """``export_hf`` in this process's group, or in a one-rank group of its own. A model
    that does not match the checkpoint is a ValueError naming both."""
    import torch.distributed as dist

    own_group = not dist.is_initialized()
    if own_group:  # one process: a one-rank group on a file in a fresh folder
        rendezvous = tempfile.mkdtemp(prefix="raggedfsdp-export-")
        store = f"file://{rendezvous}/store"
        dist.init_process_group("gloo", init_method=store, rank=0, world_size=1)
    try:
        return export_hf(model, ckpt, out, dtype)
    except ValueError as e:
        raise ValueError(
            f"export: the checkpoint '{ckpt}' does not fit --model {model}: {e}; pass "
            "--model hf:DIR with the directory the run trained"
        ) from None
    finally:
        if own_group:
            dist.destroy_process_group()
            shutil.rmtree(rendezvous, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
