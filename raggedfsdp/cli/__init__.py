"""The command line: one module per ``python -m raggedfsdp`` command, each exposing
``main(argv) -> int``; ``raggedfsdp.__main__`` imports a command's module only when it
runs."""
