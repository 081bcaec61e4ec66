"""Print the method table of ``docs/fully_shard.md`` from ``raggedfsdp.fsdp.FSDP2_SURFACE``.

    python docs/gen_fsdp2_table.py

Paste the output between the ``FSDP2_SURFACE`` marker comments of ``docs/fully_shard.md``;
``tests/unit/test_docs.py`` fails while the two differ.
"""

from __future__ import annotations

from raggedfsdp.fsdp import FSDP2_SURFACE


def table() -> str:
    """The markdown table: one row per public method of torch 2.13's ``FSDPModule``."""
    lines = ["| `FSDPModule` method | raggedfsdp |", "|---|---|"]
    lines += [f"| `{name}` | {answer} |" for name, answer in FSDP2_SURFACE.items()]
    return "\n".join(lines)


if __name__ == "__main__":
    print(table())
