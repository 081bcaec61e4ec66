"""Lists that hold their items weakly: the back references of a sharded model.

[Note: freed without the garbage collector]
A sharded model's objects own one another downward only: a module holds its
``FSDPState`` (``module.__dict__``) and its hooks; a state holds its ``GroupSet``; a
group holds its ``DBuffer`` storages, its ``ParamRef`` records and their parameters.
Every reference back up is weak: a sharded parameter to its group (``OWNER_ATTR``), a
``BufferView`` to its group, a record to the modules that hold its parameter, a state
to its modules and to its root, the root's lists of states (which hold the root
itself), the hooks a group or state registers on tensors and modules, and the view of a
state that torch's ``fully_shard.state`` reads. So the
model holds no reference cycle, and its storages go the moment its last reference
does, as a plain module's do: not at the garbage collector's next pass, which a
process that builds models in a loop (or disables the collector) would wait for with
every storage still allocated.
"""

from __future__ import annotations

import weakref
from typing import Any

__all__ = ["WeakList", "WeakPairs", "WeakPartial"]


class WeakList(list):
    """A list that holds each item weakly and reads as the list of its live items."""

    def __init__(self, items=()):
        super().__init__()
        self.extend(items)

    def _hold(self, item) -> Any:
        return weakref.ref(item)

    def _read(self, held) -> Any:
        return held()

    def _live(self) -> list:
        return [x for x in map(self._read, super().__iter__()) if x is not None]

    def append(self, item) -> None:
        super().append(self._hold(item))

    def extend(self, items) -> None:
        for item in list(items):
            self.append(item)

    def __iter__(self):
        return iter(self._live())

    def __getitem__(self, index):
        return self._live()[index]

    def __len__(self) -> int:
        return len(self._live())

    def __contains__(self, item) -> bool:
        return any(x is item for x in self._live())

    def index(self, item, *args) -> int:
        return [id(x) for x in self._live()].index(id(item), *args)

    def __repr__(self) -> str:
        return f"WeakList({self._live()!r})"


class WeakPairs(WeakList):
    """A list of ``(object, name)`` pairs that holds each object weakly."""

    def _hold(self, item) -> Any:
        obj, name = item
        return weakref.ref(obj), name

    def _read(self, held) -> Any:
        obj = held[0]()
        return None if obj is None else (obj, held[1])


class WeakPartial:
    """``method(*args, *more)`` with the method's object and each of ``args`` held weakly:
    a hook that a group registers on a parameter it holds. Once either is gone the call
    does nothing (returns None)."""

    def __init__(self, method, *args):
        self._method = weakref.WeakMethod(method)
        self._args = tuple(weakref.ref(a) for a in args)
        self.__module__, self.__qualname__ = method.__module__, method.__qualname__

    def __call__(self, *more):
        method, args = self._method(), [ref() for ref in self._args]
        if method is None or any(a is None for a in args):
            return None
        return method(*args, *more)
