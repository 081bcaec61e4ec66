"""``python -m raggedfsdp walkthrough``: RaggedShard on 4 gloo ranks, step by step.

Launched through ``torch.distributed.run`` (torchrun), so the same worker code runs
on any number of machines. Each step prints what every rank holds.
"""

from __future__ import annotations

import argparse
import os
import sys

WORLD = 4


def _print_rank0(*lines: str) -> None:
    import torch.distributed as dist

    if dist.get_rank() == 0:
        print("\n".join(lines), flush=True)


def _show(title: str, t) -> None:
    """Gather each rank's local rows to rank 0 and print them, one line per rank."""
    import torch.distributed as dist

    rows = t.to_local()[:, 0].tolist()  # local: (rows, 3); column 0 names the row
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, rows)
    lines = [title]
    for rank, r in enumerate(everyone):
        held = " ".join(f"{v:>4g}" for v in r) if r else "(nothing)"
        lines.append(f"  rank {rank}: rows {held}")
    _print_rank0(*lines)


def worker() -> None:
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh

    from raggedfsdp import RaggedShard

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    # A 12 x 3 weight whose row i is filled with i, so each printed number is a row index.
    full = torch.arange(12.0).repeat_interleave(3).view(12, 3)

    _print_rank0(
        "RaggedShard: cut a tensor only between blocks, a different count per rank.",
        "The tensor: 12 rows x 3 columns; row i holds the value i.",
        "",
    )
    rs = RaggedShard(dims=(0,), local_units=(2, 0, 3, 1))  # 6 blocks of 2 rows
    d = distribute_tensor(full, mesh, [rs])
    _show(f"distribute_tensor(..., [{rs}])  # 2-row blocks, rank 1 holds none", d)

    other = RaggedShard(dims=(0,), local_units=(0, 4, 0, 8))  # 12 blocks of 1 row
    _show(f"\nredistribute to {other}  # one all-to-all", d.redistribute(mesh, [other]))
    _show("\nredistribute to Shard(0)  # torch's even split", d.redistribute(mesh, [Shard(0)]))

    full_again = d.redistribute(mesh, [Replicate()]).to_local()
    _print_rank0(
        f"\nredistribute to Replicate() gives back the tensor: {torch.equal(full_again, full)}"
    )

    # torch.optim works on RaggedShard parameters unchanged.
    param = nn.Parameter(d.clone())
    param.grad = distribute_tensor(torch.ones(12, 3), mesh, [rs])
    opt = torch.optim.AdamW([param], lr=0.5, weight_decay=0.0)
    opt.step()
    norm = nn.utils.clip_grad_norm_([param], max_norm=1.0)
    _show("\nafter one torch.optim.AdamW step (lr 0.5): every row moved by -0.5", param.detach())
    _print_rank0(
        f"clip_grad_norm_ over the ragged shards: {norm.full_tensor().item():.4f} "
        f"(the full tensor's: {torch.ones(12, 3).norm().item():.4f})"
    )
    dist.destroy_process_group()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m raggedfsdp walkthrough", description="RaggedShard on 4 gloo ranks."
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker()
        # no interpreter teardown in a rank: see raggedfsdp/train/loop.py
        sys.stdout.flush()
        os._exit(0)
    from torch.distributed.run import main as torchrun

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torchrun(
        [
            "--standalone",
            f"--nproc-per-node={WORLD}",
            "-m",
            "raggedfsdp.cli.walkthrough",
            "--worker",
        ]
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
