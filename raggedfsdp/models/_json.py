"""Model shapes from a JSON file, so a user can plan their own model.

Format (``repeat`` and per-param ``stack``/``block_rows`` are optional)::

    {"name": "my-model",
     "groups": [
        {"name": "embed", "kind": "embed",
         "params": [{"name": "embed.weight", "shape": [32000, 4096]}]},
        {"name": "layers", "kind": "moe", "repeat": 32,
         "params": [{"name": "experts.w1", "shape": [8, 14336, 4096], "stack": true},
                    {"name": "norm.weight", "shape": [4096], "block_rows": "whole"}]}]}

A group with ``repeat: n`` becomes groups ``<name>.0 .. <name>.<n-1>`` whose params are
prefixed the same way.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from raggedfsdp.models.catalogue import GroupShapes, ParamShape


def _err(path: str, where: str, msg: str) -> ValueError:
    return ValueError(f"model file {path}: {where}: {msg}")


def _param(path: str, where: str, obj: Any, prefix: str) -> ParamShape:
    if not isinstance(obj, dict) or "name" not in obj or "shape" not in obj:
        raise _err(path, where, f'expected {{"name": ..., "shape": [...]}}, got {obj!r}')
    shape = obj["shape"]
    if not isinstance(shape, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in shape
    ):
        raise _err(path, where, f"shape must be a list of ints >= 1, got {shape!r}")
    block = obj.get("block_rows")
    if (
        block is not None
        and block != "whole"
        and (not isinstance(block, int) or isinstance(block, bool) or block < 1)
    ):
        raise _err(path, where, f"block_rows must be an int >= 1 or 'whole', got {block!r}")
    return ParamShape(
        fqn=prefix + str(obj["name"]),
        shape=tuple(shape),
        stack=bool(obj.get("stack", False)),
        block_rows=block,
    )


def load_model_json(path: str | Path) -> tuple[str, tuple[GroupShapes, ...]]:
    """Read a JSON model file; return ``(model name, groups)``.

    Raises:
        ValueError: the file is missing, not JSON, or not in the format above
            (the message names the file and the offending entry).
    """
    p = str(path)
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ValueError(f"model file {p} does not exist") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"model file {p} is not valid JSON: {e}") from None
    if not isinstance(data, dict) or not isinstance(data.get("groups"), list):
        raise _err(p, "top level", 'expected an object with a "groups" list')
    groups: list[GroupShapes] = []
    for gi, g in enumerate(data["groups"]):
        where = f"groups[{gi}]"
        if not isinstance(g, dict) or not isinstance(g.get("params"), list) or not g["params"]:
            raise _err(p, where, 'expected {"name": ..., "params": [non-empty list]}')
        name = str(g.get("name", f"group{gi}"))
        kind = str(g.get("kind", name))
        repeat = g.get("repeat", None)
        if repeat is not None and (not isinstance(repeat, int) or repeat < 1):
            raise _err(p, where, f"repeat must be an int >= 1, got {repeat!r}")
        copies = (
            [(name, "")]
            if repeat is None
            else [(f"{name}.{i}", f"{name}.{i}.") for i in range(repeat)]
        )
        for gname, prefix in copies:
            params = tuple(
                _param(p, f"{where}.params[{pi}]", obj, prefix)
                for pi, obj in enumerate(g["params"])
            )
            groups.append(GroupShapes(name=gname, kind=kind, params=params))
    if not groups:
        raise _err(p, "groups", "the model has no groups")
    return str(data.get("name", Path(path).stem)), tuple(groups)
