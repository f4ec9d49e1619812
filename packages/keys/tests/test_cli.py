from __future__ import annotations

import subprocess
import sys

import pytest

from hybridkv.keys.__main__ import main

HYBRID = "Qwen3-Next@mooncake_hybrid_v1:ab12@pp_rank:1@group:2@block:64@0aff@3"


def test_explain_prints_every_field(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explain", HYBRID, "gemma@00ff@7"]) == 0
    out = capsys.readouterr().out
    lines = [line.split() for line in out.splitlines()]
    assert lines == [
        ["format", "mooncake_hybrid_v1"],
        ["model", "Qwen3-Next"],
        ["layout", "ab12"],
        ["pp_rank", "1"],
        ["group", "2"],
        ["block_size", "64"],
        ["block_hash", "0aff"],
        ["head", "3"],
        [],
        ["format", "single-group"],
        ["model", "gemma"],
        ["block_hash", "00ff"],
        ["head", "7"],
    ]


def test_absent_pp_rank_is_shown_as_absent(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explain", HYBRID.replace("@pp_rank:1", "")]) == 0
    assert "pp_rank     -" in capsys.readouterr().out


def test_bad_key_names_the_field_and_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explain", "gemma@00ff@7", HYBRID.replace("group:2", "group:x")]) == 2
    captured = capsys.readouterr()
    assert "group: " in captured.err
    assert "single-group" in captured.out


def test_runs_as_a_module() -> None:
    good = subprocess.run(
        [sys.executable, "-m", "hybridkv.keys", "explain", HYBRID],
        capture_output=True,
        text=True,
    )
    assert good.returncode == 0
    assert "0aff" in good.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "hybridkv.keys", "explain", "m@00@-1"],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2
    assert "head: " in bad.stderr


def test_usage_errors_exit_2() -> None:
    with pytest.raises(SystemExit) as caught:
        main([])
    assert caught.value.code == 2
