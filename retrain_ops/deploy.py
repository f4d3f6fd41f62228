"""``retrain deploy``: apply ``infra/`` with Terraform, stage by stage (bootstrap, platform, app).

Each selected stage runs ``terraform -chdir=infra/<stage> init``, ``plan -out=<plan file>`` and,
unless ``--dry-run``, ``apply <plan file>``: what is applied is exactly what was planned (and shown).
The outputs of every stage run so far (``terraform output -json``; with ``--dry-run`` the plan's
known planned outputs) become ``-var`` values of a later stage wherever that stage declares a
variable of the same name (the declared variables are read from its ``*.tf`` files), e.g. the
bootstrap's ``state_bucket`` for the app stage. The state bucket is also the ``-backend-config`` of
every stage with a ``backend`` block.

Before the app stage the Cloud Functions source is assembled in ``build/functions/``
(``functions/main.py``, ``functions/requirements.txt`` and a copy of the ``retrain`` package, which
the functions import); the app stage zips that folder (``functions_source_dir``).  The Kubernetes
manifests are rendered there too, from the platform stage's outputs, into ``build/k8s/``
(``retrain_ops.manifests``; what the app stage applies, ``k8s_manifests_dir``).

Inputs are validated before Terraform runs at all. Progress goes to stderr, with elapsed times;
``--dry-run`` prints what would change per stage on stdout. A failing step stops the run, names
its stage and step, and shows the tail of Terraform's stderr. Exit status: 0 success, 1 a
Terraform step failed or the apply was declined, 2 invalid input, 130 interrupted.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import retrain

STAGES: tuple[str, ...] = ("bootstrap", "platform", "app")
FUNCTIONS_BUILD_DIR = "build/functions"
"""Where the function source is assembled, relative to the repository root (what infra/app zips)."""
K8S_BUILD_DIR = "build/k8s"
"""Where the k8s/ templates are rendered for this deployment (what infra/app applies)."""

# Google Cloud project ids: 6-30 characters, lowercase letters, digits and hyphens, starting with a
# letter and not ending with a hyphen (the same rule as infra/bootstrap's validation).
PROJECT_RE = re.compile(r"[a-z][a-z0-9-]{4,28}[a-z0-9]")
# Regions such as us-central1, europe-west4, northamerica-northeast1 (not zones: us-central1-a).
REGION_RE = re.compile(r"[a-z]+(?:-[a-z]+)+[0-9]{1,2}")
# Bucket names without dots: 3-63 characters.
BUCKET_RE = re.compile(r"[a-z0-9][a-z0-9_-]{1,61}[a-z0-9]")
# --var [STAGE:]KEY=VALUE; KEY is a Terraform identifier.
VAR_RE = re.compile(r"(?:(?P<stage>[a-z]+):)?(?P<key>[A-Za-z_][A-Za-z0-9_-]*)=(?P<value>.*)", re.DOTALL)
# Set through their own options, never through --var.
RESERVED_VARS = {"project_id": "--project", "region": "--region", "state_bucket": "--state-bucket"}

_TAIL_LINES = 25
_VENDOR_IGNORE = {"__pycache__", "tests", ".mypy_cache", ".pytest_cache", ".ruff_cache"}


class UsageError(Exception):
    """Invalid input, found before any Terraform call (exit status 2)."""


class StepFailed(Exception):
    """A Terraform step exited non-zero (exit status 1)."""

    def __init__(self, stage: str, step: str, returncode: int, tail: Sequence[str]):
        super().__init__(f"{stage}: {step} failed (terraform exited {returncode})")
        self.stage = stage
        self.step = step
        self.returncode = returncode
        self.tail = list(tail)


class Declined(Exception):
    """The apply was not confirmed (exit status 1)."""


# ---------------------------------------------------------------------------------------------
# Stages as declared in infra/<stage>/*.tf
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Stage:
    name: str
    path: Path
    variables: frozenset[str]
    """Variables the stage declares (a -var for anything else is an error in Terraform)."""
    has_backend: bool
    """The stage has a (partial) ``backend`` block, so init needs the state bucket."""


def _unquote(value: str) -> str:
    # python-hcl2 >= 7 keeps the quotes of block labels.
    return value[1:-1] if len(value) >= 2 and value[0] == value[-1] == '"' else value


_VARIABLE_BLOCK = re.compile(r'^variable\s+"?([A-Za-z_][A-Za-z0-9_-]*)"?\s*\{', re.MULTILINE)
_BACKEND_BLOCK = re.compile(r'^\s*backend\s+"?[a-z0-9_]+"?\s*\{', re.MULTILINE)


def _parse_tf(text: str, path: Path) -> tuple[set[str], bool]:
    """(declared variables, has a backend block) of one .tf file."""
    try:
        from retrain_ops import hcl  # python-hcl2's parse, kept by content (lark's parse is slow)
    except ImportError:  # python-hcl2 or lark missing: fall back to the two block headers we need
        return set(_VARIABLE_BLOCK.findall(text)), bool(_BACKEND_BLOCK.search(text))
    try:
        doc = hcl.parse(text)
    except Exception as e:
        raise UsageError(f"cannot parse {path}: {e}") from e
    variables = {_unquote(name) for entry in doc.get("variable", []) for name in entry}
    backend = any("backend" in block for block in doc.get("terraform", []))
    return variables, backend


def load_stage(infra: Path, name: str) -> Stage:
    path = infra / name
    files = sorted(path.glob("*.tf"))
    if not files:
        raise UsageError(f"{path}: no Terraform files (is --root the repository checkout?)")
    variables: set[str] = set()
    backend = False
    for f in files:
        v, b = _parse_tf(f.read_text(encoding="utf-8"), f)
        variables |= v
        backend = backend or b
    return Stage(name, path, frozenset(variables), backend)


# ---------------------------------------------------------------------------------------------
# Outputs -> variables, plans -> summaries
# ---------------------------------------------------------------------------------------------


def var_value(value: Any) -> str:
    """A -var value for an output value: strings as they are, anything else as an HCL literal."""
    if isinstance(value, str):
        return value
    return json.dumps(value)  # JSON numbers, bools, lists and objects are valid HCL expressions


def forwarded_vars(
    outputs: Mapping[str, Mapping[str, Any]], declared: Iterable[str]
) -> tuple[dict[str, str], list[str]]:
    """The -var values a stage declaring ``declared`` gets from earlier outputs.

    ``outputs`` has the shape of ``terraform output -json``: ``{name: {"sensitive", "type",
    "value"}}``. Outputs without a (known) value are left out, so are sensitive ones (they would
    show on the command line); the second element names the declared ones left out that way.
    """
    result: dict[str, str] = {}
    withheld: list[str] = []
    for name in sorted(set(declared) & outputs.keys()):
        entry = outputs[name]
        if entry.get("sensitive"):
            withheld.append(name)
        elif "value" in entry and entry["value"] is not None:
            result[name] = var_value(entry["value"])
    return result, withheld


def planned_outputs(plan: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Outputs whose values a plan already knows (``terraform show -json`` planned_values)."""
    outputs = (plan.get("planned_values") or {}).get("outputs") or {}
    return {k: dict(v) for k, v in outputs.items() if isinstance(v, Mapping) and "value" in v}


ACTION_ORDER = ("create", "update", "replace", "delete")
_SYMBOL = {"create": "+", "update": "~", "replace": "-/+", "delete": "-"}


@dataclass
class PlanSummary:
    changes: dict[str, list[str]] = field(default_factory=lambda: {a: [] for a in ACTION_ORDER})
    outputs_changed: list[str] = field(default_factory=list)

    @property
    def has_changes(self) -> bool:
        return any(self.changes.values()) or bool(self.outputs_changed)

    def counts(self) -> dict[str, int]:
        return {a: len(addrs) for a, addrs in self.changes.items()}

    def lines(self, stage: str) -> list[str]:
        if not self.has_changes:
            return [f"{stage}: no changes"]
        c = self.counts()
        head = f"{stage}: " + ", ".join(
            f"{c[a]} to {a}" for a in ACTION_ORDER if a in ("create", "update", "delete") or c[a]
        )
        body = [f"  {_SYMBOL[a]:>3} {addr}" for a in ACTION_ORDER for addr in self.changes[a]]
        if self.outputs_changed:
            body.append(f"  outputs changing: {', '.join(self.outputs_changed)}")
        return [head, *body]


def summarize_plan(plan: Mapping[str, Any]) -> PlanSummary:
    """Counts and addresses per action from ``terraform show -json PLAN``'s resource_changes."""
    summary = PlanSummary()
    for rc in plan.get("resource_changes") or []:
        actions = tuple((rc.get("change") or {}).get("actions") or ())
        if actions in (("delete", "create"), ("create", "delete")):
            action = "replace"
        elif len(actions) == 1 and actions[0] in ("create", "update", "delete"):
            action = actions[0]
        else:  # no-op, read (data sources), forget
            continue
        summary.changes[action].append(str(rc.get("address", "?")))
    for name, oc in sorted((plan.get("output_changes") or {}).items()):
        actions = tuple((oc or {}).get("actions") or ())
        if actions and actions != ("no-op",):
            summary.outputs_changed.append(name)
    return summary


# ---------------------------------------------------------------------------------------------
# The function source folder
# ---------------------------------------------------------------------------------------------


def build_functions_source(root: Path, dest: Path | None = None) -> Path:
    """Assemble what infra/app zips and uploads: main.py, requirements.txt and the runtime package
    ``retrain/`` whole, its data (``resources/``, ``py.typed``) included.  What does not ship to the
    functions lives in packages of its own (``retrain_ops``, ``retrain_tokenize``, ``retrain_local``,
    ``cloudworkflows``), which ``retrain`` never imports (tests/test_architecture.py).

    The folder is rebuilt from scratch every time, so nothing stale (or anything else) is uploaded.
    """
    src = root / "functions"
    dest = dest or root / FUNCTIONS_BUILD_DIR
    for needed in (src / "main.py", src / "requirements.txt"):
        if not needed.is_file():
            raise UsageError(f"{needed} is missing: the function source cannot be built")
    package = root / "retrain"
    if not (package / "__init__.py").is_file():
        package = Path(retrain.__file__).resolve().parent  # an installed retrain without the checkout's copy
    staging = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    shutil.copy2(src / "main.py", staging / "main.py")
    shutil.copy2(src / "requirements.txt", staging / "requirements.txt")
    shutil.copytree(package, staging / "retrain", ignore=_vendor_ignore)
    for folder in sorted((staging / "retrain").rglob("*"), reverse=True):  # deepest first
        if folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()  # a moved module's folder, which held only its __pycache__
    shutil.rmtree(dest, ignore_errors=True)
    staging.rename(dest)
    return dest


def _vendor_ignore(_dir: str, names: list[str]) -> set[str]:
    return {
        n for n in names if n in _VENDOR_IGNORE or n.endswith((".pyc", ".pyo")) or n.endswith(".egg-info")
    }


# ---------------------------------------------------------------------------------------------
# Running terraform
# ---------------------------------------------------------------------------------------------


#: Beside the rendered manifests: the project they were rendered for (infra/app refuses any other).
RENDERED_FOR = ".rendered-for"


def render_manifests(root: Path, carried: Mapping[str, Any], app_vars: Mapping[str, str]) -> str | None:
    """Render k8s/ into build/k8s from the platform stage's outputs (``terraform output -json`` shape),
    stamped with the project they are for; None when they are, or why not (an output not known)."""
    from retrain_ops.deployment import manifest_values
    from retrain_ops.manifests import write

    platform = {k: (v or {}).get("value") for k, v in carried.items()}
    try:
        values = manifest_values(platform, app_vars)
    except (KeyError, TypeError) as e:
        return str(e)
    dest = root / K8S_BUILD_DIR
    write(values, dest, root / "k8s")
    (dest / RENDERED_FOR).write_text(values.project + "\n")
    return None


def platform_outputs(tf: Terraform, stage: Stage, state_bucket: str | None) -> dict[str, Any]:
    """The applied platform stage's outputs (``terraform output -json``), for an app stage run alone."""
    if not state_bucket:
        raise UsageError("the app stage reads the platform stage's outputs: pass --state-bucket")
    tf.run(stage, "init", ["init", "-input=false", f"-backend-config=bucket={state_bucket}"])
    outputs = tf.json(stage, "output", ["output", "-json"]) or {}
    if not outputs:
        raise UsageError(
            "the platform stage has no outputs: apply it first (retrain deploy --stage platform)"
        )
    return dict(outputs)


def images_for_app(
    opts: Options, carried: Mapping[str, Any], progress: Progress, workdir: Path
) -> dict[str, str]:
    """The app stage's image variables (this project's images, by digest): given with --var, or built now
    by Cloud Build (retrain_ops.builds). A dry run builds nothing, so it needs them given."""
    from retrain_ops import builds

    given = {
        k: v for scope, k, v in opts.user_vars if scope in (None, "app") and k in builds.IMAGE_VARS.values()
    }
    missing = sorted(set(builds.IMAGE_VARS.values()) - set(given))
    if not missing:
        return given
    if opts.dry_run:
        raise UsageError(
            f"a dry run builds no image, and the app stage runs {', '.join(missing)} by digest: pass "
            + " ".join(f"--var {m}=IMAGE@sha256:..." for m in missing)
            + " (the last deploy's: terraform -chdir=infra/app output)"
        )
    outputs = {k: (v or {}).get("value") for k, v in carried.items()}
    accounts = outputs.get("service_accounts") or {}
    needed = {
        "artifact_registry": outputs.get("artifact_registry"),
        "service_accounts.builder": accounts.get("builder"),
        "function_sources_bucket": outputs.get("function_sources_bucket"),
    }
    unknown = [k for k, v in needed.items() if not v]
    if unknown:
        raise UsageError(
            f"building the images needs the platform outputs {', '.join(unknown)}: apply platform first"
        )
    progress.say(f"app: build {', '.join(builds.IMAGE_VARS)} with Cloud Build (tag: this commit)")
    try:
        built = builds.build_images(
            opts.root,
            project=opts.project,
            region=opts.region,
            registry=str(needed["artifact_registry"]),
            service_account=str(needed["service_accounts.builder"]),
            staging=f"gs://{needed['function_sources_bucket']}/image-sources",
            workdir=workdir,
            say=progress.say,
        )
    except builds.BuildError as e:
        raise UsageError(str(e)) from e
    for var, ref in built.items():
        progress.say(f"app: {var} = {ref}")
    return {**built, **given}


def _fmt_s(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f}s"
    m, s = divmod(int(seconds), 60)
    return f"{m}m{s:02d}s" if m < 60 else f"{m // 60}h{m % 60:02d}m{s:02d}s"


class Progress:
    def __init__(self, stream: IO[str] | None = None):
        self.stream = stream or sys.stderr
        self.started = time.monotonic()

    def say(self, msg: str) -> None:
        elapsed = _fmt_s(time.monotonic() - self.started)
        print(f"[deploy {elapsed:>7}] {msg}", file=self.stream, flush=True)

    def echo(self, line: str) -> None:
        self.stream.write(f"    | {line}")
        if not line.endswith("\n"):
            self.stream.write("\n")
        self.stream.flush()


def _pump(stream: IO[str], echo: Any, keep: collections.deque[str] | None, buf: list[str] | None) -> None:
    for line in iter(stream.readline, ""):
        if echo is not None:
            echo(line)
        if keep is not None:
            keep.append(line.rstrip("\n"))
        if buf is not None:
            buf.append(line)
    stream.close()


class Terraform:
    def __init__(self, binary: str, root: Path, progress: Progress, *, color: bool):
        self.binary = binary
        self.root = root
        self.progress = progress
        self.color = color
        self.env = {**os.environ, "TF_IN_AUTOMATION": "1", "TF_INPUT": "0"}

    def run(self, stage: Stage, step: str, args: Sequence[str], *, capture: bool = False) -> str:
        """Run one terraform command in ``stage``; its stdout is echoed (or returned if ``capture``).

        Raises StepFailed with the tail of stderr when it exits non-zero.
        """
        rel = stage.path.relative_to(self.root) if stage.path.is_relative_to(self.root) else stage.path
        args = list(args)
        if not self.color and args and args[0] in ("init", "plan", "apply"):
            args.insert(1, "-no-color")  # options go before a positional plan file
        argv = [self.binary, f"-chdir={rel.as_posix()}", *args]
        self.progress.say(f"{stage.name}: {step} ...")
        t0 = time.monotonic()
        tail: collections.deque[str] = collections.deque(maxlen=_TAIL_LINES)
        out: list[str] = []
        proc = subprocess.Popen(
            argv,
            cwd=self.root,
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            encoding="utf-8",
            errors="replace",
        )
        assert proc.stdout is not None and proc.stderr is not None
        threads = [
            threading.Thread(
                target=_pump,
                args=(proc.stdout, None if capture else self.progress.echo, None, out if capture else None),
                daemon=True,
            ),
            threading.Thread(target=_pump, args=(proc.stderr, self.progress.echo, tail, None), daemon=True),
        ]
        for t in threads:
            t.start()
        try:
            rc = proc.wait()
        except KeyboardInterrupt:
            # terraform received the same SIGINT and stops gracefully (releasing its state lock):
            # give it the time to do so before reporting.
            try:
                proc.wait(timeout=120)
            except (KeyboardInterrupt, subprocess.TimeoutExpired):
                proc.kill()
                proc.wait()
            raise
        finally:
            for t in threads:
                t.join(timeout=10)
        took = _fmt_s(time.monotonic() - t0)
        if rc != 0:
            self.progress.say(f"{stage.name}: {step} FAILED after {took} (exit {rc})")
            raise StepFailed(stage.name, step, rc, tail)
        self.progress.say(f"{stage.name}: {step} done in {took}")
        return "".join(out)

    def json(self, stage: Stage, step: str, args: Sequence[str]) -> Any:
        text = self.run(stage, step, args, capture=True)
        try:
            return json.loads(text or "null")
        except json.JSONDecodeError as e:
            raise StepFailed(stage.name, step, 0, [f"not JSON: {e}", *text.splitlines()[-5:]]) from e


# ---------------------------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------------------------


def _default_root() -> Path:
    checkout = Path(__file__).resolve().parents[1]
    if (checkout / "infra").is_dir():
        return checkout
    return Path.cwd()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="retrain deploy",
        description=(
            "Deploy retrain to a Google Cloud project with Terraform: init, plan and apply "
            "infra/bootstrap, infra/platform and infra/app in that order, each stage's outputs "
            "feeding the next stage's variables."
        ),
    )
    p.add_argument("--project", required=True, help="Google Cloud project id (project_id)")
    p.add_argument("--region", required=True, help="region, e.g. us-central1 (region)")
    p.add_argument(
        "--stage",
        dest="stages",
        action="extend",
        nargs="+",
        choices=STAGES,
        metavar="STAGE",
        help="only these stages (bootstrap, platform, app; repeatable; always run in that order)",
    )
    p.add_argument(
        "--dry-run", action="store_true", help="init and plan only; print what would change per stage"
    )
    p.add_argument(
        "--auto-approve",
        action="store_true",
        help="apply without asking (required when stdin is not a terminal, e.g. in CI)",
    )
    p.add_argument(
        "--var",
        dest="vars",
        action="append",
        default=[],
        metavar="[STAGE:]KEY=VALUE",
        help=(
            "a Terraform variable for every selected stage that declares KEY (or only for STAGE); "
            "repeatable; lists and maps in HCL syntax"
        ),
    )
    p.add_argument(
        "--state-bucket",
        help="Terraform state bucket (default: the bootstrap stage's state_bucket output)",
    )
    p.add_argument(
        "--root",
        type=Path,
        default=None,
        help="repository checkout holding infra/ and functions/ (default: this package's checkout)",
    )
    return p


@dataclass
class Options:
    project: str
    region: str
    stages: list[str]
    dry_run: bool
    auto_approve: bool
    user_vars: list[tuple[str | None, str, str]]
    state_bucket: str | None
    root: Path


def _interactive() -> bool:
    """Can we ask for a confirmation? Not in CI, and only with a terminal on stdin and stderr."""
    if os.environ.get("CI", "").lower() not in ("", "0", "false"):
        return False
    try:
        return sys.stdin.isatty() and sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


def validate(args: argparse.Namespace) -> Options:
    if not PROJECT_RE.fullmatch(args.project):
        raise UsageError(
            f"invalid project id {args.project!r}: 6-30 characters, lowercase letters, digits and "
            "hyphens, starting with a letter and not ending with a hyphen"
        )
    if not REGION_RE.fullmatch(args.region):
        raise UsageError(
            f"invalid region {args.region!r}: expected a region such as us-central1 (not a zone)"
        )
    if args.state_bucket is not None and not BUCKET_RE.fullmatch(args.state_bucket):
        raise UsageError(
            f"invalid --state-bucket {args.state_bucket!r}: 3-63 lowercase letters, digits, - and _"
        )
    user_vars: list[tuple[str | None, str, str]] = []
    for raw in args.vars:
        m = VAR_RE.fullmatch(raw)
        if m is None:
            raise UsageError(f"invalid --var {raw!r}: expected [STAGE:]KEY=VALUE, KEY a Terraform identifier")
        stage, key = m["stage"], m["key"]
        if stage is not None and stage not in STAGES:
            raise UsageError(f"invalid --var {raw!r}: unknown stage {stage!r} (one of {', '.join(STAGES)})")
        if key in RESERVED_VARS:
            raise UsageError(f"--var {key}=...: use {RESERVED_VARS[key]} instead")
        user_vars.append((stage, key, m["value"]))
    selected = set(args.stages or STAGES)
    root = (args.root or _default_root()).resolve()
    return Options(
        project=args.project,
        region=args.region,
        stages=[s for s in STAGES if s in selected],
        dry_run=args.dry_run,
        auto_approve=args.auto_approve,
        user_vars=user_vars,
        state_bucket=args.state_bucket,
        root=root,
    )


def _check_vars(opts: Options, stages: Mapping[str, Stage]) -> None:
    for stage, key, _ in opts.user_vars:
        targets = [stage] if stage is not None else opts.stages
        if stage is not None and stage not in opts.stages:
            raise UsageError(f"--var {stage}:{key}=...: stage {stage} is not selected")
        if not any(key in stages[s].variables for s in targets):
            raise UsageError(
                f"--var {key}=...: no variable {key!r} is declared in infra/{{{','.join(targets)}}}"
            )


def _confirm(stage: str, summary: PlanSummary) -> bool:
    print(
        f"Apply the plan for stage {stage} ({sum(summary.counts().values())} resource changes)? "
        "Only 'yes' is accepted: ",
        end="",
        file=sys.stderr,
        flush=True,
    )
    answer = sys.stdin.readline()
    return answer.strip().lower() == "yes"


def _run(opts: Options, terraform_bin: str, stages: Mapping[str, Stage], progress: Progress) -> int:
    tf = Terraform(terraform_bin, opts.root, progress, color=sys.stderr.isatty())
    carried: dict[str, dict[str, Any]] = {}  # outputs of the stages run so far, later ones win
    state_bucket = opts.state_bucket
    summaries: dict[str, PlanSummary] = {}
    pending: list[str] = []  # dry run: stages whose changes are not applied

    if "bootstrap" not in opts.stages and state_bucket is None:
        state_bucket = _bootstrapped_bucket(opts, tf, stages, carried, progress)

    with tempfile.TemporaryDirectory(prefix="retrain-deploy-") as plans:
        for name in opts.stages:
            stage = stages[name]
            t0 = time.monotonic()
            progress.say(f"== stage {name} ({stage.path.relative_to(opts.root)})")
            try:
                images: dict[str, str] = {}
                if name == "app":
                    if "platform" not in opts.stages:  # the platform applied before: its outputs
                        carried.update(platform_outputs(tf, stages["platform"], state_bucket))
                    pin_artifacts(opts.root, progress, dry_run=opts.dry_run)
                    progress.say(f"app: build function source -> {FUNCTIONS_BUILD_DIR}/")
                    build_functions_source(opts.root)
                    images = images_for_app(opts, carried, progress, Path(plans))

                tf.run(stage, "init", _init_args(name, stage, state_bucket))

                values = _stage_values(opts, name, stage, carried, images, state_bucket, progress)
                plan_file = str(Path(plans) / f"{name}.tfplan")
                plan = ["plan", "-input=false", f"-out={plan_file}"]
                for key in sorted(values, key=lambda k: (k not in RESERVED_VARS, k)):
                    if key in stage.variables:
                        plan += ["-var", f"{key}={values[key]}"]
                tf.run(stage, "plan", plan)

                planned = tf.json(stage, "show plan", ["show", "-json", plan_file]) or {}
                summary = summaries[name] = summarize_plan(planned)
                for line in summary.lines(name):
                    progress.say(line)

                if opts.dry_run:
                    carried.update(planned_outputs(planned))
                    if summary.has_changes:
                        pending.append(name)
                else:
                    if not opts.auto_approve and summary.has_changes and not _confirm(name, summary):
                        raise Declined(name)
                    tf.run(stage, "apply", ["apply", "-input=false", plan_file])
                    carried.update(tf.json(stage, "output", ["output", "-json"]) or {})
                    if name == "app" and "retrain_env" in carried:
                        _save_target(opts.project, carried["retrain_env"]["value"], progress)
                if name == "bootstrap":
                    state_bucket = _bucket_after_bootstrap(opts, carried, state_bucket, progress)
            except StepFailed as e:
                _report_failure(e, pending)
                return 1
            progress.say(f"== stage {name} done in {_fmt_s(time.monotonic() - t0)}")

    if opts.dry_run:
        print("Dry run: nothing was applied.")
        for name in opts.stages:
            for line in summaries[name].lines(name):
                print(line)
        if pending:
            print(
                f"Note: later stages were planned against the current state of {', '.join(pending)}, "
                "whose changes are not applied."
            )
    else:
        progress.say(f"deployed {', '.join(opts.stages)} to {opts.project} ({opts.region})")
    return 0


def _init_args(name: str, stage: Stage, state_bucket: str | None) -> list[str]:
    """``terraform init``'s arguments: a stage that keeps its state in the state bucket needs it."""
    init = ["init", "-input=false"]
    if stage.has_backend:
        if not state_bucket:
            how = "" if name == "bootstrap" else "run the bootstrap stage first or "
            raise UsageError(f"stage {name} keeps its state in the state bucket: {how}pass --state-bucket")
        init.append(f"-backend-config=bucket={state_bucket}")
    return init


def _bucket_after_bootstrap(
    opts: Options, carried: dict[str, Any], state_bucket: str | None, progress: Progress
) -> str | None:
    """The state bucket the later stages use once the bootstrap stage ran (applied, or planned in a dry
    run): the operator's ``--state-bucket`` when given (a warning when the bootstrap's output differs),
    else the bootstrap's ``state_bucket`` output."""
    bucket = (carried.get("state_bucket") or {}).get("value")
    if opts.dry_run:
        if state_bucket is None:
            return bucket if isinstance(bucket, str) and bucket else None
        return state_bucket
    if opts.state_bucket is None and isinstance(bucket, str) and bucket:
        return bucket
    if opts.state_bucket and bucket and bucket != opts.state_bucket:
        progress.say(
            f"warning: --state-bucket {opts.state_bucket} differs from the bootstrap's "
            f"state_bucket output {bucket}; using {opts.state_bucket}"
        )
    return state_bucket


def _bootstrapped_bucket(
    opts: Options, tf: Terraform, stages: Mapping[str, Stage], carried: dict[str, Any], progress: Progress
) -> str | None:
    """Platform or app without bootstrap in this run: the state bucket bootstrap's (local) state still
    knows (its outputs join ``carried``); None when no stage of this run needs one."""
    if not any(stages[s].has_backend or "state_bucket" in stages[s].variables for s in opts.stages):
        return None
    try:
        carried.update(tf.json(stages["bootstrap"], "output (state bucket)", ["output", "-json"]) or {})
    except StepFailed as e:
        raise UsageError(
            "no state bucket: pass --state-bucket (the bootstrap stage's state_bucket output); "
            "reading infra/bootstrap's outputs failed:\n  " + "\n  ".join(e.tail[-5:])
        ) from e
    bucket = (carried.get("state_bucket") or {}).get("value")
    if not isinstance(bucket, str) or not bucket:
        raise UsageError(
            "no state bucket: infra/bootstrap has no state_bucket output (not applied yet?); "
            "run the bootstrap stage or pass --state-bucket"
        )
    progress.say(f"state bucket {bucket} (from infra/bootstrap's outputs)")
    return bucket


def _stage_values(
    opts: Options,
    name: str,
    stage: Stage,
    carried: dict[str, Any],
    images: dict[str, str],
    state_bucket: str | None,
    progress: Progress,
) -> dict[str, Any]:
    """The variables a stage is planned with: earlier stages' outputs (not the sensitive ones), the
    project and region, the state bucket, the app's build folders and images, then the operator's own
    ``-var``s; the app's manifests rendered for the deployment on the way."""
    values, withheld = forwarded_vars(carried, stage.variables)
    for w in withheld:
        progress.say(f"{name}: not passing sensitive output {w} on the command line")
    values.update({"project_id": opts.project, "region": opts.region})
    if state_bucket and "state_bucket" in stage.variables:
        values["state_bucket"] = state_bucket
    if name == "app" and "functions_source_dir" in stage.variables:
        values["functions_source_dir"] = FUNCTIONS_BUILD_DIR
    values.update(images)
    if name == "app" and "k8s_manifests_dir" in stage.variables:
        values["k8s_manifests_dir"] = K8S_BUILD_DIR
        app_vars = {k: v for scope, k, v in opts.user_vars if scope in (None, "app")}
        unrendered = render_manifests(opts.root, carried, {**app_vars, **images})
        if unrendered is None:
            progress.say(f"app: render k8s/ for this deployment -> {K8S_BUILD_DIR}/")
        elif opts.dry_run:  # a platform planned in this run, not applied: its outputs unknown
            shutil.rmtree(opts.root / K8S_BUILD_DIR, ignore_errors=True)  # nothing stale applies
            progress.say(f"app: manifests not rendered ({unrendered}); the app plan refuses")
        else:
            raise UsageError(f"cannot render k8s/ for {opts.project}: {unrendered}")
    for scope, key, value in opts.user_vars:
        if (scope is None or scope == name) and key in stage.variables:
            values[key] = value
    return values


def pin_artifacts(root: Path, progress: Progress, *, dry_run: bool = False) -> None:
    """Pin what infra/pins.json does not pin yet (retrain_ops.pins), before the app stage plans: the app
    stage refuses an image or manifest without its pin.  A pin that cannot be resolved is a UsageError
    naming the artifact, so nothing is planned.  A dry run writes nothing: it names what is unpinned."""
    from retrain_ops import pins

    path = root / "infra" / pins.LOCK.name
    try:
        lock = pins.Lock.load(path)
    except (pins.PinError, OSError, ValueError) as e:
        raise UsageError(f"infra/{pins.LOCK.name}: {e}") from e
    if not lock.unpinned():
        return
    if dry_run:
        raise UsageError(
            f"not pinned in infra/{pins.LOCK.name}: {', '.join(lock.unpinned())}; the app stage's plan "
            "would refuse them, and a dry run writes nothing: run `retrain pin` first"
        )
    progress.say(f"app: pin {len(lock.unpinned())} artifact(s) -> infra/{pins.LOCK.name}")
    try:
        pins.pin(lock, say=progress.say)
    except pins.PinError as e:
        raise UsageError(
            f"{e} (pin it by hand in infra/{pins.LOCK.name}, or run `retrain pin` where it resolves)"
        ) from e
    finally:
        lock.save(path)  # what did resolve is kept
    progress.say(f"app: infra/{pins.LOCK.name} pins every artifact now; commit it")


def _save_target(project: str, env: Mapping[str, Any], progress: Progress) -> None:
    """Save the applied app stage's settings as the CLI target named after the project; the deployment is
    done either way, so a failure here is a warning with the command that does it by hand."""
    from retrain_ops import targets

    name = targets.name_for_project(project)
    try:
        saved = targets.save(name, dict(env))
    except (ValueError, OSError) as e:
        progress.say(
            f"warning: the CLI target was not saved ({e}); "
            f"run `retrain target save {name} --from-terraform infra/app`"
        )
        return
    progress.say(f"CLI target {name} saved ({saved}): retrain --target {name} runs")


def _report_failure(e: StepFailed, pending: Sequence[str]) -> None:
    lines = [f"retrain deploy: stage {e.stage} failed at step '{e.step}' (terraform exit {e.returncode})"]
    if e.tail:
        lines.append("last lines of terraform's stderr:")
        lines += [f"  {line}" for line in e.tail]
    earlier = [p for p in pending if p != e.stage]
    if earlier:
        lines.append(
            f"note: this is a dry run and {', '.join(earlier)} has unapplied changes that this stage "
            "may need (its outputs, or the state bucket)"
        )
    lines.append("later stages were not run")
    print("\n".join(lines), file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # --help, or argparse's own usage error
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    progress = Progress()
    stage_name = ""
    try:
        opts = validate(args)
        infra = opts.root / "infra"
        if not infra.is_dir():
            raise UsageError(f"{infra} not found: run from the repository checkout or pass --root")
        stages = {name: load_stage(infra, name) for name in STAGES}
        _check_vars(opts, stages)
        if not opts.dry_run and not opts.auto_approve and not _interactive():
            raise UsageError(
                "refusing to apply without a terminal to confirm on: pass --auto-approve "
                "(or --dry-run to only plan)"
            )
        terraform_bin = shutil.which("terraform")
        if terraform_bin is None:
            raise UsageError(
                "terraform not found on PATH: install Terraform >= 1.5 "
                "(https://developer.hashicorp.com/terraform/install)"
            )
        stage_name = ",".join(opts.stages)
        progress.say(
            f"{'planning' if opts.dry_run else 'deploying'} {stage_name} "
            f"for project {opts.project} in {opts.region} ({terraform_bin})"
        )
        return _run(opts, terraform_bin, stages, progress)
    except UsageError as e:
        print(f"retrain deploy: {e}", file=sys.stderr)
        return 2
    except Declined as e:
        print(f"retrain deploy: apply of stage {e} not confirmed; nothing applied there", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(
            "retrain deploy: interrupted; terraform was asked to stop (if a state lock was left, "
            "see `terraform force-unlock`)",
            file=sys.stderr,
        )
        return 130


if __name__ == "__main__":
    sys.exit(main())
