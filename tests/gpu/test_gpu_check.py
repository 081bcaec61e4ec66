"""The accelerator check: the train command on the device with its native backend, parity
with FSDP2, no copies around the collectives, the collectives' streams and their overlap
with compute, and reserved memory against FSDP2's. See ``conftest.py`` for the device (the
accelerator, every visible device one rank; ``--device cpu``: the same on gloo)."""

from __future__ import annotations

import json
import math
from collections import Counter

import pytest
import torch

from tests.gpu.profile_step import PROFILED_STEPS

# fp32 losses of raggedfsdp and FSDP2, same init, batches and ranks: their sums run in
# another order only (the check's requirement, not a derived bound).
LOSS_TOLERANCE = 1e-5
MIB = 1 << 20


@pytest.fixture(scope="module")
def fp32(check) -> dict[str, dict]:
    """The summaries of an fp32 run of each backend on the device."""
    return {
        backend: check.train(f"{backend}-fp32", "--backend", backend, "--no-bf16")
        for backend in ("raggedfsdp", "fsdp2")
    }


def test_train_runs_on_the_device_with_its_native_backend(check, fp32):
    backend = torch.distributed.get_default_backend_for_device(check.device)
    for name, summary in fp32.items():
        assert summary["device"] == check.device, name
        assert summary["process_group_backend"] == backend, name
        assert summary["world"] == check.world, name
        assert summary["losses"] and all(map(math.isfinite, summary["losses"])), name
    check.note("train: device, backend, ranks", f"{check.device}, {backend}, {check.world}")


def test_default_precision_on_an_accelerator_is_bf16(check):
    if not check.accelerated:
        pytest.skip("the CPU's default precision is fp32: the fp32 runs are its default run")
    summary = check.train("raggedfsdp-default")
    args = json.loads((check.out / "raggedfsdp-default" / "args.json").read_text())
    assert args["bf16"] is True and args["device"] == check.device
    assert summary["losses"] and all(map(math.isfinite, summary["losses"]))
    loss = summary["final_loss"]
    check.note("train, default precision (bf16, fp32 reduction): final loss", f"{loss:.4f}")


def test_losses_match_fsdp2_in_fp32(check, fp32):
    ours, theirs = fp32["raggedfsdp"]["losses"], fp32["fsdp2"]["losses"]
    assert len(ours) == len(theirs)
    diff = max(abs(a - b) for a, b in zip(ours, theirs))
    check.note(f"fp32 loss vs FSDP2, max difference over {len(ours)} steps", f"{diff:.2e}")
    assert diff <= LOSS_TOLERANCE, (ours, theirs)


def test_no_copies_around_the_collectives(check, fp32):
    ours, theirs = fp32["raggedfsdp"], fp32["fsdp2"]
    check.note(
        "bytes copied around the collectives per step (raggedfsdp / FSDP2)",
        f"{ours['copied_bytes_fsdp']:,} / {theirs['copied_bytes_fsdp']:,}",
    )
    assert ours["copied_bytes_fsdp"] == 0


def test_max_memory_reserved_against_fsdp2(check, fp32):
    if not check.accelerated:
        pytest.skip("the CPU has no caching allocator: max_memory_reserved is the accelerator's")
    ours = fp32["raggedfsdp"]["max_memory_reserved_bytes_max_rank"]
    theirs = fp32["fsdp2"]["max_memory_reserved_bytes_max_rank"]
    check.note(
        "max_memory_reserved, fp32, largest rank (raggedfsdp / FSDP2)",
        f"{ours / MIB:,.1f} / {theirs / MIB:,.1f} MiB ({ours / theirs:.3f}x)",
    )
    assert ours <= theirs


@pytest.fixture(scope="module")
def traces(check) -> list[dict]:
    """Each rank's profiler trace of ``PROFILED_STEPS`` raggedfsdp steps on the device."""
    out = check.profile()
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(check.world)]


def _kind(name: str) -> str | None:
    """``"all_gather"`` / ``"reduce_scatter"`` for a collective's device kernel."""
    squashed = name.replace("_", "").lower()
    if "allgather" in squashed:
        return "all_gather"
    if "reducescatter" in squashed:
        return "reduce_scatter"
    return None


def _overlaps(a: dict, others: list[dict]) -> bool:
    start, end = a["ts"], a["ts"] + a["dur"]
    return any(o["ts"] < end and start < o["ts"] + o["dur"] for o in others)


def test_collectives_run_on_their_own_streams_and_overlap_compute(check, traces):
    phases = Counter(
        e["name"].split(" ")[0]
        for t in traces
        for e in t["traceEvents"]
        if e.get("name", "").startswith("FSDP::")
    )
    assert phases["FSDP::all_gather"] > 0 and phases["FSDP::post_backward_reduce"] > 0, phases
    if not check.accelerated:
        pytest.skip("the CPU has no streams: gloo runs the collectives on its own threads")
    if check.world < 2:
        pytest.skip("one device: raggedfsdp issues no collective over one rank")
    late = total = 0  # collective kernels: that overlap no compute kernel, all
    for rank, trace in enumerate(traces):
        kernels = [e for e in trace["traceEvents"] if e.get("cat") == "kernel" and "dur" in e]
        comms = [k for k in kernels if _kind(k["name"]) is not None]
        compute = [
            k for k in kernels if "nccl" not in k["name"].lower() and _kind(k["name"]) is None
        ]
        assert comms and compute, f"rank {rank}: no collective or compute kernel in the trace"
        time_on = Counter()
        for k in compute:
            time_on[k["args"]["stream"]] += k["dur"]
        compute_stream = time_on.most_common(1)[0][0]
        streams = {kind: {k["args"]["stream"] for k in comms if _kind(k["name"]) == kind}
                   for kind in ("all_gather", "reduce_scatter")}  # fmt: skip
        assert compute_stream not in streams["all_gather"] | streams["reduce_scatter"], streams
        assert not streams["all_gather"] & streams["reduce_scatter"], streams
        on_compute = [k for k in compute if k["args"]["stream"] == compute_stream]
        late += sum(not _overlaps(k, on_compute) for k in comms)
        total += len(comms)
    # A step's first all-gather (nothing to compute before it) and its last reduce-scatter
    # (nothing after it) have no compute to overlap; every other one must.
    allowed = 2 * PROFILED_STEPS * check.world
    check.note(
        f"collective kernels off the compute stream, overlapping compute ({PROFILED_STEPS} steps)",
        f"all on their own streams; {total - late} of {total} overlap compute",
    )
    assert late <= allowed, (late, allowed)
