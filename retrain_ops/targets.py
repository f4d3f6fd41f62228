"""Where the operator's CLI points: the local stack, or a deployment.

A deployment target is the ``RETRAIN_*`` settings its functions run with: the app stage's
``retrain_env`` output (``infra/app/outputs.tf``), saved under a name in
``$XDG_CONFIG_HOME/retrain/targets/NAME.json`` (``~/.config`` by default). ``retrain deploy`` saves one
named after the project when it applies the app stage; ``retrain target save NAME --from-terraform
infra/app`` (or ``--env-file``) saves one for a deployment made elsewhere. ``retrain --target NAME ...``
or ``RETRAIN_TARGET=NAME`` selects it; ``local`` (the default) is the local stack.

Against a deployment the commands use Google's clients with Application Default Credentials, exactly as
the functions do (``retrain.composition``); nothing of the local stack is read. A target file holds
settings only, never credentials.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from retrain import config

LOCAL = "local"
"""The local stack's target name."""
TARGET_ENV = "RETRAIN_TARGET"
"""Environment variable selecting a target when ``--target`` is not given."""
NAME_RE = re.compile(r"[a-z0-9][a-z0-9_-]{0,62}")
ENDPOINT_VARS = (
    "FIRESTORE_EMULATOR_HOST",
    "PUBSUB_EMULATOR_HOST",
    "STORAGE_EMULATOR_HOST",
    "RETRAIN_WORKFLOWS_ENDPOINT",
    "RETRAIN_WORKFLOWS_GRPC_ENDPOINT",
    "RETRAIN_CONTAINER_ENDPOINT",
)
"""Variables that send a client somewhere other than Google: for a deployment target, all or none."""
OPTIONAL_ENDPOINT_VARS = ("BIGQUERY_EMULATOR_HOST", "RETRAIN_LOCAL_ACCESS_TOKEN")


@dataclass(frozen=True)
class Target:
    """A named place the CLI operates on."""

    name: str
    """``local``, or the saved deployment's name."""
    env: dict[str, str]
    """The deployment's ``RETRAIN_*`` settings (empty for ``local``)."""

    @property
    def local(self) -> bool:
        return self.name == LOCAL

    def settings(self) -> config.Settings:
        """The deployment's settings, exactly as its functions load them."""
        return config.load(self.env)


def endpoint_overrides(target: Target, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The endpoint variables that send the clients of deployment ``target`` elsewhere than Google (the
    operator's environment may hold a local stack's); ValueError when only some are set, since a command
    would then read one world and act on the other (a reap comparing an emulator's ledger with the real
    cluster would delete live runs' JobSets)."""
    env = os.environ if env is None else env
    found = {k: env[k] for k in (*ENDPOINT_VARS, *OPTIONAL_ENDPOINT_VARS) if env.get(k)}
    missing = [k for k in ENDPOINT_VARS if not env.get(k)]
    if found and missing:
        raise ValueError(
            f"target {target.name!r}: {', '.join(sorted(found))} set but not {', '.join(missing)}: the "
            "command would mix local endpoints with the deployment's; unset them to reach the deployment"
        )
    return found


def targets_dir() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "retrain" / "targets"


def name_for_project(project: str) -> str:
    """A target name for a project id (a domain-scoped ``example.com:proj`` becomes ``example-com-proj``)."""
    return re.sub(r"[^a-z0-9_-]", "-", project.lower()).strip("-_")[:63]


def _check_name(name: str) -> None:
    if name == LOCAL:
        raise ValueError(f"{LOCAL!r} is the local stack's target; choose another name")
    if not NAME_RE.fullmatch(name):
        raise ValueError(
            f"target name {name!r}: use 1-63 of a-z, 0-9, '-' and '_', starting with a letter or digit"
        )


def validated_env(env: dict[str, object]) -> dict[str, str]:
    """``env`` as settings a deployment's functions would accept: only known ``RETRAIN_*`` names, values
    that load (``config.load`` checks each), and a project."""
    known = set(config.to_env(config.Settings()))
    unknown = sorted(set(env) - known)
    if unknown:
        raise ValueError(f"not retrain settings: {unknown} (is this the app stage's retrain_env output?)")
    values = {k: str(v) for k, v in env.items()}
    config.load(values)
    if not values.get("RETRAIN_PROJECT"):
        raise ValueError("the settings name no RETRAIN_PROJECT")
    return values


def save(name: str, env: dict[str, object]) -> Path:
    """Save (or replace) a deployment target; returns its file."""
    _check_name(name)
    values = validated_env(env)
    path = targets_dir() / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(values, indent=2, sort_keys=True) + "\n")
    tmp.replace(path)
    return path


def load(name: str) -> Target:
    """The target called ``name``; ``local`` is always there."""
    if name == LOCAL:
        return Target(LOCAL, {})
    _check_name(name)
    path = targets_dir() / f"{name}.json"
    if not path.is_file():
        known = ", ".join(names()) or "none saved"
        raise ValueError(
            f"no target {name!r} (known: {LOCAL}, {known}); save one with "
            f"`retrain target save {name} --from-terraform infra/app`"
        )
    return Target(name, validated_env(json.loads(path.read_text())))


def selected(name: str | None) -> Target:
    """The target ``--target`` names, else ``$RETRAIN_TARGET``, else the local stack."""
    return load(name or os.environ.get(TARGET_ENV) or LOCAL)


def names() -> list[str]:
    folder = targets_dir()
    return sorted(p.stem for p in folder.glob("*.json")) if folder.is_dir() else []


def from_terraform(app_dir: Path, terraform: str = "terraform") -> dict[str, object]:
    """The app stage's ``retrain_env`` output (``terraform -chdir=DIR output -json retrain_env``)."""
    proc = subprocess.run(
        [terraform, f"-chdir={app_dir}", "output", "-json", "retrain_env"],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise ValueError(f"terraform output retrain_env in {app_dir} failed: {proc.stderr.strip()[-500:]}")
    value = json.loads(proc.stdout)
    if not isinstance(value, dict):
        raise ValueError(f"retrain_env in {app_dir} is not a map")
    return value


def from_env_file(path: Path) -> dict[str, object]:
    """``KEY=VALUE`` lines (``#`` comments and blank lines ignored), or a JSON object."""
    text = path.read_text()
    if text.lstrip().startswith("{"):
        value = json.loads(text)
        if not isinstance(value, dict):
            raise ValueError(f"{path} is not a JSON object")
        return value
    env: dict[str, object] = {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep:
            raise ValueError(f"{path}:{number}: expected KEY=VALUE")
        env[key.strip()] = value.strip()
    return env
