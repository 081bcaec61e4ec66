"""Which user hooks may read a parameter in backward: see [Note: gradients in place].

A hook that runs after a parameter's gradient is complete (a tensor hook, a
post-accumulate-grad hook, a module backward hook) could read the parameter's value,
which gradients in place have overwritten. ``fully_shard`` assumes any hook may, and
keeps a separate gradient storage for its group, unless the hook is declared not to
read parameters: by ``reads_no_parameters`` (a user's gradient clamp, a logger of
gradient norms), or because it is one of torch's own read-only tools listed here.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import TypeVar

__all__ = ["reads_no_parameters", "may_read_parameters"]

_MARK = "__raggedfsdp_reads_no_parameters__"

# torch's MemTracker installs a tensor hook and a post-accumulate-grad hook on every
# parameter it sees in forward; both only record the gradient's memory.
_TORCH_READ_ONLY = (
    "torch.distributed._tools.mem_tracker.MemTracker._track_module_params_and_buffers.",
)

H = TypeVar("H", bound=Callable)


def reads_no_parameters(hook: H) -> H:
    """Declare that ``hook`` reads no parameter's value (it may read and return
    gradients); returns ``hook``. Register the returned function: gradients stay
    written over the parameters in the hook's group.

    Example::

        w.register_hook(reads_no_parameters(lambda g: g.clamp(-1, 1)))
    """
    try:
        setattr(hook, _MARK, True)
    except AttributeError:  # a bound method or a builtin: mark a wrapper of it
        original = hook

        @functools.wraps(original)
        def hook(*args, **kwargs):
            return original(*args, **kwargs)

        setattr(hook, _MARK, True)
    return hook


def may_read_parameters(hooks: Iterable[Callable]) -> bool:
    """Whether any of ``hooks`` is not declared to read no parameters."""
    return any(not _declared(h) for h in hooks)


def _declared(hook: Callable) -> bool:
    if getattr(hook, _MARK, False):
        return True
    name = f"{getattr(hook, '__module__', '')}.{getattr(hook, '__qualname__', '')}"
    return name.startswith(_TORCH_READ_ONLY)
