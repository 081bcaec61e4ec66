"""Looking up a parameter's buffer slice costs O(1): the optimizers do it per parameter
per step, so a buffer of P parameters must cost O(P) lookups' work, not O(P^2)."""

from unittest import mock

from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from raggedfsdp import fully_shard
from raggedfsdp.fsdp import buffer_of, buffers_of
from raggedfsdp.planner import BufferLayout
from raggedfsdp.tools.simulate import fake_world

P = 64  # parameters in one buffer


def test_buffer_of_reads_one_parameter_layout():
    with fake_world(8) as mesh, FakeTensorMode():
        model = nn.Sequential(*(nn.Linear(4, 4, bias=False) for _ in range(P)))
        fully_shard(model, mesh=mesh)
        (view,) = buffers_of(model)
        params = list(model.parameters())
        real = BufferLayout.local_view_args
        with mock.patch.object(BufferLayout, "local_view_args", autospec=True) as spy:
            spy.side_effect = real
            slices = [buffer_of(p)[1] for p in params]
        assert spy.call_count == P  # one per lookup, whatever the buffer's size
        assert [s.fqn for s in slices] == [s.fqn for s in view.params]
        assert [(s.start, s.stop) for s in slices] == [(s.start, s.stop) for s in view.params]
