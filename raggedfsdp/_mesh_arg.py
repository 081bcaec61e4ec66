"""``--mesh name=size,...``: the pair syntax that ``plan`` and ``train`` share.

Each command decides which dims it takes and what their sizes must satisfy; this
module only reads the pairs, with the errors both give.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

__all__ = ["parse_mesh_pairs"]


def parse_mesh_pairs(
    text: str, dims: Sequence[str], future: Mapping[str, str], example: str, takes: str
) -> dict[str, int]:
    """The ``name: size`` pairs of ``text`` (comma-separated ``name=size``, any order).

    Args:
        text: the ``--mesh`` value.
        dims: the dim names the command takes.
        future: dims of parallelisms not supported yet, name -> what it is.
        example: a valid ``--mesh`` for the error messages.
        takes: how the command's dims read in a message ("only HSDP meshes are: ...").

    Raises:
        ValueError: a malformed pair, an unknown or repeated name, a size that is not
            an int >= 1.
        NotImplementedError: a dim in ``future``.
    """
    sizes: dict[str, int] = {}
    for pair in text.split(","):
        name, eq, size = (part.strip() for part in pair.partition("="))
        if not eq or not name:
            raise ValueError(
                f"--mesh {text!r}: expected name=size pairs separated by commas, got "
                f"{pair!r}; {example}"
            )
        if name in future:
            raise NotImplementedError(
                f"--mesh {text!r}: the {name!r} dim ({future[name]}) is not supported yet; {takes}"
            )
        if name not in dims:
            raise ValueError(
                f"--mesh {text!r}: unknown dim {name!r}; expected some of {', '.join(dims)}, "
                f"{example}"
            )
        if name in sizes:
            raise ValueError(f"--mesh {text!r}: {name!r} is given twice; give it once")
        if not size.isdigit() or int(size) < 1:
            raise ValueError(
                f"--mesh {text!r}: the size of {name!r} must be an int >= 1, got {size!r}"
            )
        sizes[name] = int(size)
    return sizes
