"""The docs that are made from the code say what the code says: the FSDP2 method table of
``docs/fully_shard.md`` and the index of ``[Note: ...]`` blocks in ``docs/architecture.md``."""

from __future__ import annotations

import importlib.util
import re
import tokenize
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


# ---- references in docstrings, comments and docs ------------------------------------------
#
# A reference names a file (``_grads.py``, ``raggedfsdp/optim/muon_plan.py``), a module
# (``muon_plan``, ``muon_plan.assign_roots``, ``raggedfsdp.fsdp.dbuffer``), a function or
# attribute (``alloc_shard``), or a note, maybe with where it is (``[Note: X] in
# ``_grads.py````). Each must name one that exists: a file of the repository (or of
# torch, whose sources the comments compare with), a module of the package and a name its
# code spells, a name some code spells (the package's, the tests', or the torch sources
# the comments cite), a note introduced (in the file or module named).

_TICKED = re.compile(r"``([^`\n]+)``|(?<!`)`([^`\n]+)`(?!`)")
_FILE = re.compile(r"[\w./-]+\.(?:py|md)")
_DOTTED = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*")
_SNAKE = re.compile(r"[a-z0-9]*_[a-z0-9_]*")
_CITED_IN = re.compile(
    r"\[Note:\s+([^\]]+)\][\s#]*(?:\((?:see\s+)?|in\s+|of\s+)"
    r"(?:(`{1,2})([\w./]+)\2|([\w./]+\.py))"
)
_DOCSTRING = ('"""', "'''")
# Markdown between these markers names what no longer exists on purpose (old paths).
_OLD_PATHS = re.compile(r"<!-- OLD_PATHS begin -->.*?<!-- OLD_PATHS end -->", re.S)
TORCH = Path(importlib.util.find_spec("torch").submodule_search_locations[0])
# Where the comments cite torch by name: the sources their names must be found in.
_TORCH_SOURCES = (
    "distributed/fsdp",
    "distributed/tensor",
    "distributed/checkpoint",
    "distributed/pipelining",
    "nn/modules/module.py",
    "_tensor_docs.py",
    "_torch_docs.py",
    "optim",
)
# Names from the other libraries the comments compare with (Hugging Face's GPT-2,
# DeepSpeed's ZeRO-3, Meta's DistributedShampoo), which this environment does not hold.
_OTHER_LIBRARIES = {
    "c_attn",
    "_padding_size",
    "_partition_param",
    "partition_parameters.py",
    "max_preconditioner_dim",
}


def _words(paths) -> set[str]:
    return {w for path in paths for w in re.findall(r"\w+", path.read_text(errors="replace"))}


def _prose(path: Path) -> list[tuple[int, str]]:
    """(line, text) of each comment block and docstring of a Python file; of a Markdown
    file, each line (but those between OLD_PATHS markers)."""
    if path.suffix == ".md":
        text = _OLD_PATHS.sub(lambda m: "\n" * m.group().count("\n"), path.read_text())
        return list(enumerate(text.splitlines(), 1))
    found: list[tuple[int, str]] = []
    last_comment = -1
    with tokenize.open(path) as f:
        for tok in tokenize.generate_tokens(f.readline):
            if tok.type == tokenize.COMMENT:
                if found and tok.start[0] == last_comment + 1:  # a block of comments
                    found[-1] = (found[-1][0], found[-1][1] + "\n" + tok.string)
                else:
                    found.append((tok.start[0], tok.string))
                last_comment = tok.start[0]
            elif tok.type == tokenize.STRING and tok.string.lstrip("rbuRBU")[:3] in _DOCSTRING:
                found.append((tok.start[0], tok.string))
    return found


def _code_names(path: Path) -> set[str]:
    """The names a Python file's code (not its prose) spells, string constants' words too."""
    names = set()
    with tokenize.open(path) as f:
        for tok in tokenize.generate_tokens(f.readline):
            if tok.type == tokenize.NAME:
                names.add(tok.string)
            elif tok.type == tokenize.STRING and tok.string.lstrip("rbuRBU")[:3] not in _DOCSTRING:
                names.update(re.findall(r"\w+", tok.string))
    return names


def stale_references() -> list[str]:
    """Every reference in raggedfsdp/'s comments and docstrings and docs/*.md that names
    no file, module, name or note that exists: ``path:line: reference (why)``."""
    sources = sorted((ROOT / "raggedfsdp").rglob("*.py"))
    files = {
        p.relative_to(ROOT).as_posix()
        for top in ("raggedfsdp", "tests", "benchmarks", "docs")
        for p in (ROOT / top).rglob("*")
        if p.is_file()
    } | {p.name for p in ROOT.iterdir() if p.is_file()}
    files |= {p.relative_to(TORCH.parent).as_posix() for p in TORCH.rglob("*.py")}
    names_in = {p: _code_names(p) for p in sources}
    modules: dict[str, list[Path]] = {}  # a module's name (its file's stem) -> its files
    for p in sources:
        if p.name != "__init__.py":
            modules.setdefault(p.stem, []).append(p)
    packages = {p.parent.name for p in sources if p.name == "__init__.py"}
    known = set().union(*names_in.values(), modules, packages, _OTHER_LIBRARIES)
    known |= _words((ROOT / "tests").rglob("*.py"))
    for sub in _TORCH_SOURCES:
        known |= _words([TORCH / sub] if (TORCH / sub).is_file() else (TORCH / sub).rglob("*.py"))
    introduced, _ = _notes()

    def file_exists(ref: str) -> bool:
        ref = ref.removeprefix("./")
        return ref in _OTHER_LIBRARIES or any(f == ref or f.endswith("/" + ref) for f in files)

    def dotted_wrong(ref: str, here: Path) -> str | None:
        """What is wrong with a dotted reference, or None."""
        parts = ref.split(".")
        if parts[0] == "raggedfsdp":
            for end in range(len(parts), 0, -1):
                base = ROOT.joinpath(*parts[:end])
                for path in (base.with_suffix(".py"), base / "__init__.py"):
                    if path.is_file():
                        rest = parts[end:]
                        if rest and rest[0] not in names_in[path]:
                            return f"no {rest[0]} in {path.relative_to(ROOT)}"
                        return None
            return "no such module"
        head = parts[0]
        if head in ("self", "cls") or head in names_in.get(here, ()):
            return None
        # A module named with a leading ``_`` it no longer has (``_muon_plan`` for
        # ``muon_plan``, ``_cli`` for ``cli``).
        if head not in modules and head not in packages:
            if head.startswith("_") and (head[1:] in modules or head[1:] in packages):
                return "no such module"
        if head in modules and len(parts) > 1:
            if not any(parts[1] in names_in[p] for p in modules[head]):
                return f"no {parts[1]} in module {head}"
        if len(parts) == 1 and _SNAKE.fullmatch(head) and head not in known:
            return "no such name"
        return None

    def introduced_in(note: str, where: str) -> bool:
        """Whether the file or module ``where`` (or a file of that package) introduces it."""
        for intro in introduced[note]:
            path = Path(intro)
            if where.endswith(".py"):
                if intro == where or intro.endswith("/" + where.removeprefix("./")):
                    return True
            elif where in (path.stem, path.parent.name):
                return True
            elif where.replace(".", "/") in (path.parent.as_posix(), str(path.with_suffix(""))):
                return True
        return False

    stale = []
    docs = sorted((ROOT / "docs").glob("*.md"))
    for path in sources + docs:
        rel = path.relative_to(ROOT)
        for first, text in _prose(path):
            for m in _CITED.finditer(text):
                line = first + text.count("\n", 0, m.start())
                name = " ".join(m.group(1).split())
                if name not in introduced and name not in ("name", "..."):
                    stale.append(f"{rel}:{line}: [Note: {name}] (never introduced)")
            for m in _CITED_IN.finditer(text):
                line = first + text.count("\n", 0, m.start())
                name, where = " ".join(m.group(1).split()), m.group(3) or m.group(4)
                if name in introduced and not introduced_in(name, where):
                    stale.append(f"{rel}:{line}: [Note: {name}] in {where} ({introduced[name][0]})")
            for m in _TICKED.finditer(text):
                line = first + text.count("\n", 0, m.start())
                ref = (m.group(1) or m.group(2)).strip().removesuffix("()")
                if _FILE.fullmatch(ref):
                    if not file_exists(ref):
                        stale.append(f"{rel}:{line}: {ref} (no such file)")
                elif _DOTTED.fullmatch(ref) and (why := dotted_wrong(ref, path)) is not None:
                    stale.append(f"{rel}:{line}: {ref} ({why})")
    return stale


def test_every_reference_names_what_exists():
    stale = stale_references()
    assert stale == [], "references to what does not exist:\n" + "\n".join(stale)
