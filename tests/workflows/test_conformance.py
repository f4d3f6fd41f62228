"""Runs every documented-behaviour workflow under conformance/ and checks its declared outcome.

The cases are organised by the documentation page that states the behaviour: one folder per page
(``syntax-variables``, ``stdlib-text``, ``troubleshooting`` ...), and every case names its page in a
``# source: URL`` header line. Each YAML file states its expectation in header comments (``# expect: JSON``,
``# expect_error: JSON``, ``# expect_deploy_error: "message"`` for what Google refuses when the workflow
is deployed, and optionally ``# args: JSON``); JSON definitions use a ``.expect`` sidecar holding the same
keys.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from retrain.workflows import WorkflowError, load_workflow
from retrain.workflows.errors import WorkflowSyntaxError

HERE = Path(__file__).parent / "conformance"
CASES = sorted(p for p in HERE.rglob("*") if p.suffix in (".yaml", ".json"))
GOOGLE_DOCS = "https://cloud.google.com/workflows/docs/"
EXECUTION = "projects/proj-1/locations/us-central1/workflows/wf/executions/exec-1"


def expectations(path: Path) -> dict[str, Any]:
    if path.suffix == ".json":
        return dict(json.loads(path.with_suffix(".json.expect").read_text()))
    out: dict[str, Any] = {}
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        if line.startswith("# source:"):
            out["source"] = line.removeprefix("# source:").strip()
        for key in ("args", "expect", "expect_error", "expect_deploy_error"):
            prefix = f"# {key}:"
            if line.startswith(prefix):
                out[key] = json.loads(line[len(prefix) :])
    return out


def same(a: Any, b: Any) -> bool:
    """Equality that tells 1 from 1.0 from true, like Workflows' typed values."""
    if type(a) is not type(b) and not (isinstance(a, int | float) and isinstance(b, int | float)):
        return False
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, float) or isinstance(b, float):
        return type(a) is type(b) and a == b
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return bool(a == b)


def test_cases_exist() -> None:
    assert len(CASES) >= 30
    for case in CASES:
        exp = expectations(case)
        outcomes = [k for k in ("expect", "expect_error", "expect_deploy_error") if k in exp]
        assert len(outcomes) == 1, f"{case.name} must declare one outcome"
        assert str(exp.get("source", "")).startswith(GOOGLE_DOCS), f"{case.name} must cite its Google page"
        assert case.parent != HERE, f"{case.name} belongs in the folder of its documentation page"


@pytest.mark.parametrize("case", CASES, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_conformance(case: Path) -> None:
    exp = expectations(case)
    if "expect_deploy_error" in exp:
        with pytest.raises(WorkflowSyntaxError) as refused:
            load_workflow(case)
        assert exp["expect_deploy_error"] in str(refused.value)
        return
    wf = load_workflow(case)
    if "expect" in exp:
        result = wf.run(exp.get("args"), execution_name=EXECUTION)
        assert same(result, exp["expect"]), f"{case.name}: got {result!r}, expected {exp['expect']!r}"
        return
    with pytest.raises(WorkflowError) as info:
        wf.run(exp.get("args"), execution_name=EXECUTION)
    want, got = exp["expect_error"], info.value.value
    if isinstance(want, str):
        assert got == want
        return
    assert isinstance(got, dict), got
    for key, value in want.items():
        if key == "tags":
            assert set(value) <= set(got.get("tags", [])), got
        else:
            assert same(got.get(key), value), got
