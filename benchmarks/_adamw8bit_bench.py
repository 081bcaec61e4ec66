"""8-bit AdamW: state bytes per parameter and optimizer step time against fp32 AdamW and
the 8-bit peers that run here, and a convergence check; a section of ``optim.py``.

    .venv/bin/python benchmarks/_adamw8bit_bench.py            # prints the markdown section
    .venv/bin/python benchmarks/_adamw8bit_bench.py --quick    # smoke run (not the figures)
    .venv/bin/python benchmarks/_adamw8bit_bench.py --out out/adamw8bit.md

``run(args)`` returns the section; ``benchmarks/optim.py`` imports it and may pass its
own ``argparse.Namespace``: the attributes read are those ``add_arguments`` defines
(``adamw8bit_world``, ``adamw8bit_model``, ``adamw8bit_steps``,
``adamw8bit_conv_model``, ``adamw8bit_conv_steps``, ``adamw8bit_no_torchao``) and
``quick``; a missing one takes its default.

One spawn of ``world`` gloo ranks (1 thread each) measures, on the same model and data:

- **systems**: raggedfsdp ``fully_shard`` + ``raggedfsdp.optim.AdamW8bit`` (with
  ``adamw8bit_block_policy``), raggedfsdp + its flat fp32 ``AdamW``, FSDP2 + torch's
  fp32 ``AdamW``, FSDP2 + torchao's ``AdamW8bit`` (torch.compile on CPU: the first
  step compiles), FSDP2 + bitsandbytes' ``Adam8bit`` (its error is recorded);
- **state bytes per parameter**: every state tensor but ``step`` (tensor subclasses
  counted through their inner tensors), summed over ranks, over all parameters and
  over those of >= 4096 elements (the 8-bit candidates);
- **optimizer step time**: ``opt.step()`` alone between barriers, the slowest rank,
  median over the timed steps (forward and backward run untimed before each);
- **convergence**: raggedfsdp + fp32 ``AdamW`` and + ``AdamW8bit`` trained from the
  same init on the same batches of the demo corpus (``raggedfsdp.train.data``); the
  final loss is the mean training loss of the last 20 steps, and a validation loss
  over 8 fixed batches.
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from _common import (  # beside this script, so on sys.path
    ANALYSIS,
    Setup,
    header,
    optimizer_steps,
    ragged_padding,
    run_ranks,
    state_tensors,
    train_and_validate,
    versions,
    write_results,
)

_DEFAULTS = {
    "adamw8bit_world": 2,
    "adamw8bit_model": "llama-small",
    "adamw8bit_steps": 10,
    "adamw8bit_conv_model": "llama-tiny",
    "adamw8bit_conv_steps": 300,
    "adamw8bit_no_torchao": False,
    "quick": False,
}
LR, WD, BETAS = 3e-3, 0.1, (0.9, 0.999)
BATCH, SEQ = 16, 64
TOL = 0.02  # AdamW8bit's final loss within 2% of fp32 AdamW's


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of this section (prefixed, so ``optim.py`` can add them to its own)."""
    g = parser.add_argument_group("8-bit AdamW")
    g.add_argument("--adamw8bit-world", type=int, default=_DEFAULTS["adamw8bit_world"])
    g.add_argument("--adamw8bit-model", default=_DEFAULTS["adamw8bit_model"])
    g.add_argument("--adamw8bit-steps", type=int, default=_DEFAULTS["adamw8bit_steps"])
    g.add_argument("--adamw8bit-conv-model", default=_DEFAULTS["adamw8bit_conv_model"])
    g.add_argument("--adamw8bit-conv-steps", type=int, default=_DEFAULTS["adamw8bit_conv_steps"])
    g.add_argument(
        "--adamw8bit-no-torchao", action="store_true", help="skip torchao (its compile is slow)"
    )


def _config(args) -> dict:
    cfg = {k: getattr(args, k, v) for k, v in _DEFAULTS.items()}
    if cfg["quick"]:
        cfg.update(adamw8bit_model="llama-tiny", adamw8bit_steps=3, adamw8bit_conv_steps=20)
    return cfg


# ---- one system ----------------------------------------------------------------------------
def _state_bytes(state: dict) -> tuple[int, bool]:
    """(bytes of every state tensor but ``step``, whether any is 8-bit)."""
    tensors = state_tensors(state)
    nbytes = sum(x.numel() * x.element_size() for x in tensors)
    return nbytes, any(x.element_size() == 1 for x in tensors)


def _setup(label: str, path: str, system: str = "raggedfsdp", policy=None, **extra) -> Setup:
    """A setup stepped by the Adam class at ``path`` (imported in the rank, where a missing
    peer fails alone) with this section's hyper-parameters and ``extra``."""

    def optimizers(model) -> list:
        module, name = path.rsplit(".", 1)
        cls = getattr(importlib.import_module(module), name)
        return [cls(model.parameters(), lr=LR, betas=BETAS, weight_decay=WD, **extra)]

    return Setup(label=label, optimizers=optimizers, system=system, block_policy=policy)


def _quantization_blocks(model, world: int):
    from raggedfsdp.optim import adamw8bit_block_policy

    return adamw8bit_block_policy()


OURS = "raggedfsdp + AdamW8bit", "raggedfsdp + AdamW (fp32, flat)"
SETUPS = {  # measured in this order
    "adamw8bit": _setup(OURS[0], "raggedfsdp.optim.AdamW8bit", policy=_quantization_blocks),
    "adamw": _setup(OURS[1], "raggedfsdp.optim.AdamW"),
    "torch_adamw": _setup("FSDP2 + torch AdamW (fp32)", "torch.optim.AdamW", "fsdp2", foreach=True),
    "torchao_adamw8bit": _setup("FSDP2 + torchao AdamW8bit", "torchao.optim.AdamW8bit", "fsdp2"),
    "bnb_adam8bit": _setup("FSDP2 + bitsandbytes Adam8bit", "bitsandbytes.optim.Adam8bit", "fsdp2"),
}
CONVERGENCE = {"adamw": "AdamW (fp32)", "adamw8bit": "AdamW8bit"}  # setup: its table label


def _measure(key: str, cfg, mesh, data) -> dict:
    setup = SETUPS[key]
    model, opts = setup.build(cfg["adamw8bit_model"], mesh, max_seq_len=SEQ)
    (opt,) = opts
    steps = cfg["adamw8bit_steps"] + 1
    times, _ = optimizer_steps(model, opts, data, steps, batch_size=BATCH, seq_len=SEQ)
    totals = torch.zeros(2, dtype=torch.float64)  # state bytes: all, tensors >= 4096
    fp32_big = []  # tensors >= 4096 elements whose states on this rank are not 8-bit
    for name, p in model.named_parameters():
        nbytes, is_8bit = _state_bytes(opt.state[p])
        big = p.numel() >= 4096
        totals += torch.tensor([nbytes, nbytes * big], dtype=torch.float64)
        if big and not is_8bit:
            fp32_big.append(name)
    dist.all_reduce(totals)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, fp32_big)
    numel = sum(p.numel() for p in model.parameters())
    big_numel = sum(p.numel() for p in model.parameters() if p.numel() >= 4096)
    padding = sum(ragged_padding(model).values()) if setup.system == "raggedfsdp" else None
    return {
        "first_step_s": times[0],
        "step_ms": 1e3 * statistics.median(times[1:]),
        "bytes_per_param": totals[0].item() / numel,
        "big_bytes_per_param": totals[1].item() / big_numel,
        "fp32_big_by_rank": gathered,
        "padding": padding,
        "numel": numel,
    }


def _rank_main(rank: int, world: int, save, cfg: dict) -> None:
    from torch.distributed.tensor import init_device_mesh

    from raggedfsdp.train.data import load_corpus

    mesh = init_device_mesh("cpu", (world,))
    corpus = load_corpus()
    results: dict = {"systems": {}, "convergence": {}}
    for key in SETUPS:
        if key == "torchao_adamw8bit" and cfg["adamw8bit_no_torchao"]:
            results["systems"][key] = {"error": "skipped (--adamw8bit-no-torchao)"}
            continue
        try:
            results["systems"][key] = _measure(key, cfg, mesh, corpus.train)
        except Exception as e:  # a peer that fails here fails on every rank alike
            line = next((s for s in str(e).splitlines() if s.strip()), "")
            results["systems"][key] = {"error": f"{type(e).__name__}: {line}"}
            if rank == 0:
                traceback.print_exc(limit=2)
        dist.barrier()
    for key in CONVERGENCE:
        model, opts = SETUPS[key].build(cfg["adamw8bit_conv_model"], mesh, max_seq_len=SEQ)
        steps = cfg["adamw8bit_conv_steps"]
        rows = dict(batch_size=BATCH, seq_len=SEQ)
        results["convergence"][key] = train_and_validate(model, opts, corpus, steps=steps, **rows)
    results["corpus"] = f"{corpus.source} ({corpus.train.numel():,} training bytes)"
    save(results)
    dist.barrier()


# ---- the section ---------------------------------------------------------------------------
TITLE = "## 8-bit AdamW (`raggedfsdp.optim.AdamW8bit`)"


def _format(cfg: dict, res: dict, wall_s: float, command: str) -> str:
    """The section's tables (what they mean is written in the page's analysis)."""
    world, systems = cfg["adamw8bit_world"], res["systems"]
    base = systems.get("adamw", {}).get("step_ms")
    lines = [
        TITLE,
        "",
        f"Command: `{command}`. {world} gloo ranks on CPU, 1 thread each; model "
        f"`{cfg['adamw8bit_model']}`; batch {BATCH} x {SEQ} tokens; lr {LR}, betas {BETAS}, "
        f"weight decay {WD}; {cfg['adamw8bit_steps']} timed steps after the first. "
        f"{versions('torch', 'torchao', 'bitsandbytes')}; {os.cpu_count()} cores; "
        f"{wall_s:.0f} s in all.",
        "",
        "AdamW8bit stores each moment as one uint8 code per element (dynamic-tree map, "
        "as bitsandbytes and torchao) and one fp32 scale per 256-element block counted "
        "from each parameter's start; `adamw8bit_block_policy` makes every RaggedShard "
        "block a whole number of quantization blocks, so ranks quantize alone and the "
        "states are bit-identical to one process (tests/dist/test_adamw8bit.py).",
        "",
        "| system | state B/param, all | state B/param, tensors >= 4096 | optimizer step "
        "(ms, median) | vs raggedfsdp fp32 AdamW | first step (s) | tensors >= 4096 "
        "elements with fp32 states, per rank | padding, elements (% of params) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | --- | ---: |",
    ]
    for key, r in systems.items():
        name = SETUPS[key].label
        if "error" in r:
            lines.append(f"| {name} | {r['error']} | | | | | | |")
            continue
        ratio = f"{r['step_ms'] / base:.2f}x" if base else "-"
        fp32 = ", ".join(str(len(names)) for names in r["fp32_big_by_rank"])
        pad = r["padding"]
        pad = "-" if pad is None else f"{pad:,} ({100 * pad / r['numel']:.2f}%)"
        lines.append(
            f"| {name} | {r['bytes_per_param']:.3f} | {r['big_bytes_per_param']:.3f} | "
            f"{r['step_ms']:.2f} | {ratio} | {r['first_step_s']:.2f} | {fp32} | {pad} |"
        )
    conv = res["convergence"]
    fp32 = conv["adamw"]
    lines += [
        "",
        f"Convergence: `{cfg['adamw8bit_conv_model']}`, {cfg['adamw8bit_conv_steps']} steps on "
        f"the demo corpus ({res['corpus']}), {world} ranks, raggedfsdp `fully_shard`, same "
        f"init and batches. Acceptance: AdamW8bit's final loss within {100 * TOL:.0f}% of "
        "fp32 AdamW's.",
        "",
        "| optimizer | first loss | final loss (mean of last 20) | vs fp32 AdamW "
        "| validation loss (8 batches) | vs fp32 AdamW |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for key, name in CONVERGENCE.items():
        r = conv[key]
        rel, rel_val = (100 * (r[k] - fp32[k]) / fp32[k] for k in ("final", "val"))
        lines.append(
            f"| {name} | {r['losses'][0]:.4f} | {r['final']:.4f} | {rel:+.2f}% | "
            f"{r['val']:.4f} | {rel_val:+.2f}% |"
        )
    return "\n".join([*lines, ""])


def run(args) -> str:
    """Run the measurements in ``adamw8bit_world`` ranks and return the markdown section."""
    cfg = _config(args)
    command = getattr(args, "command", None) or "python " + " ".join(sys.argv)
    start = time.perf_counter()
    res = run_ranks(_rank_main, cfg["adamw8bit_world"], cfg)
    return _format(cfg, res, time.perf_counter() - start, command)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run, not the figures")
    parser.add_argument("--out", help="also write the section to this page (analysis kept)")
    add_arguments(parser)
    args = parser.parse_args()
    start = time.perf_counter()
    section = run(args)
    print(section)
    if args.out:
        command = "python " + " ".join(sys.argv)
        page = header("8-bit AdamW", command, time.perf_counter() - start)
        write_results(args.out, "\n".join([*page, ANALYSIS, "", section]))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    main()
