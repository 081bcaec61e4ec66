"""GPT-OSS-120B at 1,024 ranks, 128-row blocks: the smallest block policy change that
brings the whole model's padding under 20%.

With 128-row blocks every group is planned as ``fully_shard`` would (``plan_buffers``,
``max_buffers=4``, the default cost); then one tensor kind at a time gets smaller blocks,
as a ``BlockPolicy(overrides={...})`` would give it.

    .venv/bin/python benchmarks/gpt_oss_policy.py     # seconds

Writes ``benchmarks/results/gpt_oss_policy.md``.
"""

from __future__ import annotations

import sys
import time

from _common import RESULTS, header, write_results  # beside this script
from planner import model_groups

from raggedfsdp.planner import plan_buffers, with_block_rows

MODEL, WORLD, BLOCK_ROWS, GOAL = "gpt-oss-120b", 1024, 128, 0.20
CHANGES = [  # (what, {tensor name suffix: block rows})
    ("none: 128-row blocks everywhere", {}),
    ("`wo` 64-row blocks", {"wo.weight": 64}),
    ("`wo` 32-row blocks", {"wo.weight": 32}),
    ("`wo` 16-row blocks", {"wo.weight": 16}),
    ("`wo` 1-row blocks", {"wo.weight": 1}),
    ("`wo` 64, the experts' `down_proj` 64", {"wo.weight": 64, "down_proj": 64}),
]


def padding(groups, overrides: dict[str, int]) -> tuple[float, int]:
    """The model's padding (fraction of its elements) and buffer count."""
    total = pad = buffers = 0
    for _, _, specs in groups:
        changed = []
        for s in specs:
            rows = next((r for k, r in overrides.items() if s.name.endswith(k)), None)
            changed.append(s if rows is None else with_block_rows(s, rows))
        plan = plan_buffers(changed, WORLD, max_buffers=4)
        total, pad, buffers = (
            total + plan.total_numel,
            pad + plan.padding,
            buffers + len(plan.layouts),
        )
    return pad / total, buffers


def main() -> int:
    t0 = time.perf_counter()
    groups = model_groups(MODEL, BLOCK_ROWS)
    rows = [(what, *padding(groups, ov)) for what, ov in CHANGES]
    lines = header(
        f"{MODEL}: the block policy change that meets <= {GOAL:.0%} padding",
        "python benchmarks/gpt_oss_policy.py",
        time.perf_counter() - t0,
    )
    lines += [
        f"{MODEL}, {WORLD:,} ranks, {BLOCK_ROWS}-row blocks, `plan_buffers(max_buffers=4)` per "
        "group (the default cost); one tensor kind's blocks changed at a time.",
        "",
        "| change | padding | buffers | <= 20% |",
        "|---|---:|---:|---|",
    ]
    lines += [f"| {w} | {p:.3%} | {b} | {'yes' if p <= GOAL else 'no'} |" for w, p, b in rows]
    lines += ["", "## Analysis", ""]
    write_results(RESULTS / "gpt_oss_policy.md", "\n".join(lines) + "\n")
    for w, p, b in rows:
        print(f"{w:45s} {p:8.3%} {b:5d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
