"""Library and application apart: what ``import raggedfsdp...`` pulls in.

The planner is pure Python (no torch); the library (placement, planner, DBuffer,
fully_shard, optimizers, checkpoint) needs torch, numpy and safetensors alone. SciPy,
matplotlib, tqdm and tokenizers belong to the application (``pip install raggedfsdp[train]``).
Each check runs in a fresh interpreter, so what this test process imported does not count.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys

APPLICATION_ONLY = ("scipy", "matplotlib", "tqdm", "tokenizers")
LIBRARY = ("raggedfsdp", "fsdp", "optim", "checkpoint", "placement", "planner", "dbuffer")


def _imported(code: str) -> list[str]:
    """Run ``code`` in a fresh interpreter; it prints a Python list of module names."""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return ast.literal_eval(done.stdout.strip().splitlines()[-1])


def _import_library() -> str:
    return "import raggedfsdp\n" + "".join(
        f"import raggedfsdp.{name}\n" for name in LIBRARY if name != "raggedfsdp"
    )


def test_planner_imports_no_torch():
    code = (
        "import sys\nimport raggedfsdp.planner\n"
        f"print([m for m in ('torch', *{APPLICATION_ONLY!r}) if m in sys.modules])"
    )
    assert _imported(code) == []


def test_library_imports_nothing_of_the_application():
    # torch itself imports tqdm when it is installed (torch.hub): count what the
    # library adds to what torch, numpy and safetensors import.
    code = (
        "import sys\nimport numpy, safetensors, torch\nbefore = set(sys.modules)\n"
        + _import_library()
        + f"print([m for m in {APPLICATION_ONLY!r} if m in set(sys.modules) - before])"
    )
    assert _imported(code) == []


def test_library_imports_without_the_application_packages():
    # As if only torch, numpy and safetensors were installed: importing scipy,
    # matplotlib or tqdm fails.
    code = (
        "import sys\n"
        "class Absent:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        f"        if name.partition('.')[0] in {APPLICATION_ONLY!r}:\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, Absent())\n"
        + _import_library()
        + f"print([m for m in {APPLICATION_ONLY!r} if m in sys.modules])"
    )
    assert _imported(code) == []


def test_an_untested_torch_is_refused_unless_asked_for():
    """Another torch: ImportError naming the fix, or, with the variable set, a warning."""
    code = (
        "import sys, warnings\nimport torch\ntorch.__version__ = '2.11.0+cu130'\n"
        "try:\n"
        "    with warnings.catch_warnings(record=True) as seen:\n"
        "        warnings.simplefilter('always')\n"
        "        import raggedfsdp.tensor.placement\n"
        "    print([str(w.message) for w in seen if 'untested' in str(w.message).lower()\n"
        "           or 'tested on torch' in str(w.message)])\n"
        "except ImportError as e:\n"
        "    print([str(e)])\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "RAGGEDFSDP_UNTESTED_TORCH"}
    for value, expected in ((None, "install torch==2.13.0, or set"), ("1", "going on because")):
        if value is not None:
            env["RAGGEDFSDP_UNTESTED_TORCH"] = value
        done = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env
        )
        assert done.returncode == 0, done.stderr[-3000:]
        (message,) = ast.literal_eval(done.stdout.strip().splitlines()[-1])
        assert "found torch 2.11.0+cu130" in message and expected in message, message


def test_moved_paths_are_the_new_modules_with_a_deprecation_warning():
    """``import raggedfsdp.placement`` (and the other three old paths) gives the moved
    module itself, once warned; so do ``raggedfsdp.placement`` and ``from raggedfsdp
    import placement``."""
    moved = {
        "placement": "raggedfsdp.tensor.placement",
        "dbuffer": "raggedfsdp.fsdp.dbuffer",
        "profiling": "raggedfsdp.tools.profiling",
        "simulate": "raggedfsdp.tools.simulate",
    }
    code = (
        "import importlib, sys, warnings\nimport raggedfsdp\nfound = []\n"
        f"for old, new in {moved!r}.items():\n"
        "    with warnings.catch_warnings(record=True) as seen:\n"
        "        warnings.simplefilter('always')\n"
        "        module = importlib.import_module('raggedfsdp.' + old)\n"
        "    found.append((module is sys.modules[new] is getattr(raggedfsdp, old),\n"
        "                  [(w.category.__name__, str(w.message)) for w in seen]))\n"
        "print(found)"
    )
    assert _imported(code) == [
        (
            True,
            [
                (
                    "DeprecationWarning",
                    f"raggedfsdp.{old} moved to {new}; import it from there (the old path "
                    "goes in the next release)",
                )
            ],
        )
        for old, new in moved.items()
    ]
