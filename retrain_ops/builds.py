"""The images this project owns: what ``cloudbuild.yaml`` builds, from which context, and their digests.

``retrain deploy`` assembles the build context from exactly the files the Dockerfiles copy (so a COPY of
a file outside it fails here, before anything is uploaded), submits ``cloudbuild.yaml`` to Cloud Build
with ``gcloud builds submit`` as the platform's builder account, tags every image by commit, and reads
each pushed image's digest from the build's ``results.images`` ("The digests of the pushed images will
be stored in the Build resource's results field", the Cloud Build API's Build.images); the app stage
then runs each image by digest (``IMAGE_VARS`` names the variable each one is passed in).
"""

from __future__ import annotations

import glob
import json
import re
import shlex
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

BUILD_CONFIG = "cloudbuild.yaml"
#: Each image cloudbuild.yaml builds -> the app stage's variable that runs it (by digest).
IMAGE_VARS = {"tokenize": "dataflow_image", "retrain": "notifier_image"}
DIGEST_RE = re.compile(r"@sha256:[0-9a-f]{64}$")


class BuildError(Exception):
    """The images cannot be built as configured (a context, a Dockerfile, or Cloud Build's answer)."""


@dataclass(frozen=True)
class Build:
    """One image of cloudbuild.yaml."""

    image: str
    """Its name in the registry (``${_REGISTRY}/<image>:${_TAG}``)."""
    dockerfile: str
    """Its Dockerfile, relative to the context root."""
    context: str
    """Its build context, relative to the repository root."""


def builds(root: Path) -> list[Build]:
    """The ``docker build`` steps of cloudbuild.yaml, each pushed by the build (its ``images``)."""
    config = yaml.safe_load((root / BUILD_CONFIG).read_text())
    pushed = set(config.get("images") or [])
    out = []
    for step in config.get("steps") or []:
        args = [str(a) for a in step.get("args") or []]
        if not args or args[0] != "build":
            continue
        tag = args[args.index("-t") + 1]
        dockerfile = args[args.index("-f") + 1] if "-f" in args else "Dockerfile"
        if tag not in pushed:
            raise BuildError(f"{BUILD_CONFIG}: {tag} is built but not in images: its digest would be unknown")
        name = re.fullmatch(r"\$\{_REGISTRY\}/([a-z0-9-]+):\$\{_TAG\}", tag)
        if name is None:
            raise BuildError(f"{BUILD_CONFIG}: tag {tag} is not ${{_REGISTRY}}/NAME:${{_TAG}}")
        out.append(Build(name.group(1), dockerfile, args[-1]))
    return out


def copied_sources(dockerfile: Path) -> list[str]:
    """What a Dockerfile's COPY and ADD take from its build context (``--from`` stages excluded)."""
    sources = []
    for line in _instructions(dockerfile.read_text()):
        words = shlex.split(line)
        if not words or words[0].upper() not in ("COPY", "ADD"):
            continue
        args = [w for w in words[1:] if not w.startswith("--")]
        if any(w.startswith("--from") for w in words[1:]):
            continue
        sources += args[:-1]
    return sources


def _instructions(text: str) -> list[str]:
    """The Dockerfile's instructions, continuation lines joined, comments dropped."""
    out, current = [], ""
    for raw in text.splitlines():
        line = raw.strip()
        if not current and (not line or line.startswith("#")):
            continue
        current += " " + line.removesuffix("\\")
        if not line.endswith("\\"):
            out.append(current.strip())
            current = ""
    return out


def context_files(root: Path) -> list[str]:
    """Every file the builds need, relative to the root (cloudbuild.yaml, each Dockerfile, and what each
    copies); BuildError for a source outside the context or missing from it."""
    needed = {BUILD_CONFIG}
    for build in builds(root):
        context = (root / build.context).resolve()
        if context != root.resolve():
            raise BuildError(f"{build.image}: context {build.context} is not the repository root")
        needed.add(build.dockerfile)
        for source in copied_sources(root / build.dockerfile):
            if source.startswith("/") or ".." in Path(source).parts:
                raise BuildError(f"{build.dockerfile}: COPY {source} is outside the build context")
            matches = glob.glob(source, root_dir=root)
            if not matches and not glob.has_magic(source):
                raise BuildError(f"{build.dockerfile}: COPY {source}: no such file in the build context")
            needed.update(matches)
    return sorted(needed)


def assemble_context(root: Path, dest: Path) -> Path:
    """The build context: exactly the files the builds need, copied under ``dest``."""
    if dest.exists():
        shutil.rmtree(dest)
    for rel in context_files(root):
        source, target = root / rel, dest / rel
        if source.is_dir():
            shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    return dest


def commit_tag(root: Path) -> str:
    """The tag of this checkout's images: its commit, ``-dirty`` when the tree has changes."""
    try:
        commit = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        raise BuildError("images are tagged by commit: run from a git checkout") from None
    return commit + ("-dirty" if dirty else "")


def submit_argv(
    context: Path, *, project: str, region: str, registry: str, tag: str, service_account: str, staging: str
) -> list[str]:
    """``gcloud builds submit`` of the context, as the builder account, staged in the sources bucket."""
    return [
        "gcloud",
        "builds",
        "submit",
        str(context),
        f"--config={context / BUILD_CONFIG}",
        f"--project={project}",
        f"--region={region}",
        f"--substitutions=_REGISTRY={registry},_TAG={tag}",
        f"--service-account=projects/{project}/serviceAccounts/{service_account}",
        f"--gcs-source-staging-dir={staging}",
        "--async",
        "--format=json",
    ]


#: A Build's statuses once it ended (Cloud Build API, Build.status).
ENDED = {"SUCCESS", "FAILURE", "INTERNAL_ERROR", "TIMEOUT", "CANCELLED", "EXPIRED"}


def _gcloud_json(argv: list[str]) -> dict[str, Any]:
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise BuildError(f"{' '.join(argv[:3])} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    try:
        answer = json.loads(done.stdout)
    except ValueError:
        raise BuildError(f"{' '.join(argv[:3])} answered no JSON: {done.stdout[-500:]!r}") from None
    if not isinstance(answer, dict):
        raise BuildError(f"{' '.join(argv[:3])} answered {type(answer).__name__}, not a Build")
    return answer


def digests(build: dict[str, Any], registry: str, tag: str, root: Path) -> dict[str, str]:
    """Each built image's ``name@sha256:...`` from a finished Build resource; BuildError when it did not
    succeed or an image's digest is missing."""
    status = build.get("status")
    if status != "SUCCESS":
        raise BuildError(f"Cloud Build {build.get('id', '?')} ended {status}: {build.get('logUrl', '')}")
    pushed = {i.get("name"): i.get("digest") for i in (build.get("results") or {}).get("images") or []}
    out = {}
    for b in builds(root):
        name = f"{registry}/{b.image}"
        digest = pushed.get(f"{name}:{tag}")
        if not digest or not re.fullmatch(r"sha256:[0-9a-f]{64}", str(digest)):
            raise BuildError(f"Cloud Build {build.get('id', '?')} reports no digest for {name}:{tag}")
        out[b.image] = f"{name}@{digest}"
    return out


def build_images(
    root: Path,
    *,
    project: str,
    region: str,
    registry: str,
    service_account: str,
    staging: str,
    workdir: Path,
    say: Callable[[str], None] = lambda _: None,
    poll_s: float = 10.0,
    timeout_s: float = 3600.0,
) -> dict[str, str]:
    """Build and push every image; the app stage's variable -> the image by digest.  The build is
    submitted and then read until it ends (``gcloud builds describe``), rather than streamed: a build
    as a user-specified account logs to Cloud Logging only."""
    tag = commit_tag(root)
    context = assemble_context(root, workdir / "build-context")
    argv = submit_argv(
        context,
        project=project,
        region=region,
        registry=registry,
        tag=tag,
        service_account=service_account,
        staging=staging,
    )
    build = _gcloud_json(argv)
    build_id = str(build.get("id") or "")
    if not build_id:
        raise BuildError("gcloud builds submit answered a Build without an id")
    say(f"Cloud Build {build_id} submitted: {build.get('logUrl', '')}")
    deadline, wait = time.monotonic() + timeout_s, 0.0
    while build.get("status") not in ENDED:
        if time.monotonic() > deadline:
            raise BuildError(f"Cloud Build {build_id} did not end within {timeout_s:.0f} s")
        time.sleep(wait)
        wait = poll_s
        describe = ["gcloud", "builds", "describe", build_id, f"--project={project}", f"--region={region}"]
        build = _gcloud_json([*describe, "--format=json"])
        say(f"Cloud Build {build_id}: {build.get('status')}")
    return {IMAGE_VARS[name]: ref for name, ref in digests(build, registry, tag, root).items()}
