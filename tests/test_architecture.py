"""The layout is the architecture: the domain depends on nothing outside it, adapters are built in
one place, and outcomes are enums.  Read from the source with ``ast``, so a new import that breaks
the rule fails here."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RETRAIN = REPO / "retrain"


def imports(path: Path) -> set[str]:
    """Every module a file imports, at any depth (function-level imports included)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
    return out


def test_the_domain_imports_only_the_standard_library_and_itself() -> None:
    for path in sorted((RETRAIN / "domain").glob("*.py")):
        for module in imports(path):
            top = module.split(".")[0]
            if top == "__future__" or top in sys.stdlib_module_names:
                continue
            assert module.startswith("retrain.domain"), f"{path.name} imports {module}"


def test_ingest_and_the_ports_name_no_sdk_kubernetes_or_training_code() -> None:
    forbidden = (
        "google",
        "kubernetes",
        "torch",
        "apache_beam",
        "retrain.k8s",
        "retrain.train",
        "retrain.adapters",
    )
    for name in ("ingest.py", "ports.py", "contracts.py"):
        for module in imports(RETRAIN / name):
            assert not module.startswith(forbidden), f"{name} imports {module}"


def test_adapters_are_built_only_in_the_composition_root() -> None:
    adapters = ("FirestoreLedger(", "WorkflowsExecutions(", "GkeCluster(")
    for path in RETRAIN.rglob("*.py"):
        if path.name == "composition.py" or path.parent.name == "adapters":
            continue
        text = path.read_text()
        assert not any(a in text for a in adapters), f"{path.relative_to(REPO)} builds an adapter itself"


def test_outcomes_are_enums_not_prose() -> None:
    """No branch in ingest.py compares against a string literal: verdicts and actions are enums."""
    tree = ast.parse((RETRAIN / "ingest.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and any(isinstance(op, (ast.Eq, ast.NotEq)) for op in node.ops):
            for side in (node.left, *node.comparators):
                assert not (isinstance(side, ast.Constant) and isinstance(side.value, str)), ast.unparse(node)
