"""CopyCounter and CommCounter on single ops: what is counted, the bytes, the storages."""

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp._fully_shard._fsdp_collectives  # noqa: F401  (fsdp.* ops)

from raggedfsdp.tools.profiling import (
    CommCounter,
    CommStats,
    CopyCounter,
    measure_step,
    peak_memory,
    storage_key,
)

F32 = 4


def test_copy_like_ops_are_counted_with_the_bytes_they_write():
    a, b = torch.zeros(10), torch.ones(10)
    with CopyCounter() as c:
        a.copy_(b)
        b.clone()
        torch.cat([a, b])
        a.to(torch.float64)
        torch.split_with_sizes_copy(a, [3, 7])
        torch._foreach_copy_([a[:4], a[4:]], [b[:4], b[4:]])
        torch._chunk_cat([a.view(2, 5), b.view(2, 5)], dim=0, num_chunks=2)
    assert c.summary() == {
        "aten._chunk_cat.default": (1, 20 * F32),
        "aten._foreach_copy_.default": (1, 10 * F32),
        "aten._to_copy.default": (1, 10 * 8),
        "aten.cat.default": (1, 20 * F32),
        "aten.clone.default": (1, 10 * F32),
        "aten.copy_.default": (1, 10 * F32),
        "aten.split_with_sizes_copy.default": (1, 10 * F32),
    }
    assert c.total_bytes() == (20 + 10 + 20 + 20 + 10 + 10 + 10) * F32
    assert all(e.within is None for e in c.events)


def test_views_and_arithmetic_are_not_copies():
    a, b = torch.zeros(10), torch.ones(10)
    with CopyCounter() as c:
        a.view(2, 5), a.narrow(0, 1, 3), a.split([3, 7]), a[2:]
        a + b
        a.add_(b)
        a.to(torch.float32)  # same dtype: no op at all
    assert c.events == []


def test_storages_read_and_written_and_touching():
    x, y, z = torch.zeros(8), torch.ones(8), torch.ones(8)
    with CopyCounter() as c:
        x[2:4].copy_(y[:2])  # views: the keys are the whole storages'
        kept = z.clone()  # alive: a freed storage's key may be reused
    copy, clone = c.events
    assert copy.writes == {storage_key(x)} and copy.reads == {storage_key(y)}
    assert c.touching([x]) == [copy]
    assert c.touching([storage_key(y)]) == [copy]
    assert c.touching([z]) == [clone] and c.touching([kept]) == [clone]
    assert c.touching([torch.zeros(1)]) == []
    c.reset()
    assert c.events == []


def test_storage_key_survives_resize():
    t = torch.zeros(16)
    key = storage_key(t)
    t.untyped_storage().resize_(0)
    assert storage_key(t) == key and t.untyped_storage().data_ptr() == 0
    t.untyped_storage().resize_(16 * F32)
    assert storage_key(t[3:]) == key


def test_fsdp2_custom_ops_count_their_inner_copies():
    shards = [torch.ones(6), torch.ones(2)]  # one rank's copy-in: 8 elements
    with CopyCounter() as c:
        ag_input, ag_output = torch.ops.fsdp.all_gather_copy_in(
            shards, torch.empty(16), [6, 2], 8, 1
        )
        outs = [torch.empty(2, 6), torch.empty(2, 2)]
        torch.ops.fsdp.split_with_sizes_copy(ag_output.view(2, 8), [6, 2], dim=1, out=outs)
        grads = [torch.ones(4, 3), torch.ones(2, 2)]
        torch.ops.fsdp.chunk_cat(grads, 0, 2, out=torch.empty(2, 8))
    assert [(e.op, e.within) for e in c.events] == [
        ("fsdp.all_gather_copy_in.default", None),
        ("aten._foreach_copy_.default", "fsdp.all_gather_copy_in.default"),
        ("fsdp.split_with_sizes_copy.default", None),
        ("aten.split_with_sizes_copy.out", "fsdp.split_with_sizes_copy.default"),
        ("fsdp.chunk_cat.default", None),
        ("aten._chunk_cat.out", "fsdp.chunk_cat.default"),
    ]
    copy_in, inner = c.events[:2]
    assert copy_in.nbytes == inner.nbytes == 8 * F32
    assert copy_in.storages == inner.storages
    assert copy_in.writes == {storage_key(ag_output)}
    assert copy_in.reads == {storage_key(s) for s in shards}
    assert c.total_bytes() == (8 + 16 + 16) * F32  # the inner copies are not counted twice
    assert c.summary(c.top_level()) == {
        "fsdp.all_gather_copy_in.default": (1, 8 * F32),
        "fsdp.chunk_cat.default": (1, 16 * F32),
        "fsdp.split_with_sizes_copy.default": (1, 16 * F32),
    }


def test_without_wrappers_a_custom_op_is_one_opaque_copy():
    out = [torch.empty(2, 6), torch.empty(2, 2)]
    with CopyCounter(wrappers=()) as c:
        torch.ops.fsdp.split_with_sizes_copy(torch.ones(2, 8), [6, 2], dim=1, out=out)
    assert [(e.op, e.nbytes) for e in c.events] == [("fsdp.split_with_sizes_copy.default", 64)]


@pytest.fixture
def fake_pg():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    yield
    dist.destroy_process_group()


def test_comm_counter_kinds_and_bytes(fake_pg):
    full, shard = torch.zeros(16), torch.ones(4)
    with CommCounter() as c:
        dist.all_gather_single(full, shard)
        dist.all_gather_single(full, shard, async_op=True).wait()
        dist.reduce_scatter_single(shard, full)
        dist.all_reduce(shard)
        dist.all_to_all_single(full, full.clone())
        dist.broadcast(shard, 0)
        dist.barrier()
    assert c.summary() == {
        "all_gather": CommStats(2, 2 * 4 * F32, 2 * 16 * F32),
        "all_reduce": CommStats(1, 4 * F32, 4 * F32),
        "all_to_all": CommStats(1, 16 * F32, 16 * F32),
        "barrier": CommStats(1, 0, 0),
        "broadcast": CommStats(1, 4 * F32, 4 * F32),
        "reduce_scatter": CommStats(1, 16 * F32, 4 * F32),
    }
    assert c.events[0].op == "c10d._allgather_base_.default"


def test_comm_counter_sees_functional_collectives(fake_pg):
    import torch.distributed._functional_collectives as funcol

    with CommCounter() as c:
        funcol.wait_tensor(funcol.all_reduce(torch.ones(3), "sum", dist.group.WORLD))
    assert [(e.kind, e.input_bytes, e.output_bytes) for e in c.events] == [
        ("all_reduce", 3 * F32, 3 * F32)
    ]


def test_first_copy_into_a_reduce_scatter_output_is_the_backends(fake_pg):
    # gloo finishes a reduce-scatter with exactly such a copy when the work is waited on;
    # the fake backend makes none, so the test makes it.
    out, full = torch.zeros(4), torch.ones(16)
    with CopyCounter() as c:
        dist.reduce_scatter_single(out, full)
        out.copy_(torch.ones(4))  # as the backend would
        out.copy_(torch.ones(4))  # the caller's own
    assert [e.within for e in c.events] == ["c10d._reduce_scatter_base_.default", None]
    assert c.total_bytes() == 4 * F32


# ---- measure_step, peak_memory ----------------------------------------------------------------
def _linear_step():
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step() -> None:
        model(torch.ones(2, 8)).sum().backward()
        opt.step()
        opt.zero_grad()

    return model, opt, step


def test_peak_memory_counts_what_is_tracked_by_category():
    model, opt, step = _linear_step()
    peak = peak_memory(step, model, opt)
    assert peak["PARAM"] == (8 * 4 + 4) * F32  # the weight and the bias, tracked from the start
    assert peak["Total"] == sum(v for k, v in peak.items() if k != "Total") > peak["PARAM"]


def test_measure_step_without_a_process_group():
    model, _, step = _linear_step()
    out = measure_step(model, step, backend=None)
    assert "copied_bytes_fsdp" not in out  # no FSDP to attribute copies to
    assert not any(k.endswith("_count") for k in out)  # no collective ran
    assert out["copied_bytes_total"] == sum(b for _, b in out["copies_by_op"].values())
    assert out["peak_memory_bytes"] > 0


def test_measure_step_rejects_an_unknown_backend():
    model, _, step = _linear_step()
    with pytest.raises(
        ValueError, match=r"backend must be 'raggedfsdp', 'fsdp2' or None, got 'ddp'"
    ):
        measure_step(model, step, backend="ddp")
