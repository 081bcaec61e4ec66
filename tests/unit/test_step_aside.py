"""A custom DTensor handler that hands a plain op back to torch runs torch's own path
without taking itself out of torch's global handler table: another thread (the async
checkpoint's runs beside training) never finds it missing."""

import sys
import threading

import torch
from torch.distributed.tensor import DTensor, Replicate
from torch.utils._pytree import tree_map

import raggedfsdp.tensor.placement  # noqa: F401  (installs the DTensor handlers)
from raggedfsdp.tools.simulate import fake_world

OPS = (torch.ops.aten.linalg_vector_norm.default, torch.ops.aten.amax.default)


def _handlers():
    return DTensor._op_dispatcher._custom_op_handlers


def test_handlers_are_back_after_threads_hand_ops_to_torch():
    with fake_world(4) as mesh:
        before = {op: _handlers()[op] for op in OPS}
        x = DTensor.from_local(torch.arange(8.0).reshape(2, 4), mesh, [Replicate()])
        want = (torch.linalg.vector_norm(x).full_tensor(), x.amax().full_tensor())
        errors, results = [], []

        def work():
            try:
                for _ in range(50):
                    got = (torch.linalg.vector_norm(x).full_tensor(), x.amax().full_tensor())
                    results.append(all(torch.equal(a, b) for a, b in zip(got, want)))
            except Exception as e:  # report, do not hang the test
                errors.append(e)

        threads = [threading.Thread(target=work) for _ in range(4)]
        interval = sys.getswitchinterval()
        sys.setswitchinterval(1e-6)  # switch threads often: inside the stepping aside too
        try:
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        finally:
            sys.setswitchinterval(interval)
        assert errors == [] and len(results) == 200 and all(results)
        assert {op: _handlers().get(op) for op in OPS} == before


class _Watch(torch.Tensor):
    """A local tensor that records, at each op on it, whether the handlers are installed."""

    seen: list[bool] = []

    @staticmethod
    def __new__(cls, data):
        t = torch.Tensor._make_wrapper_subclass(cls, data.shape, dtype=data.dtype)
        t.data_ = data
        return t

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func in OPS:
            cls.seen.append(func in _handlers())
        out = func(*tree_map(lambda a: a.data_ if isinstance(a, _Watch) else a, args),
                   **(kwargs or {}))  # fmt: skip
        return _Watch(out) if func is torch.ops.aten.view.default else out


def test_the_handler_stays_in_the_table_while_torch_runs_the_op():
    with fake_world(4) as mesh:
        x = DTensor.from_local(_Watch(torch.arange(8.0)), mesh, [Replicate()])
        _Watch.seen.clear()
        torch.linalg.vector_norm(x)
        x.amax()
        assert _Watch.seen == [True, True]
