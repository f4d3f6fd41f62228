"""``retrain workflows run FILE [--args JSON] [--json]``: run a workflow locally, stdlib only."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from .engine import load_workflow
from .errors import ExecutionCancelled, WorkflowError, WorkflowSyntaxError, format_error


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="retrain workflows", description="Run Cloud Workflows definitions locally."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a workflow file and print its result")
    run.add_argument("file")
    run.add_argument("--args", default=None, help="runtime argument as JSON")
    run.add_argument("--json", action="store_true", help="print a JSON object {state, result|error}")
    return parser


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    try:
        argument: Any = json.loads(args.args) if args.args is not None else None
    except ValueError as exc:
        print(f"--args is not valid JSON: {exc}", file=sys.stderr)
        return 2
    try:
        workflow = load_workflow(args.file)
    except (OSError, WorkflowSyntaxError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    try:
        result = workflow.run(argument)
    except WorkflowError as exc:
        if args.json:
            print(json.dumps({"state": "FAILED", "error": exc.value}, default=str))
        else:
            print(
                format_error(exc.value) if not isinstance(exc.value, str) else json.dumps(exc.value),
                file=sys.stderr,
            )
        return 1
    except (WorkflowSyntaxError, ExecutionCancelled) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"state": "SUCCEEDED", "result": result}))
    else:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main(sys.argv[1:]))
