"""8-bit AdamW: state bytes per parameter and optimizer step time against fp32 AdamW and
the 8-bit peers that run here, and a convergence check; a section of ``optim.py``.

    .venv/bin/python benchmarks/_adamw8bit_bench.py            # prints the markdown section
    .venv/bin/python benchmarks/_adamw8bit_bench.py --quick    # smoke run (not the figures)
    .venv/bin/python benchmarks/_adamw8bit_bench.py --out benchmarks/results/adamw8bit.md

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
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

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


# ---- what a state costs ------------------------------------------------------------------
def _inner(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors holding ``t``'s data (DTensor and tensor subclasses opened)."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        return _inner(t._local_tensor)
    if type(t) is not torch.Tensor and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return [x for n in names for x in _inner(getattr(t, n))]
    return [t]


def _state_bytes(state: dict) -> tuple[int, bool]:
    """(bytes of every state tensor but ``step``, whether any is 8-bit)."""
    tensors = [x for k, v in state.items() if k != "step" and torch.is_tensor(v) for x in _inner(v)]
    nbytes = sum(x.numel() * x.element_size() for x in tensors)
    return nbytes, any(x.element_size() == 1 for x in tensors)


# ---- one system ----------------------------------------------------------------------------
def _build(system: str, model_name: str, mesh):
    from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

    import raggedfsdp
    from raggedfsdp.models import get_config
    from raggedfsdp.models.transformer import Transformer
    from raggedfsdp.optim import AdamW8bit, adamw8bit_block_policy

    model = Transformer(get_config(model_name), max_seq_len=SEQ, seed=0)
    if system.startswith("raggedfsdp"):
        policy = adamw8bit_block_policy() if "8bit" in system else None
        shard = lambda m: raggedfsdp.fully_shard(m, mesh=mesh, block_policy=policy)
    else:
        shard = lambda m: fsdp2_fully_shard(m, mesh=mesh)
    for block in model.transformer_blocks():
        shard(block)
    shard(model)
    params = model.parameters()
    if system == "raggedfsdp + AdamW8bit":
        opt = AdamW8bit(params, lr=LR, betas=BETAS, weight_decay=WD)
    elif system == "raggedfsdp + AdamW (fp32, flat)":
        opt = raggedfsdp.optim.AdamW(params, lr=LR, betas=BETAS, weight_decay=WD)
    elif system == "FSDP2 + torch AdamW (fp32)":
        opt = torch.optim.AdamW(params, lr=LR, betas=BETAS, weight_decay=WD, foreach=True)
    elif system == "FSDP2 + torchao AdamW8bit":
        from torchao.optim import AdamW8bit as TorchaoAdamW8bit

        opt = TorchaoAdamW8bit(params, lr=LR, betas=BETAS, weight_decay=WD)
    elif system == "FSDP2 + bitsandbytes Adam8bit":
        import bitsandbytes as bnb

        opt = bnb.optim.Adam8bit(params, lr=LR, betas=BETAS, weight_decay=WD)
    else:
        raise AssertionError(system)
    return model, opt


def _batch(data, step, rank, world):
    from raggedfsdp.train.data import get_batch

    return get_batch(
        data, seed=0, step=step, batch_size=BATCH, seq_len=SEQ, rank=rank, world_size=world
    )


def _max_over_ranks(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _measure(system, cfg, mesh, rank, world, data) -> dict:
    from raggedfsdp.fsdp._param_group import owner_of
    from raggedfsdp.models.transformer import lm_loss

    model, opt = _build(system, cfg["adamw8bit_model"], mesh)
    times = []
    for step in range(cfg["adamw8bit_steps"] + 1):
        x, y = _batch(data, step, rank, world)
        lm_loss(model(x), y).backward()
        dist.barrier()
        t0 = time.perf_counter()
        opt.step()
        elapsed = time.perf_counter() - t0
        times.append(_max_over_ranks(elapsed))
        opt.zero_grad()
    totals = torch.zeros(2, dtype=torch.float64)  # state bytes: all, tensors >= 4096
    fp32_big = []  # tensors >= 4096 elements whose states on this rank are not 8-bit
    for name, p in model.named_parameters():
        nbytes, is_8bit = _state_bytes(opt.state[p])
        big = p.numel() >= 4096
        totals += torch.tensor([nbytes, nbytes * big], dtype=torch.float64)
        if big and not is_8bit:
            fp32_big.append(name)
    dist.all_reduce(totals)
    gathered = [None] * world
    dist.all_gather_object(gathered, fp32_big)
    numel = sum(p.numel() for p in model.parameters())
    big_numel = sum(p.numel() for p in model.parameters() if p.numel() >= 4096)
    padding = None
    if system.startswith("raggedfsdp"):
        groups = {id(owner_of(p)[0]): owner_of(p)[0] for p in model.parameters()}
        padding = sum(g.layout.padding for g in groups.values())
    return {
        "first_step_s": times[0],
        "step_ms": 1e3 * statistics.median(times[1:]),
        "bytes_per_param": totals[0].item() / numel,
        "big_bytes_per_param": totals[1].item() / big_numel,
        "fp32_big_by_rank": gathered,
        "padding": padding,
        "numel": numel,
    }


def _converge(optimizer: str, cfg, mesh, rank, world, corpus) -> dict:
    from raggedfsdp.models.transformer import lm_loss

    system = f"raggedfsdp + {optimizer}"
    model, opt = _build(system, cfg["adamw8bit_conv_model"], mesh)
    losses = []
    for step in range(cfg["adamw8bit_conv_steps"]):
        x, y = _batch(corpus.train, step, rank, world)
        loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    with torch.no_grad():
        val = []
        for i in range(8):
            x, y = _batch(corpus.val, 10**6 + i, rank, world)
            total = lm_loss(model(x), y).detach().clone()
            dist.all_reduce(total)
            val.append(total.item() / world)
    tail = losses[-20:]
    return {"losses": losses, "final": sum(tail) / len(tail), "val": sum(val) / len(val)}


SYSTEMS = (
    "raggedfsdp + AdamW8bit",
    "raggedfsdp + AdamW (fp32, flat)",
    "FSDP2 + torch AdamW (fp32)",
    "FSDP2 + torchao AdamW8bit",
    "FSDP2 + bitsandbytes Adam8bit",
)


def _rank_main(rank: int, world: int, cfg: dict, init_file: str, out_file: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    from torch.distributed.tensor import init_device_mesh

    from raggedfsdp.train.data import load_corpus

    mesh = init_device_mesh("cpu", (world,))
    corpus = load_corpus()
    results: dict = {"systems": {}, "convergence": {}}
    for system in SYSTEMS:
        if "torchao" in system and cfg["adamw8bit_no_torchao"]:
            results["systems"][system] = {"error": "skipped (--adamw8bit-no-torchao)"}
            continue
        try:
            results["systems"][system] = _measure(system, cfg, mesh, rank, world, corpus.train)
        except Exception as e:  # a peer that fails here fails on every rank alike
            line = next((s for s in str(e).splitlines() if s.strip()), "")
            results["systems"][system] = {"error": f"{type(e).__name__}: {line}"}
            if rank == 0:
                traceback.print_exc(limit=2)
        dist.barrier()
    for optimizer in ("AdamW (fp32, flat)", "AdamW8bit"):
        results["convergence"][optimizer] = _converge(optimizer, cfg, mesh, rank, world, corpus)
    if rank == 0:
        results["corpus"] = f"{corpus.source} ({corpus.train.numel():,} training bytes)"
        Path(out_file).write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


# ---- the section ---------------------------------------------------------------------------
def _versions() -> str:
    out = [f"torch {torch.__version__}"]
    for name in ("torchao", "bitsandbytes"):
        try:
            module = __import__(name)
            out.append(f"{name} {module.__version__}")
        except Exception as e:  # noqa: BLE001 (record why a peer is missing)
            out.append(f"{name} not importable ({type(e).__name__})")
    return ", ".join(out)


def _format(cfg: dict, res: dict, wall_s: float, command: str) -> str:
    world, systems = cfg["adamw8bit_world"], res["systems"]
    base = systems.get("raggedfsdp + AdamW (fp32, flat)", {}).get("step_ms")
    lines = [
        "## 8-bit AdamW (`raggedfsdp.optim.AdamW8bit`)",
        "",
        f"Command: `{command}`. {world} gloo ranks on CPU, 1 thread each; model "
        f"`{cfg['adamw8bit_model']}`; batch {BATCH} x {SEQ} tokens; lr {LR}, betas {BETAS}, "
        f"weight decay {WD}; {cfg['adamw8bit_steps']} timed steps after the first. "
        f"{_versions()}; {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores; {wall_s:.0f} s in all.",
        "",
        "AdamW8bit stores each moment as one uint8 code per element (dynamic-tree map, "
        "as bitsandbytes and torchao) and one fp32 scale per 256-element block counted "
        "from each parameter's start; `adamw8bit_block_policy` makes every RaggedShard "
        "block a whole number of quantization blocks, so ranks quantize alone and the "
        "states are bit-identical to one process (tests/dist/test_adamw8bit.py).",
        "",
        "| system | state B/param, all | state B/param, tensors >= 4096 | optimizer step "
        "(ms, median) | vs raggedfsdp fp32 AdamW | first step (s) |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, r in systems.items():
        if "error" in r:
            what = "skipped" if r["error"].startswith("skipped") else "fails (below)"
            lines.append(f"| {name} | {what} | | | | |")
            continue
        ratio = f"{r['step_ms'] / base:.2f}x" if base else "-"
        lines.append(
            f"| {name} | {r['bytes_per_param']:.3f} | {r['big_bytes_per_param']:.3f} | "
            f"{r['step_ms']:.2f} | {ratio} | {r['first_step_s']:.2f} |"
        )
    ours = systems.get("raggedfsdp + AdamW8bit", {})
    torchao = systems.get("FSDP2 + torchao AdamW8bit", {})
    lines.append("")
    if "fp32_big_by_rank" in ours:
        fp32 = sorted({n for names in ours["fp32_big_by_rank"] for n in names})
        lines.append(
            f"- raggedfsdp AdamW8bit: tensors of >= 4096 elements with fp32 states on some "
            f"rank: {len(fp32)} (eligibility is decided from the global size). Padding of "
            f"all buffers with the aligned block policy: {ours['padding']:,} elements "
            f"({100 * ours['padding'] / ours['numel']:.2f}% of {ours['numel']:,}); with "
            f"the default policy: "
            f"{systems.get('raggedfsdp + AdamW (fp32, flat)', {}).get('padding', 0):,}."
        )
    if "fp32_big_by_rank" in torchao:
        per_rank = torchao["fp32_big_by_rank"]
        counts = ", ".join(f"rank {r}: {len(n)}" for r, n in enumerate(per_rank))
        example = next((n for names in per_rank for n in names), None)
        lines.append(
            f"- torchao AdamW8bit on FSDP2: tensors of >= 4096 elements left with fp32 "
            f"states ({counts}): torchao decides from the local shard (>= 4096 elements "
            f"and a multiple of its block size), so sharding changes precision "
            f"(pytorch/ao#4912)"
            + (f", e.g. `{example}`." if example else ".")
            + " Its blocks start at each rank's shard, so which elements share a scale "
            "changes with the world size too."
        )
    for name, r in systems.items():
        if "error" in r and not r["error"].startswith("skipped"):
            lines.append(f"- {name} fails at the first step: `{r['error']}`")
    conv = res["convergence"]
    fp32, q8 = conv["AdamW (fp32, flat)"], conv["AdamW8bit"]
    rel = (q8["final"] - fp32["final"]) / fp32["final"]
    rel_val = (q8["val"] - fp32["val"]) / fp32["val"]
    verdict = "PASS" if abs(rel) <= TOL else "FAIL"
    steps = cfg["adamw8bit_conv_steps"]
    lines += [
        "",
        f"Convergence: `{cfg['adamw8bit_conv_model']}`, {steps} steps on the demo corpus "
        f"({res['corpus']}), {world} ranks, raggedfsdp `fully_shard`, same init and batches.",
        "",
        "| optimizer | first loss | final loss (mean of last 20) | validation loss (8 batches) |",
        "| --- | ---: | ---: | ---: |",
        f"| AdamW (fp32) | {fp32['losses'][0]:.4f} | {fp32['final']:.4f} | {fp32['val']:.4f} |",
        f"| AdamW8bit | {q8['losses'][0]:.4f} | {q8['final']:.4f} | {q8['val']:.4f} |",
        "",
        f"AdamW8bit's final loss is {100 * rel:+.2f}% from fp32 AdamW's (validation "
        f"{100 * rel_val:+.2f}%): {verdict} (bound: within {100 * TOL:.0f}%).",
        "",
    ]
    return "\n".join(lines)


def run(args) -> str:
    """Run the measurements in ``adamw8bit_world`` ranks and return the markdown section."""
    cfg = _config(args)
    world = cfg["adamw8bit_world"]
    command = getattr(args, "command", None) or "python " + " ".join(sys.argv)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        init_file, out_file = os.path.join(tmp, "rendezvous"), os.path.join(tmp, "out.json")
        mp.spawn(_rank_main, args=(world, cfg, init_file, out_file), nprocs=world, join=True)
        res = json.loads(Path(out_file).read_text())
    return _format(cfg, res, time.perf_counter() - start, command)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run, not the figures")
    parser.add_argument("--out", help="also write the section to this file")
    add_arguments(parser)
    args = parser.parse_args()
    section = run(args)
    print(section)
    if args.out:
        Path(args.out).write_text(section)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    main()
