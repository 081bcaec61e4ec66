"""Does a stack of experts laid out with member gaps cost a copy in the model's own ops?

With ``fully_shard(..., member_gaps=True)`` an unsharded stack ``[E, out, in]`` is an
``as_strided`` view of the flat buffer whose dim-0 stride is larger than ``out * in``
(see [Note: member gaps] in ``raggedfsdp.planner``). Each member stays contiguous. This
script runs the three ways an MoE layer multiplies by its experts, forward and backward,
on such a view and on a contiguous copy of it, and reports for each: the ops that copy
(``aten::copy_`` / ``clone`` / ``contiguous`` seen by the profiler, which sees the calls a
kernel makes through the dispatcher), whether the results are bit-identical, and the
time ratio (median of repeats, same thread count).

    .venv/bin/python benchmarks/strided_experts.py   # writes results/strided_experts.md
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F
from _common import ANALYSIS, RESULTS, header, write_results  # beside this script

OUT = RESULTS / "strided_experts.md"
SHAPES = [(8, 512, 256, 64), (16, 256, 512, 128), (6, 44, 96, 32)]  # E, out, in, gap
TOKENS_PER_EXPERT = 64
REPEATS = 40
COPY_OPS = ("aten::copy_", "aten::clone", "aten::contiguous", "aten::_to_copy")


def gapped_stack(E: int, out: int, inn: int, gap: int, gen) -> torch.Tensor:
    """``[E, out, in]`` as a view of a flat buffer with ``gap`` elements between members."""
    stride = out * inn + gap
    flat = torch.zeros(E * stride, dtype=torch.float32)
    view = flat.as_strided((E, out, inn), (stride, inn, 1))
    view.copy_(torch.randn(E, out, inn, generator=gen))
    return view


def per_member(w, x, counts):  # the model's own GroupedExperts: F.linear per member
    return torch.cat([F.linear(xe, we) for xe, we in zip(torch.split(x, counts), w.unbind(0))])


def bmm(w, x, counts):
    E = w.shape[0]
    return torch.bmm(x.view(E, -1, x.shape[-1]), w.transpose(1, 2)).reshape(-1, w.shape[1])


def grouped_mm(w, x, counts):
    offs = torch.tensor(counts, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)


OPS = {"F.linear per member": per_member, "torch.bmm": bmm, "torch._grouped_mm": grouped_mm}


def run(fn, w, x, counts):
    """Forward and the weight's gradient (``autograd.grad``: no accumulation into a
    ``.grad`` of the stack's layout, which ``fully_shard`` writes itself)."""
    wv = w.detach().requires_grad_(True)  # the same storage and strides
    y = fn(wv, x, counts)
    (grad,) = torch.autograd.grad(y.square().sum(), wv)
    return y.detach(), grad


def copies(fn, w, x, counts) -> list[str]:
    with torch.profiler.profile(record_shapes=True) as prof:
        run(fn, w, x, counts)
    # The stack, one member, or either transposed (sorted dims match): a copy made to lay
    # out the weight another way counts too.
    weights = {tuple(sorted(w.shape)), tuple(sorted(w.shape[1:]))}
    found = []
    for e in prof.events():
        if e.name in COPY_OPS and any(tuple(sorted(s)) in weights for s in e.input_shapes if s):
            found.append(e.name)
    return found


def time_ratio(fn, w, dense, x, counts) -> float:
    """Median time on ``w`` over median time on ``dense``, the two runs alternated (a
    load that drifts during the measurement hits both)."""
    times = {id(w): [], id(dense): []}
    for _ in range(REPEATS):
        for t in (w, dense):
            t0 = time.perf_counter()
            run(fn, t, x, counts)
            times[id(t)].append(time.perf_counter() - t0)
    return statistics.median(times[id(w)]) / statistics.median(times[id(dense)])


def main() -> None:
    start = time.perf_counter()
    gen = torch.Generator().manual_seed(0)
    rows = []
    for E, out, inn, gap in SHAPES:
        w = gapped_stack(E, out, inn, gap, gen)
        dense = w.contiguous()
        counts = [TOKENS_PER_EXPERT] * E
        x = torch.randn(E * TOKENS_PER_EXPERT, inn, generator=gen)
        for name, fn in OPS.items():
            y_g, g_g = run(fn, w, x, counts)
            y_d, g_d = run(fn, dense, x, counts)
            same = torch.equal(y_g, y_d) and torch.equal(g_g, g_d)
            cg, cd = copies(fn, w, x, counts), copies(fn, dense, x, counts)
            run(fn, w, x, counts), run(fn, dense, x, counts)  # warm-up
            ratio = time_ratio(fn, w, dense, x, counts)
            rows.append((f"{E}x{out}x{inn}, gap {gap}", name, cg, cd, same, ratio))
            print(rows[-1], flush=True)
    lines = [
        *header(
            "A stack of experts with member gaps in the model's own ops",
            ".venv/bin/python benchmarks/strided_experts.py",
            time.perf_counter() - start,
            note=f", {torch.get_num_threads()} threads",
        ),
        f"Configuration: fp32, {TOKENS_PER_EXPERT} tokens per expert, forward and backward "
        "(loss = sum of squares), the stack an `as_strided` view of a flat buffer with `gap` "
        "elements between members (what `fully_shard(member_gaps=True)` gathers into) against "
        f"a contiguous copy; time = median of {REPEATS} runs of each, alternated, ratio gapped / "
        "contiguous. "
        "Copies: profiler events of " + ", ".join(f"`{o}`" for o in COPY_OPS) + " taking a "
        "tensor of the stack's or one member's shape, either transposed.",
        "",
        "| stack | op | copies (gapped) | copies (contiguous) | bit-identical | time ratio |",
        "|---|---|---|---|---|---:|",
    ]
    for stack, name, cg, cd, same, ratio in rows:
        lines.append(
            f"| {stack} | {name} | {', '.join(cg) or 'none'} | {', '.join(cd) or 'none'} "
            f"| {'yes' if same else 'no'} | {ratio:.2f} |"
        )
    lines += ["", ANALYSIS, ""]
    write_results(OUT, "\n".join(lines))
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
