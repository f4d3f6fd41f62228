"""The CLI's arguments, parsed as a person types them (no stack: the parser alone)."""

from __future__ import annotations

import dataclasses

import pytest

from retrain.domain.events import check_object_name
from retrain.domain.runs import Run, RunStatus, Trigger
from retrain_ops.cli import build_parser, demo_exit_code


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


def test_the_demo_exits_1_unless_its_run_succeeded_cleanly() -> None:
    """What `retrain demo` exits with (its whole run is tests/test_e2e.py's; a failed one was, too, until
    tests/shared_stack's test_dws_failure took its run's checks on the shared stack)."""
    good = Run("d-20261203-000000-abcdef", "d", Trigger.MANUAL, status=RunStatus.SUCCEEDED, nodes_at_end=0)
    every = "audit: every object accounted for (4 trained)"
    assert demo_exit_code(good, every, refused=0) == 0
    assert demo_exit_code(dataclasses.replace(good, status=RunStatus.FAILED), every, 0) == 1
    assert demo_exit_code(dataclasses.replace(good, nodes_at_end=1), every, 0) == 1
    assert demo_exit_code(good, "audit: 1 object(s) not accounted for (1 lost): `retrain audit`", 0) == 1
    assert demo_exit_code(good, every, refused=1) == 1
