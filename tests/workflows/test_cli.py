"""``retrain workflows run`` entry point."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cloudworkflows.cli import main

WF = """\
main:
  params: [args]
  steps:
    - check:
        switch:
          - condition: ${args.fail}
            raise:
              message: asked to fail
              tags: [ValueError]
    - done:
        return: ${args.n * 2}
"""


def test_run_prints_result(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "wf.yaml"
    path.write_text(WF)
    assert main(["run", str(path), "--args", '{"n": 21, "fail": false}']) == 0
    assert json.loads(capsys.readouterr().out) == 42
    assert main(["run", str(path), "--args", '{"n": 1, "fail": false}', "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"state": "SUCCEEDED", "result": 2}


def test_run_reports_uncaught_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "wf.yaml"
    path.write_text(WF)
    assert main(["run", str(path), "--args", '{"n": 1, "fail": true}']) == 1
    assert json.loads(capsys.readouterr().err) == {"message": "asked to fail", "tags": ["ValueError"]}
    assert main(["run", str(path), "--args", '{"n": 1, "fail": true}', "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["state"] == "FAILED" and out["error"]["tags"] == ["ValueError"]


def test_run_syntax_error_and_bad_args(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("- a:\n    nonsense: 1\n")
    assert main(["run", str(path)]) == 1
    assert "line 1" in capsys.readouterr().err
    assert main(["run", str(path), "--args", "{nope"]) == 2
    assert main(["run", str(tmp_path / "missing.yaml")]) == 1
