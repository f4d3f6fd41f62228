"""The layout is the architecture: the domain depends on nothing outside it, adapters are built in
one place, and outcomes are enums.  Read from the source with ``ast``, so a new import that breaks
the rule fails here."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RETRAIN = REPO / "retrain"  # the runtime: what the functions, run_step and the notifier run
TOKENIZER = REPO / "retrain_tokenize"  # the Dataflow image's tokenizer
OPS = REPO / "retrain_ops"  # the operator's CLI and tooling
LOCAL = REPO / "retrain_local"  # the local stack, its twins and stand-ins
INTERPRETER = REPO / "cloudworkflows"  # the Workflows interpreter
PACKAGES = (RETRAIN, TOKENIZER, OPS, LOCAL, INTERPRETER)

#: Which of the project's packages each may import: the runtime ships to the functions whole, so it
#: imports none of the others; the tokenizer ships beside it in the Dataflow image; the local stack
#: plays the cloud for the tools and the runtime alike.
MAY_IMPORT = {
    RETRAIN.name: set(),
    TOKENIZER.name: {RETRAIN.name},
    OPS.name: {RETRAIN.name, TOKENIZER.name, LOCAL.name},  # LOCAL: from cli.py only (below)
    LOCAL.name: {RETRAIN.name, TOKENIZER.name, OPS.name, INTERPRETER.name},
    INTERPRETER.name: set(),
}
#: The deployed entry points and the package each runs.
ENTRY_POINTS = {REPO / "functions" / "main.py": RETRAIN.name, REPO / "dataflow" / "main.py": TOKENIZER.name}


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
        "retrain_local",
        "retrain.adapters",
    )
    ingest = sorted((RETRAIN / "ingest").glob("*.py"))
    assert ingest, "retrain/ingest/ has moved: this rule must follow it"
    for path in [*ingest, RETRAIN / "ports.py", RETRAIN / "contracts.py"]:
        for module in imports(path):
            assert not module.startswith(forbidden), f"{path.relative_to(RETRAIN)} imports {module}"


def test_adapters_are_built_only_in_the_composition_root() -> None:
    adapters = ("FirestoreLedger(", "WorkflowsExecutions(", "GkeCluster(")
    for path in RETRAIN.rglob("*.py"):
        if path.name == "composition.py" or "adapters" in path.relative_to(RETRAIN).parts:
            continue
        text = path.read_text()
        assert not any(a in text for a in adapters), f"{path.relative_to(REPO)} builds an adapter itself"


def _ours(path: Path) -> set[str]:
    """The project's packages a file imports (at any depth, lazily or not)."""
    return {m.split(".")[0] for m in imports(path)} & set(MAY_IMPORT)


def test_each_package_imports_only_what_ships_with_it() -> None:
    """Packages by what ships: ``retrain_ops.deploy`` uploads ``retrain/`` whole as the functions' source,
    and the images copy their packages (k8s/Dockerfile: ``retrain/``; dataflow/Dockerfile: ``retrain/`` and
    ``retrain_tokenize/``), so a package that imported one that does not ship with it would fail there,
    not here."""
    for package in PACKAGES:
        for path in sorted(package.rglob("*.py")):
            beyond = sorted(_ours(path) - MAY_IMPORT[package.name] - {package.name})
            assert beyond == [], f"{path.relative_to(REPO)} imports {beyond}"
    for path, package in ENTRY_POINTS.items():
        beyond = sorted(_ours(path) - MAY_IMPORT[package] - {package})
        assert beyond == [], f"{path.relative_to(REPO)} imports {beyond}"


def test_the_rule_finds_an_import_that_does_not_ship(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from retrain_ops.deployment import Deployment\n")
    assert _ours(module) - MAY_IMPORT[RETRAIN.name] == {OPS.name}


def test_only_the_operators_cli_reaches_into_the_local_stack() -> None:
    """The local stack (``retrain_local``: twins, emulators, fronts) is scaffolding: of what deploys or
    deploys it, only the operator's CLI (``retrain up``, ``retrain demo``) imports it, so a deployment
    reading infra/ does not drag in the twins, and the stack can change without touching it."""
    for path in sorted(p for package in (RETRAIN, TOKENIZER, OPS) for p in package.rglob("*.py")):
        if path == OPS / "cli.py":
            continue
        assert LOCAL.name not in _ours(path), f"{path.relative_to(REPO)} imports the local stack"


def test_outcomes_are_enums_not_prose() -> None:
    """No branch in ingest's jobs compares against a string literal: verdicts and actions are enums."""
    for path in sorted((RETRAIN / "ingest").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare) and any(isinstance(op, (ast.Eq, ast.NotEq)) for op in node.ops):
                for side in (node.left, *node.comparators):
                    literal = isinstance(side, ast.Constant) and isinstance(side.value, str)
                    assert not literal, f"{path.name}: {ast.unparse(node)}"


def _module_name(path: Path, base: Path) -> str:
    parts = path.relative_to(base).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_imports(path: Path, package: str, known: set[str]) -> set[str]:
    """The retrain modules a file imports when it runs (at any depth, lazy imports too; not what only the
    type checker reads under ``if TYPE_CHECKING:``), each resolved to the module that holds it."""
    tree = ast.parse(path.read_text())
    skipped = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
        for stmt in node.body
        for n in ast.walk(stmt)
    }
    named: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            named.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            named.add(base)
            named.update(f"{base}.{a.name}" for a in node.names)
    out = set()
    for name in named:
        while name and name not in known:
            name = name.rpartition(".")[0]
        out.add(name)
    return out - {""}


def import_cycles(*roots: Path) -> list[list[str]]:
    """Groups of the packages' modules (``roots``; retrain's by default) that import each other in a
    circle (Tarjan's strongly connected components of more than one module).  Not counted: a package and
    its own modules (an ``__init__`` that imports its modules, lazily or not, to offer them, as
    ``retrain.trainers`` does its profiles)."""
    files = {_module_name(p, root.parent): p for root in roots or (RETRAIN,) for p in root.rglob("*.py")}
    graph = {
        name: {
            d
            for d in _runtime_imports(
                path, name if path.name == "__init__.py" else name.rpartition(".")[0], set(files)
            )
            if d != name and not name.startswith(d + ".") and not d.startswith(name + ".")
        }
        for name, path in files.items()
    }
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_no_two_modules_import_each_other_even_lazily() -> None:
    """A circle (a CLI inside a library importing the composition root that builds it, two local
    services each reaching into the other) means neither can be read, tested or moved alone."""
    assert import_cycles(*PACKAGES) == []


def test_a_circle_is_found_through_a_lazy_import_but_not_through_type_checking(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("def plugins():\n    from pkg.sub import b\n")  # its own
    (pkg / "a.py").write_text("from pkg.sub.b import thing\n")
    (pkg / "sub" / "b.py").write_text("from pkg.c import helper\nthing = 1\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import a\n")
    assert import_cycles(pkg) == []
    (pkg / "c.py").write_text("def helper():\n    from pkg import a\n")  # lazily, at call time
    assert import_cycles(pkg) == [["pkg.a", "pkg.c", "pkg.sub.b"]]


#: Units past the size budget, each with its size today, which can only shrink: the parsers, the one literal
#: manifest and the settings read best whole.  A unit not listed stays within the budget.
FUNCTION_LINES, CLASS_LINES = 80, 300
OVER_BUDGET = {
    # parsers, and the one literal manifest
    "cloudworkflows/syntax.py:_Builder": 335,
    "cloudworkflows/expressions.py:tokenize": 83,
    "retrain_ops/hcl.py:Evaluator.eval": 82,
    "retrain_ops/cli.py:build_parser": 109,
    "retrain/k8s/render.py:render_jobset": 127,
    "retrain/config.py:Settings": 328,  # one typed place for every setting, each documented
}


def unit_sizes(root: Path = RETRAIN) -> dict[str, int]:
    """Every function (methods included) past FUNCTION_LINES and class past CLASS_LINES under ``root``, by
    ``path:qualified.name`` (the path from ``root``'s parent), with its length in lines."""
    out = {}

    def visit(node: ast.AST, path: str, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                limit = CLASS_LINES if isinstance(child, ast.ClassDef) else FUNCTION_LINES
                length = (child.end_lineno or child.lineno) - child.lineno + 1
                if length > limit:
                    out[f"{path}:{name}"] = length
                visit(child, path, f"{name}.")
            else:
                visit(child, path, prefix)

    for path in sorted(root.rglob("*.py")):
        visit(ast.parse(path.read_text()), path.relative_to(root.parent).as_posix(), "")
    return out


def test_no_unit_grows_past_its_budget() -> None:
    """No function over about 80 lines and no class over about 300, but those listed, none of which grows;
    one that shrank within the budget leaves the list."""
    sizes: dict[str, int] = {}
    for package in PACKAGES:
        sizes |= unit_sizes(package)
    grown = {k: (n, OVER_BUDGET.get(k)) for k, n in sizes.items() if n > OVER_BUDGET.get(k, 0)}
    assert grown == {}, (
        "past the budget (lines, listed): split it, or say in OVER_BUDGET why it reads best whole"
    )
    assert sorted(set(OVER_BUDGET) - set(sizes)) == [], (
        "within the budget now (or gone): drop from OVER_BUDGET"
    )


def test_the_budget_finds_a_long_function_and_a_long_class(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    long_function = "def long():\n" + "    x = 1\n" * 80
    big_class = "class Big:\n" + "    y = 2\n" * 300
    (pkg / "m.py").write_text(f"def short():\n    pass\n\n\n{long_function}\n\n{big_class}")
    assert unit_sizes(pkg) == {"pkg/m.py:long": 81, "pkg/m.py:Big": 301}
    method = "    def run(self):\n" + "        z = 3\n" * 80
    (pkg / "n.py").write_text(f"class A:\n{method}\n\nclass B:\n{method}")  # two run()s: each by its class
    assert unit_sizes(pkg) == {
        "pkg/m.py:long": 81,
        "pkg/m.py:Big": 301,
        "pkg/n.py:A.run": 81,
        "pkg/n.py:B.run": 81,
    }


def test_the_run_record_has_one_python_writer() -> None:
    """Only the ledger's adapter names the ``runs`` collection, and the run store takes typed changes
    (:mod:`retrain.domain.transitions`), never a mapping of fields to patch."""
    for path in [*(p for package in PACKAGES for p in package.rglob("*.py")), REPO / "functions" / "main.py"]:
        if "ledger" in path.relative_to(REPO).parts:
            continue
        assert 'collection("runs")' not in path.read_text(), f"{path.relative_to(REPO)} writes run records"
    ports = ast.parse((RETRAIN / "ports.py").read_text())
    store = next(n for n in ports.body if isinstance(n, ast.ClassDef) and n.name == "RunStore")
    for method in (n for n in store.body if isinstance(n, ast.FunctionDef)):
        for arg in method.args.args:
            annotation = ast.unparse(arg.annotation) if arg.annotation else ""
            assert "Mapping" not in annotation and "dict" not in annotation, (
                f"RunStore.{method.name}({arg.arg})"
            )
