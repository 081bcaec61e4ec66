"""``python -m raggedfsdp plan``: plan a catalogued (or JSON-described) model's buffers.

Examples::

    python -m raggedfsdp plan --list
    python -m raggedfsdp plan --model deepseek-v3 --world 1024 --block-rows 128
    python -m raggedfsdp plan --model my_model.json --world 64 --json
    python -m raggedfsdp plan --model gpt-oss-120b --world 256 --png layout.png
    python -m raggedfsdp plan --model deepseek-v3 --mesh replicate=8,shard=128 --block-rows 16

[Note: HSDP in the plan]
``--mesh replicate=R,shard=S`` plans as ``fully_shard`` does on a 2-D ``(replicate,
shard)`` mesh (see [Note: HSDP] in ``raggedfsdp/fsdp/_param_group.py``): every buffer
is laid out over the ``S`` ranks of one shard group, so the padding and the peers'
padding are those of ``S`` ranks, and each of the ``R`` replicas holds the same
layout. Bytes are counted per rank per step, as ``raggedfsdp.tools.profiling.CommCounter``
counts them (an all-gather's output, any other collective's input):

    shard_bytes           sum over groups of E_g x the buffer dtype: what a rank holds
                          of the parameters
    all_gather_bytes      sum of S x E_g x the buffer dtype: one all-gather of every
                          group (a forward; a resharded group gathers again in backward)
    reduce_scatter_bytes  sum of S x E_g x the reduce dtype: the gradients reduce-scattered
    hsdp_all_reduce_bytes sum of E_g x the reduce dtype: the reduced shard gradients each
                          rank all-reduces over its R replicas (one all-reduce per group);
                          0 when R = 1. A ring all-reduce sends 2 (R - 1) / R times this
                          from each rank.

``S`` is ranks per shard group; ``E_g`` is group g's planned shard size in elements per
rank (the ``S (elems/rank)`` column; ``kinds.<kind>.shard_sizes`` in ``--json``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from raggedfsdp.models.mesh import parse_hsdp_mesh
from raggedfsdp.planner import (
    DEFAULT_ALIGNMENT_BYTES,
    DEFAULT_MAX_BUFFERS,
    WHOLE,
    PeerPadding,
    clear_plan_cache,
    dtype_name_and_itemsize,
    fsdp1_padding,
    fsdp2_padding,
    plan_buffers,
    split_objective,
    zero3_padding,
)

# Bytes per rank per step, per kind and in total; see [Note: HSDP in the plan].
BYTES = ("shard_bytes", "all_gather_bytes", "reduce_scatter_bytes", "hsdp_all_reduce_bytes")


def _block_rows(text: str) -> int | str:
    if text == WHOLE:
        return WHOLE
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a number of rows or 'whole', got {text!r}"
        ) from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"block rows must be >= 1, got {value}")
    return value


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m raggedfsdp plan",
        description="Plan block-aware FSDP buffers for a model and compare the padding "
        "with FSDP2, FSDP1 and DeepSpeed ZeRO-3 on the same groups.",
    )
    p.add_argument("--list", action="store_true", help="list catalogued models and exit")
    p.add_argument("--model", help="a catalogued model name or a JSON file of shapes")
    p.add_argument(
        "--world",
        type=int,
        default=None,
        help="ranks (default 8; with --mesh, R x S, which --world may repeat)",
    )
    p.add_argument(
        "--mesh",
        help="HSDP: replicate=R,shard=S plans every buffer over the S ranks of a shard "
        "group and reports the padding and bytes at S, plus the bytes each rank "
        "all-reduces over its R replicas per step (the shard gradients of every group; "
        "0 when R = 1). Bytes are per rank per step: an all-gather's output, any other "
        "collective's input, as raggedfsdp.tools.profiling.CommCounter counts them",
    )
    p.add_argument(
        "--block-rows",
        type=_block_rows,
        default=1,
        help="rows per block: a number (clamped to small tensors) or 'whole' (default 1); "
        "a JSON file's per-param block_rows wins",
    )
    p.add_argument("--dtype", default="bfloat16", help="buffer dtype (default bfloat16)")
    p.add_argument(
        "--reduce-dtype",
        default=None,
        help="gradient dtype of the reduce-scatter and the HSDP all-reduce (default: --dtype; "
        "float32 for MixedPrecisionPolicy(reduce_dtype=torch.float32))",
    )
    p.add_argument(
        "--alignment-bytes",
        type=int,
        default=DEFAULT_ALIGNMENT_BYTES,
        help=f"alignment of shard starts and offsets (default {DEFAULT_ALIGNMENT_BYTES})",
    )
    p.add_argument("--member-gaps", action="store_true", help="allow gaps between experts")
    p.add_argument(
        "--max-buffers",
        type=int,
        default=None,
        help="the most buffers a group may be split over, as fully_shard(max_buffers=) "
        f"(default {DEFAULT_MAX_BUFFERS}, fully_shard's; 1 with --exact, which then solves one "
        "buffer per group, and above 1 every split of groups of at most 10 tensors; 1: one "
        "buffer per group); a split is kept only where the padding it saves costs more, on "
        "the wire and at the memory peak, than one more buffer's collectives "
        "(planner.default_alpha_bytes), or where one buffer would hold over twice the "
        "group's elements",
    )
    p.add_argument("--exact", action="store_true", help="solve each distinct group with HiGHS")
    p.add_argument("--time-limit", type=float, default=60.0, help="--exact seconds per group")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--png", help="draw one group's layout to this PNG file")
    p.add_argument("--png-group", help="group to draw (default: the largest)")
    p.add_argument("--png-ranks", type=int, default=32, help="ranks to draw (default 32)")
    return p


def _load(model: str) -> tuple[str, tuple[Any, ...], str]:
    from raggedfsdp.models import CATALOGUE, load_model_json, param_groups

    if model in CATALOGUE:
        return model, param_groups(CATALOGUE[model]), CATALOGUE[model].source
    if model.endswith(".json") or Path(model).is_file():
        name, groups = load_model_json(model)
        return name, groups, model
    raise ValueError(
        f"unknown model {model!r}; catalogued models: {', '.join(CATALOGUE)}; or pass a "
        f"JSON file of shapes (see raggedfsdp/models/_json.py)"
    )


def _list() -> int:
    from raggedfsdp.models import CATALOGUE, num_params

    print(f"{'model':<18} {'params':>10}  source")
    for name, cfg in CATALOGUE.items():
        print(f"{name:<18} {num_params(cfg) / 1e9:>9.2f}B  {cfg.source}")
    return 0


def _mesh_of(args: argparse.Namespace) -> tuple[int, int]:
    """``(R, S)``: replicas and ranks per shard group (``(1, --world)`` without ``--mesh``)."""
    if args.world is not None and args.world < 1:
        raise ValueError(f"--world must be >= 1, got {args.world}")
    if args.mesh is None:
        return 1, 8 if args.world is None else args.world
    return parse_hsdp_mesh(args.mesh, args.world, "plan")


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Plan the model described by ``args``; return the report (the ``--json`` object).

    See [Note: HSDP in the plan] for ``--mesh`` and the byte counts.
    """
    replicate, world = _mesh_of(args)  # buffers are planned over one shard group
    _, itemsize = dtype_name_and_itemsize(args.dtype)
    reduce_dtype, reduce_itemsize = _reduce_dtype_of(args)
    name, groups, source = _load(args.model)
    max_buffers = _max_buffers_of(args)
    specs = {g.name: g.specs(args.block_rows) for g in groups}
    plans, plan_seconds = _plan_cold(groups, specs, world, max_buffers, args)
    buffers = {g.name: plans[g.name].layouts for g in groups}  # --exact improves these
    exact: dict[str, Any] = {}
    if args.exact and max_buffers == 1:
        exact = _exact_single(groups, specs, buffers, world, args)
    elif args.exact:
        exact = _exact_splits(groups, specs, plans, buffers, world, max_buffers, args)
    kinds = _tally_kinds(
        groups, specs, plans, buffers, world, args.dtype, (itemsize, reduce_itemsize), replicate
    )
    report = {
        "model": name,
        "source": source,
        "world_size": replicate * world,
        "mesh": None if args.mesh is None else {"replicate": replicate, "shard": world},
        "shard_group_size": world,
        "replicate_size": replicate,
        "block_rows": args.block_rows,
        "dtype": args.dtype,
        "reduce_dtype": reduce_dtype,
        "alignment_bytes": args.alignment_bytes,
        "member_gaps": bool(args.member_gaps),
        "max_buffers": max_buffers,
        **{k: v for k, v in _summary(_total(kinds), replicate).items() if k != "shard_sizes"},
        "split_blocks": 0,
        "plan_seconds": plan_seconds,
        "distinct_groups": len(
            {tuple((s.shape, s.block_rows, s.stack) for s in v) for v in specs.values()}
        ),
        "kinds": {kind: _summary(k, replicate) for kind, k in kinds.items()},
    }
    if exact:
        report["exact"] = exact
    if args.png:
        report["png"] = _draw_png(args, name, groups, buffers, replicate)
    return report


def _reduce_dtype_of(args: argparse.Namespace) -> tuple[str, int]:
    """The gradients' dtype name and itemsize: ``--reduce-dtype``, else ``--dtype``."""
    reduce_dtype = args.dtype if args.reduce_dtype is None else args.reduce_dtype
    try:
        return dtype_name_and_itemsize(reduce_dtype)
    except ValueError as e:
        raise ValueError(f"--reduce-dtype: {e}") from None


def _max_buffers_of(args: argparse.Namespace) -> int:
    """``--max-buffers``, its default (1 with ``--exact``, else fully_shard's), checked."""
    max_buffers = args.max_buffers
    if max_buffers is None:
        max_buffers = 1 if args.exact else DEFAULT_MAX_BUFFERS
    if max_buffers < 1:
        raise ValueError(f"--max-buffers must be >= 1, got {max_buffers}")
    return max_buffers


def _plan_cold(groups, specs, world: int, max_buffers: int, args) -> tuple[dict, float]:
    """Plan every group from an empty plan cache; the plans and the seconds they took."""
    clear_plan_cache()  # time a cold plan
    t0 = time.perf_counter()
    plans = {
        g.name: plan_buffers(
            specs[g.name],
            world,
            max_buffers=max_buffers,
            dtype=args.dtype,
            alignment_bytes=args.alignment_bytes,
            member_gaps=args.member_gaps,
        )
        for g in groups
    }
    return plans, time.perf_counter() - t0


def _exact_single(groups, specs, buffers, world: int, args) -> dict[str, Any]:
    """``--exact``, one buffer a group: HiGHS on each distinct group, kept where smaller."""
    from raggedfsdp.planner.exact import plan_exact

    seen: dict[tuple, tuple] = {}  # shapes -> (layout, proven, its names)
    exact: dict[str, Any] = {}
    for g in groups:
        key = tuple((s.shape, s.block_rows, s.stack) for s in specs[g.name])
        if key not in seen:
            layout, proven = plan_exact(
                specs[g.name],
                world,
                dtype=args.dtype,
                alignment_bytes=args.alignment_bytes,
                time_limit=args.time_limit,
            )
            seen[key] = (layout, proven, [s.name for s in specs[g.name]])
        layout, proven, names = seen[key]
        exact[g.name] = {"shard_size": layout.shard_size, "proven_optimal": proven}
        if layout.shard_size < buffers[g.name][0].shard_size:
            new_names = [s.name for s in specs[g.name]]
            buffers[g.name] = (layout.renamed(dict(zip(names, new_names, strict=True))),)
    return exact


def _zero_tally() -> dict[str, Any]:
    """An empty tally of one kind of group (or of all): counts, paddings, peers', bytes."""
    return {
        "groups": 0,
        "params": 0,
        "buffers": 0,
        "padding": 0,
        "lower_bound_padding": 0,
        "single_buffer_padding": 0,
        "single_buffer_lower_bound_padding": 0,
        "shard_sizes": set(),
        "fsdp2": PeerPadding(0, 0, 0),
        "fsdp1": PeerPadding(0, 0, 0),
        "zero3": PeerPadding(0, 0, 0),
        **dict.fromkeys(BYTES, 0),
    }


def _tally_kinds(
    groups, specs, plans, buffers, world: int, dtype: str, itemsizes: tuple[int, int], replicate
) -> dict[str, dict[str, Any]]:
    """Each kind's tally: our ``buffers``, the peers' padding, the bytes per rank per step."""
    itemsize, reduce_itemsize = itemsizes
    kinds: dict[str, dict[str, Any]] = defaultdict(_zero_tally)
    for g in groups:
        k = kinds[g.kind]
        k["groups"] += 1
        k["params"] += plans[g.name].total_numel
        k["single_buffer_padding"] += plans[g.name].single.padding
        k["single_buffer_lower_bound_padding"] += plans[g.name].single.lower_bound_padding
        k["fsdp2"] += fsdp2_padding(specs[g.name], world)
        k["fsdp1"] += fsdp1_padding(specs[g.name], world, dtype)
        k["zero3"] += zero3_padding(specs[g.name], world)
        for lay in buffers[g.name]:  # see [Note: multi-buffer groups]
            k["buffers"] += 1
            k["padding"] += lay.padding
            k["lower_bound_padding"] += lay.lower_bound_padding
            k["shard_sizes"].add(lay.shard_size)
            # See [Note: HSDP in the plan]: per rank, per step.
            k["shard_bytes"] += lay.shard_size * itemsize
            k["all_gather_bytes"] += lay.global_size * itemsize
            k["reduce_scatter_bytes"] += lay.global_size * reduce_itemsize
            k["hsdp_all_reduce_bytes"] += lay.shard_size * reduce_itemsize if replicate > 1 else 0
    return kinds


def _total(kinds: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The tally of all kinds together."""
    total = _zero_tally()
    for k in kinds.values():
        for key, value in k.items():
            if key == "shard_sizes":
                total[key] |= value
            else:
                total[key] += value
    return total


def _summary(k: dict[str, Any], replicate: int) -> dict[str, Any]:
    """A tally as the report gives it: counts, paddings and their ratios, peers', bytes."""
    n = k["params"]
    return {
        "groups": k["groups"],
        "params": n,
        "buffers": k["buffers"],
        # an all-gather in forward, one in backward, a reduce-scatter (+ HSDP all-reduce)
        "collectives_per_step": k["buffers"] * (3 + (replicate > 1)),
        "shard_sizes": sorted(k["shard_sizes"]),
        "padding": k["padding"],
        "padding_ratio": k["padding"] / n,
        "lower_bound_padding": k["lower_bound_padding"],
        "lower_bound_padding_ratio": k["lower_bound_padding"] / n,
        "single_buffer_padding_ratio": k["single_buffer_padding"] / n,
        "single_buffer_lower_bound_padding_ratio": k["single_buffer_lower_bound_padding"] / n,
        **{f"{peer}_padding": k[peer].padding for peer in ("fsdp2", "fsdp1", "zero3")},
        **{f"{peer}_padding_ratio": k[peer].padding_ratio for peer in ("fsdp2", "fsdp1", "zero3")},
        **{f"{peer}_split_blocks": k[peer].split_blocks for peer in ("fsdp2", "fsdp1", "zero3")},
        **{key: k[key] for key in BYTES},
    }


def _draw_png(args, name: str, groups, buffers, replicate: int) -> dict[str, str]:
    """Draw ``--png-group``'s (default: the largest) largest buffer; the report's ``png``."""
    from raggedfsdp.cli.draw import draw_layout

    gname = args.png_group or max(groups, key=lambda g: g.numel).name
    if gname not in buffers:
        raise ValueError(
            f"--png-group {gname!r} is not a group of {name}; groups: "
            f"{', '.join(list(buffers)[:6])}, ..."
        )
    drawn = max(buffers[gname], key=lambda lay: lay.total_numel)  # its largest buffer
    which = "" if len(buffers[gname]) == 1 else f" (largest of {len(buffers[gname])} buffers)"
    draw_layout(
        drawn,
        args.png,
        title=f"{name} {gname}{which}: {drawn.describe()}"
        + (f", each of {replicate} replicas" if args.mesh is not None else ""),
        max_ranks=args.png_ranks,
    )
    return {"file": args.png, "group": gname}


def _fmt_elems(n: int) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)


def _fmt_bytes(n: int) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def _print(report: dict[str, Any]) -> None:
    r = report
    where = f"world {r['world_size']}"
    if r["mesh"] is not None:
        where = (
            f"mesh replicate={r['replicate_size']} x shard={r['shard_group_size']} "
            f"({r['world_size']} ranks; buffers planned over the {r['shard_group_size']} "
            "ranks of a shard group)"
        )
    print(
        f"raggedfsdp plan: {r['model']} ({_fmt_elems(r['params'])} params), {where}, "
        f"blocks of {r['block_rows']} rows, {r['dtype']}, alignment {r['alignment_bytes']} B"
        + (", member gaps" if r["member_gaps"] else "")
    )
    head = (
        f"{'kind':<7} {'groups':>6} {'buffers':>7} {'colls':>6} {'params':>9} "
        f"{'S (elems/rank)':>22} {'padding':>9} {'pad %':>8} {'bound %':>8} {'1-buf %':>8} "
        f"{'FSDP2 %':>9} {'FSDP1 %':>8} {'ZeRO3 %':>8}"
    )
    print(head)
    rows = list(r["kinds"].items()) + [("total", r)]
    for kind, k in rows:
        sizes = k.get("shard_sizes")
        s_txt = (
            ""
            if sizes is None
            else (f"{sizes[0]:,}" if len(sizes) == 1 else f"{sizes[0]:,}..{sizes[-1]:,}")
        )
        print(
            f"{kind:<7} {k['groups']:>6} {k['buffers']:>7} {k['collectives_per_step']:>6} "
            f"{_fmt_elems(k['params']):>9} {s_txt:>22} "
            f"{_fmt_elems(k['padding']):>9} {100 * k['padding_ratio']:>8.3f} "
            f"{100 * k['lower_bound_padding_ratio']:>8.3f} "
            f"{100 * k['single_buffer_padding_ratio']:>8.3f} "
            f"{100 * k['fsdp2_padding_ratio']:>9.3f} "
            f"{100 * k['fsdp1_padding_ratio']:>8.3f} {100 * k['zero3_padding_ratio']:>8.3f}"
        )
    print(
        f"blocks split by a shard boundary: raggedfsdp 0, FSDP2 {r['fsdp2_split_blocks']:,}, "
        f"FSDP1 {r['fsdp1_split_blocks']:,}, ZeRO-3 {r['zero3_split_blocks']:,}"
    )
    print(
        f"bytes per rank per step: shard {_fmt_bytes(r['shard_bytes'])} ({r['dtype']}), "
        f"all-gather {_fmt_bytes(r['all_gather_bytes'])} (output, one pass), reduce-scatter "
        f"{_fmt_bytes(r['reduce_scatter_bytes'])} (input, {r['reduce_dtype']})"
    )
    if r["mesh"] is not None:
        print(
            f"HSDP all-reduce over {r['replicate_size']} replicas: "
            f"{_fmt_bytes(r['hsdp_all_reduce_bytes'])} per rank per step (the input: every "
            f"group's reduced shard gradients, {r['reduce_dtype']}; a ring sends 2(R-1)/R of it)"
        )
    print(f"plan time: {r['plan_seconds']:.3f} s ({r['distinct_groups']} distinct groups planned)")
    if "exact" in r:
        proven = sum(v["proven_optimal"] for v in r["exact"].values())
        print(f"exact (HiGHS): {proven}/{len(r['exact'])} groups proven optimal", end="")
        skipped = [n for n, v in r["exact"].items() if v.get("solved") is False]
        if skipped:
            print(
                f"; {len(skipped)} not solved (over 10 tensors: every split of more is too "
                f"many to solve), e.g. {skipped[0]!r}",
                end="",
            )
        print()
    if "png" in r:
        print(f"layout of {r['png']['group']} drawn to {r['png']['file']}")


def _exact_splits(groups, specs, plans, buffers, world, max_buffers, args) -> dict[str, Any]:
    """``--exact`` with ``--max-buffers`` above 1: each distinct group of at most 10
    tensors solved over every split (``plan_buffers_exact``); ``buffers`` takes the
    exact split where it is better by the planner's objective (see [Note: multi-buffer
    groups]). Returns the report's ``exact``."""
    from raggedfsdp.planner.exact import plan_buffers_exact

    seen: dict[tuple, tuple] = {}  # shapes -> (layouts, cost, proven, its names)
    out: dict[str, Any] = {}
    for g in groups:
        mine = specs[g.name]
        if len(mine) > 10:
            out[g.name] = {"solved": False, "tensors": len(mine), "proven_optimal": False}
            continue
        key = tuple((s.shape, s.block_rows, s.stack) for s in mine)
        if key not in seen:
            layouts, cost, proven = plan_buffers_exact(
                mine,
                world,
                max_buffers=max_buffers,
                dtype=args.dtype,
                alignment_bytes=args.alignment_bytes,
                time_limit=args.time_limit,
            )
            seen[key] = (layouts, cost, proven, [s.name for s in mine])
        layouts, cost, proven, names = seen[key]
        out[g.name] = {
            "solved": True,
            "buffers": len(layouts),
            "shard_sizes": [x.shard_size for x in layouts],
            "cost_bytes": cost,
            "planner_cost_bytes": plans[g.name].cost,
            "proven_optimal": proven,
        }
        if split_objective(layouts) < split_objective(buffers[g.name]):
            rename = dict(zip(names, [s.name for s in mine], strict=True))
            buffers[g.name] = tuple(x.renamed(rename) for x in layouts)
    return out


def main(argv: list[str]) -> int:
    """Entry point of ``python -m raggedfsdp plan``; returns the exit status."""
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse reports and exits; hand back its status
        return int(e.code or 0)
    if args.list:
        return _list()
    if not args.model:
        parser.print_usage(sys.stderr)
        print("raggedfsdp plan: error: --model is required (or --list)", file=sys.stderr)
        return 2
    try:
        report = run(args)
    except (ValueError, NotImplementedError) as e:
        print(f"raggedfsdp plan: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True))
    else:
        _print(report)
    return 0
