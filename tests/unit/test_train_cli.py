"""``python -m raggedfsdp train``: help text and argument errors (no process is spawned)."""

from __future__ import annotations

import re

import pytest

from raggedfsdp.train._cli import build_parser, main


def test_help_documents_every_option(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    for action in build_parser()._actions:
        for option in action.option_strings:
            assert option in text, option
        if action.option_strings and action.dest != "help":
            assert action.help, f"{action.dest} has no help text"


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--model", "gpt-9"], r"unknown --model 'gpt-9'; choose one of llama-tiny"),
        (["--model", "deepseek-v3"], r"a catalogue shape, too big to train here"),
        (
            ["--batch-size", "10", "--nproc", "4"],
            r"--batch-size 10 is not divisible by the world size 4",
        ),
        (
            ["--reshard-after-forward", "3", "--nproc", "4"],
            r"must be auto, true, false or a factor of the world size 4",
        ),
        (["--block-rows", "0"], r"--block-rows must be a positive int or 'whole', got '0'"),
        (
            ["--backend", "fsdp2", "--optim", "muon"],
            r"--optim muon runs on the raggedfsdp backend only",
        ),
        (["--data", "/nonexistent/corpus.txt"], r"/nonexistent/corpus.txt"),
        (["--nproc", "0"], r"--nproc must be >= 1"),
    ],
)
def test_bad_arguments_fail_before_any_spawn(argv, match, capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--out", str(tmp_path / "out")])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert re.search(match, err), err
    assert not (tmp_path / "out").exists()  # nothing written, nothing launched


def test_a_missing_application_package_names_the_extra(monkeypatch, capsys, tmp_path):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "tqdm" else find_spec(name, *a),
    )
    with pytest.raises(SystemExit) as exit_:
        main(["--out", str(tmp_path / "out")])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert re.search(r"the progress bar needs tqdm.*raggedfsdp\[train\].*--no-progress", err), err
