"""The Cloud Functions source ``retrain deploy`` uploads: ``functions/main.py`` and the runtime package
``retrain/`` whole, and ``functions/requirements.txt`` provides every third-party module those import."""

from __future__ import annotations

import ast
import importlib.metadata as metadata
import importlib.util
import os
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from retrain_local import processes
from retrain_local.forkserver import ForkServer
from retrain_local.serverless import (
    AS_DEPLOYED,
    FUNCTION_PRELOAD,
    deployed_functions_source,
    function_fork_server,
    function_server,
)

REPO = Path(__file__).resolve().parents[1]


def children_of(pid: int) -> list[int]:
    """The processes whose parent is ``pid``."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
        except OSError:  # gone meanwhile
            continue
    return found


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
@pytest.mark.parametrize("forked", [False, True], ids=["fresh", "forked"])
def test_a_served_function_imports_the_built_copy_and_nothing_left_out(tmp_path: Path, forked: bool) -> None:
    """The local stack serves functions as deployed (``AS_DEPLOYED``, the built folder on PYTHONPATH):
    ``retrain`` is the built copy, even beside this checkout's editable install, and what was left out
    does not exist for the function; forked from the functions' fork server as started afresh, though
    the server itself runs from this checkout (``retrain_local.forkserver``, imported) and preloads
    ``retrain`` from it."""
    built = deployed_functions_source(tmp_path)
    assert built == tmp_path.resolve() / "functions-source" and (built / "main.py").is_file()
    probe = (
        "import retrain, retrain.ingest, retrain.steps, retrain.adapters.cluster, importlib.util as u\n"
        "print(retrain.__file__)\n"
        "left_out = ('retrain_local', 'cloudworkflows', 'retrain_ops', 'retrain_tokenize')\n"
        "print([m for m in left_out if u.find_spec(m)])\n"
        "print(sys.path[: len(first)] == first, sys.path.count(first[0]))\n"
    )
    code = AS_DEPLOYED.replace(
        "runpy.run_module('functions_framework', run_name='__main__', alter_sys=True)", probe
    )
    assert code != AS_DEPLOYED
    env = {**os.environ, "PYTHONPATH": str(built)}
    if forked:
        script = tmp_path / "launcher" / "probe.py"
        script.parent.mkdir()
        script.write_text(code)
        forks = ForkServer(("retrain.ingest", *FUNCTION_PRELOAD[:2]), tmp_path / "forks.log").start()
        argv = [
            sys.executable,
            "-m",
            "retrain_local.forkserver",
            "--run",
            str(forks.socket_path),
            str(script),
        ]
    else:
        argv = [sys.executable, "-c", code]
    try:
        # from the checkout's own folder: `python -c` would put it first on the path
        done = subprocess.run(argv, env=env, capture_output=True, text=True, cwd=REPO, timeout=120)
    finally:
        if forked:
            forks.stop()
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [str(built / "retrain" / "__init__.py"), "[]", "True 1"]


@pytest.mark.integration
def test_a_function_forked_from_the_fork_server_serves_and_stops_as_a_started_one(tmp_path: Path) -> None:
    """A function the stack forks (``function_server`` given the fork server) answers on its port as
    functions-framework, and its stop (SIGTERM to the process started for it) ends the function's whole
    process group, so that its port is free for the instance started after it."""
    forks = function_fork_server(tmp_path / "forks.log").start()
    env = {**os.environ, "RETRAIN_PROJECT": "p"}
    try:
        proc, url = processes.start_on_a_free_port(
            lambda port: function_server("run_http", tmp_path / "fn.log", env, "http", port, forks),
            lambda p: p.start(120),
        )
        assert forks.proc is not None and proc.proc is not None
        (forked,) = children_of(forks.proc.pid)  # the function is the fork server's child, not ours
        assert children_of(proc.proc.pid) == []
        with pytest.raises(urllib.error.HTTPError) as answer:  # functions/main.py's own answer to a GET
            urllib.request.urlopen(url + "/", timeout=10)
        assert answer.value.code == 405 and b"POST a JSON object" in answer.value.read()
        proc.stop()
        assert proc.proc.returncode == 0  # gunicorn's arbiter ends its worker and exits 0 on SIGTERM
        with pytest.raises(ProcessLookupError):
            os.killpg(forked, 0)  # the function's whole group went with it
        # and its port is free again for a server (gunicorn sets SO_REUSEADDR: the GET's connection waits
        # out its TIME_WAIT)
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", int(url.rsplit(":", 1)[1])))
            s.listen()
    finally:
        forks.stop()
