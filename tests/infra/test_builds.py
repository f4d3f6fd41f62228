"""The images this project owns (retrain_ops.builds): built from a context that holds what each Dockerfile
copies, every image the deployment runs from this project has a build, and each runs by digest."""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import gcloud_stand_in
import pytest

from retrain_ops import builds
from retrain_ops.deployment import Deployment

REPO = Path(__file__).resolve().parents[2]
DIGEST = gcloud_stand_in.DIGEST


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    """What the builds read: cloudbuild.yaml, the Dockerfiles and what they copy."""
    root = tmp_path / "repo"
    for rel in builds.context_files(REPO):
        source = REPO / rel
        if source.is_dir():
            shutil.copytree(source, root / rel, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, root / rel)
    return root


def test_every_build_copies_only_what_its_context_holds() -> None:
    files = builds.context_files(REPO)
    assert {"cloudbuild.yaml", "dataflow/Dockerfile", "k8s/Dockerfile", "dataflow/main.py"} <= set(files)
    assert {"pyproject.toml", "README.md", "retrain"} <= set(files)
    assert [b.image for b in builds.builds(REPO)] == list(builds.IMAGE_VARS)


@pytest.mark.parametrize(
    ("dockerfile", "line", "problem"),
    [
        ("dataflow/Dockerfile", "COPY ../secrets ./secrets", "outside the build context"),
        ("k8s/Dockerfile", "COPY notes.txt ./", "no such file in the build context"),
    ],
)
def test_a_copy_from_outside_the_context_or_of_a_missing_file_is_refused(
    checkout: Path, dockerfile: str, line: str, problem: str
) -> None:
    path = checkout / dockerfile
    path.write_text(path.read_text() + line + "\n")
    with pytest.raises(builds.BuildError, match=problem):
        builds.context_files(checkout)


def test_the_documented_mistake_building_dataflow_alone_is_refused(checkout: Path) -> None:
    """`gcloud builds submit dataflow/` sends a context without pyproject.toml and retrain/."""
    config = checkout / "cloudbuild.yaml"
    config.write_text(
        config.read_text().replace(
            'dataflow/Dockerfile, -t, "${_REGISTRY}/tokenize:${_TAG}", .]',
            'Dockerfile, -t, "${_REGISTRY}/tokenize:${_TAG}", dataflow]',
        )
    )
    with pytest.raises(builds.BuildError, match="context dataflow is not the repository root"):
        builds.context_files(checkout)


def test_every_image_the_deployment_runs_from_this_project_has_a_build() -> None:
    """The app stage runs this project's images through these variables (the tokenize template's image,
    the notifier the manifests name), and each is built by cloudbuild.yaml."""
    app = Deployment().app
    template = app.resource("google_storage_bucket_object", "tokenize_template")
    assert "local.dataflow_image" in str(template["content"])
    assert app.evaluate("${local.dataflow_image}") == app.var("dataflow_image")
    assert "image: ${notifier_image}" in (REPO / "k8s" / "notifier.yaml").read_text()
    built = {b.image for b in builds.builds(REPO)}
    assert set(builds.IMAGE_VARS) == built
    assert set(builds.IMAGE_VARS.values()) == {"dataflow_image", "notifier_image"}


def test_an_image_by_tag_is_refused_by_the_app_stage() -> None:
    """Each image variable's validation (infra/app/variables.tf) accepts a digest only."""
    text = (REPO / "infra" / "app" / "variables.tf").read_text()
    for var in builds.IMAGE_VARS.values():
        block = re.search(rf'variable "{var}" \{{(.*?)\n\}}', text, re.S)
        assert block, var
        (pattern,) = re.findall(r'regex\("([^"]+)", var\.' + var, block.group(1))
        regex = re.compile(pattern.replace("\\\\", "\\"))
        assert regex.search("europe-docker.pkg.dev/p/retrain/x@" + DIGEST)
        assert not regex.search("europe-docker.pkg.dev/p/retrain/x:latest")


def _build(status: str, images: list[dict[str, Any]]) -> dict[str, Any]:
    """A Build resource as `gcloud builds describe --format=json` prints it (Cloud Build API v1)."""
    return {"id": "b-1", "status": status, "logUrl": "https://console/b-1", "results": {"images": images}}


def test_digests_come_from_the_builds_results() -> None:
    registry, tag = "europe-docker.pkg.dev/p/retrain", "abc123"
    images = [{"name": f"{registry}/{b.image}:{tag}", "digest": DIGEST} for b in builds.builds(REPO)]
    assert builds.digests(_build("SUCCESS", images), registry, tag, REPO) == {
        "tokenize": f"{registry}/tokenize@{DIGEST}",
        "retrain": f"{registry}/retrain@{DIGEST}",
    }
    with pytest.raises(builds.BuildError, match="ended FAILURE"):
        builds.digests(_build("FAILURE", images), registry, tag, REPO)
    with pytest.raises(builds.BuildError, match=r"no digest for .*/retrain:abc123"):
        builds.digests(_build("SUCCESS", images[:1]), registry, tag, REPO)


@pytest.mark.integration
def test_images_are_built_by_cloud_build_as_the_builder_and_named_by_digest(
    checkout: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = tmp_path / "gcloud.log"
    gcloud_stand_in.install(tmp_path / "bin", monkeypatch, log)
    registry = "europe-west4-docker.pkg.dev/acme/retrain"
    monkeypatch.setattr(builds, "commit_tag", lambda _root: "c0ffee")
    got = builds.build_images(
        checkout,
        project="acme",
        region="europe-west4",
        registry=registry,
        service_account="retrain-builder@acme.iam.gserviceaccount.com",
        staging="gs://acme-retrain-fn-sources/image-sources",
        workdir=tmp_path / "work",
        poll_s=0,
    )
    assert got == {
        "dataflow_image": f"{registry}/tokenize@{DIGEST}",
        "notifier_image": f"{registry}/retrain@{DIGEST}",
    }
    submit, describe = gcloud_stand_in.calls(log)
    context = tmp_path / "work" / "build-context"
    assert submit[:3] == ["builds", "submit", str(context)]
    assert f"--config={context / 'cloudbuild.yaml'}" in submit
    assert f"--substitutions=_REGISTRY={registry},_TAG=c0ffee" in submit
    assert (
        "--service-account=projects/acme/serviceAccounts/retrain-builder@acme.iam.gserviceaccount.com"
        in submit
    )
    assert "--gcs-source-staging-dir=gs://acme-retrain-fn-sources/image-sources" in submit
    assert describe[:3] == ["builds", "describe", "b-7"]
    uploaded = sorted(str(p.relative_to(context)) for p in context.rglob("*") if p.is_file())
    assert "dataflow/main.py" in uploaded and "k8s/Dockerfile" in uploaded
    assert not [p for p in uploaded if p.startswith(("tests/", "infra/", ".venv/", "functions/"))]
