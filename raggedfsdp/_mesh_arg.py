"""``--mesh name=size,...``: the pair syntax that ``plan`` and ``train`` share.

Each command decides which dims it takes and what their sizes must satisfy; this
module reads the pairs, with the errors all give, and the HSDP mesh (``replicate`` and
``shard``) that ``plan`` and ``simulate`` take.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

__all__ = ["HSDP_DIMS", "NOT_YET_DIMS", "parse_hsdp_mesh", "parse_mesh_pairs"]

HSDP_DIMS = ("replicate", "shard")
NOT_YET_DIMS = {  # dims of parallelisms an HSDP-only command does not take
    "tp": "tensor parallel",
    "ep": "expert parallel",
    "cp": "context parallel",
    "pp": "pipeline parallel",
}


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


def parse_hsdp_mesh(text: str, example: str, takes: str, if_missing: str) -> tuple[int, int]:
    """``--mesh replicate=R,shard=S`` (both dims, any order) as ``(R, S)``.

    Args:
        text, example, takes: as for ``parse_mesh_pairs``.
        if_missing: what the message for a missing dim adds after the example.

    Raises:
        ValueError: what ``parse_mesh_pairs`` raises, or a missing dim.
        NotImplementedError: a dim in ``NOT_YET_DIMS``.
    """
    sizes = parse_mesh_pairs(text, HSDP_DIMS, NOT_YET_DIMS, example, takes)
    missing = [name for name in HSDP_DIMS if name not in sizes]
    if missing:
        raise ValueError(
            f"--mesh {text!r}: the {missing[0]!r} dim is missing; give both, {example} {if_missing}"
        )
    return sizes["replicate"], sizes["shard"]
