"""The CLI's arguments, parsed as a person types them (no stack: the parser alone)."""

from __future__ import annotations

import pytest

from retrain.domain.events import check_object_name
from retrain_ops.cli import build_parser


def test_double_dash_ends_options_so_a_file_may_start_with_a_dash() -> None:
    args = build_parser().parse_args(["drop", "--dataset", "notes", "--", "-x.txt", "--no-seal"])
    assert args.files == ["-x.txt", "--no-seal"] and args.no_seal is False and args.dataset == "notes"
    assert check_object_name("incoming/notes/-x.txt") == "incoming/notes/-x.txt"  # and the function takes it


def test_up_pauses_only_the_scheduler_jobs_infra_declares(capsys: pytest.CaptureFixture[str]) -> None:
    assert build_parser().parse_args(["up"]).pause == []
    assert build_parser().parse_args(["up", "--pause", "seal", "--pause", "sweeper"]).pause == [
        "seal",
        "sweeper",
    ]
    with pytest.raises(SystemExit) as refused:
        build_parser().parse_args(["up", "--pause", "hourly"])
    assert refused.value.code == 2
    assert "invalid choice: 'hourly'" in capsys.readouterr().err


@pytest.mark.integration  # a process: the import's logging as a user's terminal shows it
def test_a_command_that_imports_beam_prints_no_stray_warning() -> None:
    import subprocess
    import sys

    shown = subprocess.run(
        [sys.executable, "-m", "retrain_ops.cli", "tokenize", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert shown.returncode == 0 and "usage: retrain tokenize" in shown.stdout
    assert shown.stderr == ""
