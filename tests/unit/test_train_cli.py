"""``python -m raggedfsdp train``: help text and argument errors (no process is spawned)."""

from __future__ import annotations

import re

import pytest

from raggedfsdp.cli.train import build_parser, main


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
        (["--max-buffers", "0"], r"--max-buffers must be >= 1, got 0"),
        (
            ["--backend", "fsdp2", "--member-gaps", "on"],
            r"--member-gaps applies to the raggedfsdp backend only .*pass --backend raggedfsdp",
        ),
        (
            ["--backend", "fsdp2", "--max-buffers", "2"],
            r"--max-buffers applies to the raggedfsdp backend only",
        ),
        (
            ["--backend", "fsdp2", "--optim", "muon"],
            r"--optim muon runs on the raggedfsdp backend only",
        ),
        (["--data", "/nonexistent/corpus.txt"], r"/nonexistent/corpus.txt"),
        (["--nproc", "0"], r"--nproc must be >= 1"),
        # each of these used to fail inside the ranks, 10-17 s in
        (["--batch-size", "0"], r"--batch-size must be >= 1, got 0"),
        (["--keep-last", "0"], r"--keep-last must be >= 1, got 0"),
        (["--val-batches", "0"], r"--val-batches must be >= 1, got 0"),
        (["--stop-after", "-5"], r"--stop-after must be >= 0, got -5"),
        (["--clip", "-1"], r"--clip must be a finite number >= 0, got -1.0"),
        (["--lr", "nan"], r"--lr must be a finite number >= 0, got nan"),
        (["--timeout", "0"], r"--timeout must be a number of seconds > 0"),
        (["--nnodes", "0"], r"--nnodes must be an int >= 1, got '0'"),
        (["--nnodes", "2"], r"--nnodes 2 needs --rdzv-endpoint host:port"),
        (
            ["--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "node0:29400"],
            r"--node-rank must be in \[0, 2\) for --nnodes 2, got 2",
        ),
        (["--reshard-after-forward", "0"], r"must be auto, true, false or a factor"),
        (
            ["--block-rows", "7"],
            r"--block-rows 7 does not divide the 96 rows of 'layers.0.attention.wq.weight' "
            r"\(shape \(96, 96\)\) of llama-tiny; pass a block that divides every parameter's "
            r"rows \(here: 1\) or 'whole'",
        ),
        (["--block-rows", "32", "--model", "moe-tiny"], r"does not divide the 1001 rows"),
        (["--backend", "fsdp2", "--block-rows", "4"], r"--block-rows applies to the raggedfsdp"),
        (["--resume", "--overwrite"], r"--resume continues the run in --out, --overwrite"),
        (["--resume"], r"--resume: '.*out' holds no run \(run.json is missing\), nothing to"),
        # meshes of exactly the job's ranks, checked against the model
        (
            ["--mesh", "replicate=2,shard=3", "--nproc", "4"],
            r"--mesh replicate=2,shard=3 has 2 x 3 = 6 ranks, but the job has 4; make R x S "
            r"equal the number of ranks",
        ),
        (["--mesh", "replicate=2,shard=x"], r"the size of 'shard' must be an int >= 1, got 'x'"),
        (["--mesh", "shard=4"], r"the 'replicate' dim is missing"),
        (["--mesh", "dp=2,shard=2"], r"dp and shard both name the data-parallel ranks"),
        (["--mesh", "cp=2"], r"the 'cp' dim \(context parallel\) is not supported yet"),
        (["--mesh", "fsdp=4"], r"unknown dim 'fsdp'; expected some of replicate, shard, dp"),
        (
            ["--mesh", "replicate=2,shard=2", "--reshard-after-forward", "2"],
            r"--reshard-after-forward 2 with --mesh replicate=2,shard=2 is not supported yet "
            r".*pass auto, true or false",
        ),
        (
            ["--mesh", "dp=4,tp=2", "--model", "llama-small"],
            r"--mesh dp=4,tp=2: dp x tp = 8, but the job has 4 ranks; make dp x tp equal",
        ),
        (["--mesh", "tp=3", "--model", "llama-small"], r"tp=3 does not divide the job's 4"),
        (
            ["--mesh", "tp=2"],
            r"--mesh tp=2: llama-tiny has 3 query and 1 key/value heads \(gqa attention\), "
            r"which do not split over tp=2; tensor parallel splits whole heads",
        ),
        (["--mesh", "tp=2", "--model", "moe-tiny"], r"moe-tiny has 3 query and 1 key/value"),
        (
            ["--mesh", "tp=2", "--model", "llama-small", "--optim", "adamw8bit"],
            r"--mesh tp=2 with --optim adamw8bit: row-wise tensor parallel leaves each tp rank "
            r"rows of attention.wo: 96, feed_forward.w2: 258 elements of llama-small, not whole "
            r"quantization blocks of 256",
        ),
        (
            ["--mesh", "tp=2", "--model", "llama-small", "--batch-size", "3"],
            r"--batch-size 3 is not divisible by the 2 data-parallel ranks of --mesh dp=2,tp=2",
        ),
        (
            ["--mesh", "tp=2", "--model", "llama-small", "--block-rows", "2"],
            r"--block-rows 2 with --mesh tp=2 is not supported yet",
        ),
        (
            ["--mesh", "ep=2", "--model", "llama-small"],
            r"--mesh ep=2: llama-small is dense \(no experts to split over ep\); expert parallel "
            r"needs an MoE model",
        ),
        (
            ["--mesh", "ep=4", "--model", "moe-small"],
            r"--mesh ep=4: the 6 experts of moe-small do not split evenly over ep=4",
        ),
        (["--mesh", "dp=2,ep=2", "--model", "moe-small"], r"pass dp=4 or leave dp out"),
        (
            ["--mesh", "tp=2,ep=2", "--model", "moe-small"],
            r"--mesh with tp=2 and ep=2: tensor and expert parallel together are not "
            r"supported yet",
        ),
        (
            ["--mesh", "replicate=2,shard=1,ep=2", "--model", "moe-small"],
            r"HSDP x EP is not supported yet; pass ep=2 alone",
        ),
    ],
)
def test_bad_arguments_fail_before_any_spawn(argv, match, capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--max-bytes", "100000", "--out", str(tmp_path / "out")])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert re.search(match, err), err
    assert not (tmp_path / "out").exists()  # nothing written, nothing launched


@pytest.mark.parametrize(
    "data, argv, match",
    [
        # a binary file used to train silently (the NUL check covered folders only)
        (b"\x7fELF\x00\x01" * 500, [], r"--data '.*corpus' is not text \(it holds NUL bytes"),
        # data shorter than a sequence
        (b"x" * 12, ["--val-every", "0"], r"the training split of .* has \d+ bytes, fewer "
         r"than --seq-len \+ 1 = 17"),
        # a validation split too small: an error before training, not after it
        (b"x" * 150, [], r"the validation split .* has 15 bytes, fewer than --seq-len \+ 1 = 17; .*"
         r"or --val-every 0"),
    ],
)  # fmt: skip
def test_bad_data_fails_before_any_spawn(data, argv, match, capsys, tmp_path):
    (tmp_path / "corpus").write_bytes(data)
    with pytest.raises(SystemExit) as exit_:
        main(["--data", str(tmp_path / "corpus"), "--seq-len", "16", *argv,
              "--out", str(tmp_path / "out")])  # fmt: skip
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert re.search(match, err), err
    assert not (tmp_path / "out").exists()


def test_a_folder_of_another_run_or_of_anything_is_refused(capsys, tmp_path):
    """A new run into a non-empty --out is refused unless --overwrite
    (the CLI tests of tests/dist/test_reliability_cli.py cover the runs themselves)."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit) as exit_:
        main(["--max-bytes", "100000", "--out", str(out)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert re.search(r"--out '.*out' is not empty: it holds files of something else. Pass "
                     r"--resume .*--overwrite .*or another --out", err), err  # fmt: skip
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


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
