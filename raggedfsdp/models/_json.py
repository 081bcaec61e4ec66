"""Models from a JSON file, so a user can plan and simulate their own model.

Two formats. A **config file** holds a ``TransformerConfig``'s fields (the catalogue's;
``name`` defaults to the file's stem, ``source`` to its path): a model that
``raggedfsdp.models.Transformer`` builds, so ``python -m raggedfsdp simulate`` can step
it and ``plan`` can plan it (``load_config_json``)::

    {"name": "my-gpt", "vocab_size": 32000, "dim": 64, "n_layers": 2, "n_heads": 2,
     "n_kv_heads": 2, "ffn_dim": 256, "norm": "layer", "ffn": "gelu", "qkv_bias": true,
     "o_bias": true, "ffn_bias": true, "output_bias": true}

A **shapes file** lists parameters by group, for the planner only (``load_model_json``
reads both). Format (``repeat`` and per-param ``stack``/``block_rows`` are optional)::

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

import dataclasses
import difflib
import json
import typing
from pathlib import Path
from typing import Any

from raggedfsdp.models.catalogue import GroupShapes, ParamShape, TransformerConfig, param_groups

# Config fields that must be given, and those that count something (>= 1 where given).
_REQUIRED = ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads")
_POSITIVE = (*_REQUIRED, "head_dim", "top_k")


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


def _read(path: str | Path) -> Any:
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ValueError(f"model file {path} does not exist") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"model file {path} is not valid JSON: {e}") from None


def _is_config(data: Any) -> bool:
    return isinstance(data, dict) and "groups" not in data and any(k in data for k in _REQUIRED)


def _check_field(p: str, name: str, value: Any, kind: Any) -> None:
    """Raise naming field ``name`` if ``value`` is not of the annotated ``kind``."""
    options = typing.get_args(kind)
    if typing.get_origin(kind) is typing.Literal:
        if value not in options:
            raise _err(p, name, f"must be one of {list(options)}, got {value!r}")
        return
    if type(None) in options:  # ``int | None``
        if value is None:
            return
        kind = next(t for t in options if t is not type(None))
    ok = isinstance(value, kind) and (kind is bool or not isinstance(value, bool))
    if not ok:
        raise _err(p, name, f"must be a JSON {kind.__name__}, got {value!r}")
    if kind is int and value < (1 if name in _POSITIVE else 0):
        least = 1 if name in _POSITIVE else 0
        raise _err(p, name, f"must be >= {least}, got {value}")


def config_from_dict(data: Any, path: str = "<dict>") -> TransformerConfig:
    """A ``TransformerConfig`` from a config file's object (``path``: for messages).

    Raises:
        ValueError: not an object, an unknown or missing field, a value of the wrong type
            or range, or an inconsistent config (the message names the field and the fix).
    """
    if not isinstance(data, dict):
        raise _err(
            path, "top level", f"expected an object of TransformerConfig fields, got {data!r}"
        )
    hints = typing.get_type_hints(TransformerConfig)
    fields = [f.name for f in dataclasses.fields(TransformerConfig)]
    for name in data:
        if name not in fields:
            close = difflib.get_close_matches(name, fields, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise _err(
                path, name, f"not a TransformerConfig field; {hint}fields: {', '.join(fields)}"
            )
    missing = [name for name in _REQUIRED if name not in data]
    if missing:
        raise _err(path, missing[0], f"missing; a config needs {', '.join(_REQUIRED)} (add them)")
    for name, value in data.items():
        _check_field(path, name, value, hints[name])
    values = {"name": Path(path).stem, "source": f"model file {path}"} | data
    try:
        return TransformerConfig(**values)
    except ValueError as e:
        raise _err(path, "config", str(e)) from None


def load_config_json(path: str | Path) -> TransformerConfig:
    """Read a JSON config file (``TransformerConfig``'s fields); return the config.

    Raises:
        ValueError: the file is missing, not JSON, or not a valid config (the message
            names the file, the field and the fix). A shapes file says so.
    """
    data = _read(path)
    if isinstance(data, dict) and "groups" in data:
        raise _err(
            str(path),
            "top level",
            'a shapes file ("groups"), which only the planner reads; a model to build '
            f"needs TransformerConfig fields ({', '.join(_REQUIRED)}, ...) instead",
        )
    return config_from_dict(data, str(path))


def load_model_json(path: str | Path) -> tuple[str, tuple[GroupShapes, ...]]:
    """Read a JSON model file (either format); return ``(model name, groups)``.

    Raises:
        ValueError: the file is missing, not JSON, or not in a format above
            (the message names the file and the offending entry).
    """
    p = str(path)
    data = _read(path)
    if _is_config(data):
        config = config_from_dict(data, p)
        return config.name, param_groups(config)
    if not isinstance(data, dict) or not isinstance(data.get("groups"), list):
        raise _err(
            p,
            "top level",
            'expected an object with a "groups" list (a shapes file), or TransformerConfig '
            f"fields ({', '.join(_REQUIRED)}, ...; a config file)",
        )
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
