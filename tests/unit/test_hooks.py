"""``reads_no_parameters``: which user hooks keep gradients written over parameters."""

from __future__ import annotations

from raggedfsdp.fsdp import reads_no_parameters


def test_declared_hooks_are_recognised_whatever_their_kind():
    class Clamp:
        def hook(self, grad):
            return grad * 2

    plain = lambda g: g  # noqa: E731
    marked = reads_no_parameters(lambda g: g + 1)
    bound = reads_no_parameters(Clamp().hook)  # a bound method takes no attribute: wrapped
    assert marked(1) == 2 and bound(3) == 6
    assert getattr(marked, "__raggedfsdp_reads_no_parameters__", False)
    assert getattr(bound, "__raggedfsdp_reads_no_parameters__", False)
    assert not getattr(plain, "__raggedfsdp_reads_no_parameters__", False)
