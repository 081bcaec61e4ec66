"""The docs that are made from the code say what the code says: the FSDP2 method table of
``docs/fully_shard.md`` and the index of ``[Note: ...]`` blocks in ``docs/architecture.md``."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# A note is introduced where a line starts with its name (after ``#`` or ``"""``) and ends
# there or goes on with its text; a line that goes on with ")", ".", ";", " in", " for" or
# " allows" cites a note introduced elsewhere.
_INTRODUCED = re.compile(
    r'^\s*(?:#\s*|"""\s*)?\[Note: ([^\]]+)\](\s+(?!(?:in|for|allows)\b)\w.*)?$'
)
_CITED = re.compile(r"\[Note:\s+([^\]]+)\]")


def _between_markers(path: Path, name: str) -> str:
    text = path.read_text()
    begin, end = f"<!-- {name} begin -->\n", f"\n<!-- {name} end -->"
    assert begin in text and end in text, f"{path.name} lacks the {name} marker comments"
    return text[text.index(begin) + len(begin) : text.index(end)]


def _notes() -> tuple[dict[str, list[str]], set[str]]:
    """Each note's name -> the files that introduce it, and every name cited anywhere."""
    introduced: dict[str, list[str]] = {}
    cited: set[str] = set()
    for path in sorted((ROOT / "raggedfsdp").rglob("*.py")):
        text = path.read_text()
        for line in text.splitlines():
            if m := _INTRODUCED.match(line):
                introduced.setdefault(m.group(1), []).append(str(path.relative_to(ROOT)))
        cited.update(" ".join(m.group(1).split()) for m in _CITED.finditer(text))
    return introduced, cited


def notes_index() -> str:
    """The index as ``docs/architecture.md`` holds it: by file, then by name."""
    introduced, _ = _notes()
    rows = sorted((files[0], name.lower(), name) for name, files in introduced.items())
    lines = ["| note | introduced in |", "|---|---|"]
    lines += [f"| [Note: {name}] | `{file}` |" for file, _, name in rows]
    return "\n".join(lines)


def test_the_fsdp2_table_is_fsdp2_surface():
    spec = importlib.util.spec_from_file_location(
        "gen_fsdp2_table", ROOT / "docs/gen_fsdp2_table.py"
    )
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    documented = _between_markers(ROOT / "docs/fully_shard.md", "FSDP2_SURFACE")
    assert documented == gen.table(), (
        "docs/fully_shard.md's FSDP2 table differs from FSDP2_SURFACE: paste the output of "
        "`python docs/gen_fsdp2_table.py` between its FSDP2_SURFACE markers"
    )


def test_every_note_is_introduced_once_and_indexed():
    introduced, cited = _notes()
    twice = {name: files for name, files in introduced.items() if len(files) > 1}
    assert not twice, f"notes introduced more than once: {twice}"
    assert cited <= set(introduced), f"notes cited but never introduced: {cited - set(introduced)}"
    documented = _between_markers(ROOT / "docs/architecture.md", "NOTES")
    assert documented == notes_index(), (
        "docs/architecture.md's index of notes differs from the code; between its NOTES "
        f"markers it should read:\n{notes_index()}"
    )
