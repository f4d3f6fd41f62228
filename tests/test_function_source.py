"""The Cloud Functions source ``retrain deploy`` uploads: ``functions/main.py`` and the runtime package
``retrain/`` whole, and ``functions/requirements.txt`` provides every third-party module those import."""

from __future__ import annotations

import ast
import importlib.metadata as metadata
import importlib.util
import os
import subprocess
import sys
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from retrain_local.serverless import AS_DEPLOYED, deployed_functions_source

REPO = Path(__file__).resolve().parents[1]


def _imports(source: Path, package: str) -> Iterator[str]:
    """Modules ``source`` imports at run time (anywhere in it, function bodies included; not under
    ``if TYPE_CHECKING:``), relative imports made absolute against ``package``."""
    tree = ast.parse(source.read_text(), str(source))
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            skipped.update(id(n) for child in node.body for n in ast.walk(child))
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names)


def runtime_modules() -> dict[str, Path]:
    """Every module of the runtime package ``retrain/`` (all of it ships), by dotted name."""
    out = {}
    for path in sorted((REPO / "retrain").rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


@cache
def _distribution_of_file() -> dict[Path, str]:
    index = {}
    for dist in metadata.distributions():
        name = dist.metadata["Name"].lower().replace("_", "-")  # parsed anew on every access: once a dist
        for f in dist.files or ():
            index[Path(str(dist.locate_file(f))).resolve()] = name
    return index


NAMESPACE = "(namespace package)"


def distribution_of(module: str) -> str | None:
    """The installed distribution providing ``module`` (its longest importable prefix); NAMESPACE for a
    namespace package such as ``google.cloud``, which many distributions share."""
    parts = module.split(".")
    for depth in range(len(parts), 0, -1):
        try:
            spec = importlib.util.find_spec(".".join(parts[:depth]))
        except (ImportError, ValueError):
            continue
        if spec is not None and spec.origin is None and spec.submodule_search_locations:
            return NAMESPACE
        if spec is not None and spec.origin and spec.origin not in ("built-in", "frozen"):
            return _distribution_of_file().get(Path(spec.origin).resolve())
    return None


def requirement_closure(requirements: Path) -> set[str]:
    """The distributions ``pip install -r requirements`` brings: the listed ones and their dependencies."""
    pending = [
        Requirement(line.strip())
        for line in requirements.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    seen: set[str] = set()
    while pending:
        req = pending.pop()
        name = req.name.lower().replace("_", "-")
        if name in seen:
            continue
        seen.add(name)
        for dep in metadata.requires(name) or ():
            dep_req = Requirement(dep)
            if dep_req.marker is None or dep_req.marker.evaluate({"extra": ""}):
                pending.append(dep_req)
    return seen


@pytest.mark.integration
def test_requirements_provide_every_third_party_module_the_functions_import() -> None:
    closure = requirement_closure(REPO / "functions" / "requirements.txt")
    sources = {"main": REPO / "functions" / "main.py", **runtime_modules()}
    missing: dict[str, set[str]] = {}
    for name, source in sources.items():
        package = name if source.name == "__init__.py" else name.rpartition(".")[0]
        for imported in _imports(source, package):
            top = imported.split(".")[0]
            if not top or top in sys.stdlib_module_names or top in ("retrain", "__future__"):
                continue
            dist = distribution_of(imported)
            assert dist is not None, f"{name} imports {imported}, which no installed distribution provides"
            if dist != NAMESPACE and dist not in closure:
                missing.setdefault(dist, set()).add(name)
    assert not missing, f"functions/requirements.txt lacks {missing}"


@pytest.mark.integration
def test_a_served_function_imports_the_built_copy_and_nothing_left_out(tmp_path: Path) -> None:
    """The local stack serves functions as deployed (``AS_DEPLOYED``, the built folder on PYTHONPATH):
    ``retrain`` is the built copy, even beside this checkout's editable install, and what was left out
    does not exist for the function."""
    built = deployed_functions_source(tmp_path)
    assert built == tmp_path.resolve() / "functions-source" and (built / "main.py").is_file()
    probe = (
        "import retrain, retrain.ingest, retrain.steps, retrain.adapters.cluster, importlib.util as u\n"
        "print(retrain.__file__)\n"
        "left_out = ('retrain_local', 'cloudworkflows', 'retrain_ops', 'retrain_tokenize')\n"
        "print([m for m in left_out if u.find_spec(m)])\n"
    )
    code = AS_DEPLOYED.replace(
        "runpy.run_module('functions_framework', run_name='__main__', alter_sys=True)", probe
    )
    assert code != AS_DEPLOYED
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "PYTHONPATH": str(built)},
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,  # the checkout's own folder: `python -c` would put it first on the path
    ).stdout.splitlines()
    assert out == [str(built / "retrain" / "__init__.py"), "[]"]
