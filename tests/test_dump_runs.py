"""Several runs in one dump folder (issue 33, item 3): the reader and `source-patch
compare` take the latest run of a kind by default (saying which, and which others
there are), list the runs when they are of different kinds, and spell the choice
`--exp-name` on every command line (`exp_name=` in Python)."""

import os

import pytest
import torch
from test_hardening_dump import named, records, write_dump

from source_patch.patcher import cli
from source_patch.runtime.dump import reader


def run(root, name, train=True, changed=False, age=0):
    """A run ``root/name`` of one side's dumps (the training side's changed: it diverges),
    last written ``age`` seconds ago."""
    recs = records(train)
    if changed:
        named(recs, "mlp_output")[2] = named(recs, "mlp_output")[2] * 1.5
    folder = write_dump(root / name, recs)
    stamp = os.stat(folder / "rank-0" / "manifest.jsonl").st_mtime - age
    os.utime(folder / "rank-0" / "manifest.jsonl", (stamp, stamp))
    return folder


def test_the_reader_reads_the_latest_run_of_a_kind_and_says_which(tmp_path, capsys):
    old = run(tmp_path, "train_moe-20261124-094143")
    new = run(tmp_path, "train_moe-20261124-101500", age=60)  # the name's start time wins over the write time
    (new / "rank-0" / "manifest.jsonl").write_text(
        (new / "rank-0" / "manifest.jsonl").read_text().splitlines(keepends=True)[0])  # one record
    assert len(reader.load(tmp_path)) == 1 and len(reader.load(tmp_path, exp_name=old.name)) == 7

    assert reader.main([str(tmp_path)]) == 0
    captured = capsys.readouterr()
    assert "1 records" in captured.out
    assert captured.err.startswith(f"source-patch: note: {tmp_path} holds 2 runs; reading the latest, {new.name} "
                                   f"(others: {old.name} (")
    assert "pick one with --exp-name NAME" in captured.err and "exp_name=" not in captured.err
    assert reader.main([str(tmp_path), "--exp-name", old.name]) == 0
    captured = capsys.readouterr()
    assert "7 records" in captured.out and captured.err == ""


def test_runs_of_different_kinds_are_listed_not_guessed(tmp_path, capsys):
    run(tmp_path, "rollout", train=False)
    run(tmp_path, "train", age=60)
    with pytest.raises(reader.RunsError, match=r"holds 2 runs of different kinds: rollout \(.*, 1 rank\), "
                                               r"train \(.*\); pick one with exp_name=NAME"):  # newest first
        reader.load(tmp_path)

    assert reader.main([str(tmp_path)]) == 2  # unusable input, as compare says it
    err = capsys.readouterr().err
    assert err.startswith(f"source-patch: error: {tmp_path} holds 2 runs of different kinds: rollout (") and "train (" in err
    assert "pick one with --exp-name NAME" in err and "exp_name=" not in err

    assert cli.main(["compare", str(tmp_path), str(tmp_path)]) == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"source-patch: error: {tmp_path} holds 2 runs of different kinds")
    assert "--exp-name NAME" in lines[0] and "exp_name=" not in lines[0] and captured.out == ""

    assert cli.main(["compare", str(tmp_path), str(tmp_path), "--exp-name", "rollout", "--exp-name", "train"]) == 0
    captured = capsys.readouterr()
    assert "no divergence" in captured.out and captured.err == ""


def test_compare_takes_the_latest_training_run_by_default(tmp_path, capsys):
    rollout = run(tmp_path, "rollout", train=False)
    replays = tmp_path / "sp-replay"
    run(replays, "replay-20261125-120000")
    run(replays, "replay-20261125-120000-2", changed=True, age=60)  # the same second: the suffix orders them
    assert cli.main(["compare", str(rollout), str(replays)]) == 1  # the latest, changed, diverges
    captured = capsys.readouterr()
    assert "first divergent: mlp_output layer 0" in captured.out
    assert captured.err.startswith(f"source-patch: note: {replays} holds 2 runs; reading the latest, replay-20261125-120000-2 ")
    # Once, --exp-name names the run under either side's dump root (the rollout is a run already).
    assert cli.main(["compare", str(rollout), str(replays), "--exp-name", "replay-20261125-120000"]) == 0
    assert capsys.readouterr().err == ""


def test_a_missing_run_lists_the_runs_there(tmp_path, capsys):
    run(tmp_path, "train_moe-20261124-094143")
    assert reader.main([str(tmp_path), "--exp-name", "train_moe-2026"]) == 2
    assert capsys.readouterr().err.startswith(
        f"source-patch: error: no run 'train_moe-2026' under {tmp_path} (its runs: train_moe-20261124-094143 (")
    assert cli.main(["compare", str(tmp_path), str(tmp_path), "--exp-name", "a", "--exp-name", "b",
                     "--exp-name", "c"]) == 2
    assert "--exp-name: at most twice" in capsys.readouterr().err


@pytest.mark.parametrize("command", [["compare"], ["replay"], None])
def test_every_command_line_spells_it_exp_name(command, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main([*command, "--help"]) if command else reader.main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "--exp-name NAME" in out and "exp_name" not in out


def test_a_single_run_and_a_run_folder_read_as_before(tmp_path):
    folder = run(tmp_path, "default")
    assert len(reader.load(tmp_path)) == len(reader.load(folder)) == len(reader.load(folder / "rank-0")) == 7
    assert reader.choose(tmp_path) == (folder, [])
    assert torch.equal(reader.load(tmp_path, name="positions")[0].tensor, torch.tensor([0, 1, 0, 1]))
