"""Command line: ``python -m raggedfsdp <command> [options]``.

Each command lives in its own module and is imported only when used, so
``python -m raggedfsdp plan`` never imports the distributed runtime.
"""

from __future__ import annotations

import importlib
import sys

# command -> (module, one-line help). Each module exposes ``main(argv) -> int``.
COMMANDS = {
    "demo": ("raggedfsdp.cli.demo", "train on 4 ranks with raggedfsdp and FSDP2, side by side"),
    "train": ("raggedfsdp.cli.train", "train a model on N ranks (torchrun)"),
    "export": (
        "raggedfsdp.cli.export",
        "a trained Hugging Face model as a directory transformers loads",
    ),
    "tokenize": ("raggedfsdp.cli.tokenize", "text, folders or JSON-lines into a token file"),
    "plan": ("raggedfsdp.cli.plan", "plan communication buffers for a model"),
    "simulate": ("raggedfsdp.cli.simulate", "memory and comms of one rank of N, on fake tensors"),
    "walkthrough": ("raggedfsdp.cli.walkthrough", "RaggedShard on 4 gloo ranks, step by step"),
}


def _usage() -> str:
    lines = ["usage: python -m raggedfsdp <command> [options]", "", "commands:"]
    lines += [f"  {name:<12} {help_}" for name, (_, help_) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"raggedfsdp: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
