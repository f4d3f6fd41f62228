"""The Kubernetes manifests under ``k8s/``, rendered from the deployment's values.

Each file there is a template whose ``${name}`` placeholders are the fields of
:class:`retrain_ops.deployment.ManifestValues`.  ``retrain deploy`` renders them from the platform
stage's outputs into ``build/k8s/`` (what Terraform applies); the local stack renders them from
``infra/``'s own values and applies them to its API server.  ``k8s/examples/`` is never applied.
"""

from __future__ import annotations

import string
from pathlib import Path
from typing import Any

import yaml

from retrain_ops.deployment import REPO_ROOT, ManifestValues

K8S_DIR = REPO_ROOT / "k8s"
#: The templates, in the order they are applied (service accounts before what runs as them).
TEMPLATES = ("notifier.yaml", "reaper.yaml", "workflow.yaml")
#: GPUDirect-TCPX's networks: rendered only when the platform builds them.
TCPX_TEMPLATE = "tcpx.yaml"


def templates(values: ManifestValues) -> tuple[str, ...]:
    return (*TEMPLATES, TCPX_TEMPLATE) if values.gpu_networks else TEMPLATES


def render(values: ManifestValues, k8s_dir: Path = K8S_DIR) -> dict[str, str]:
    """File name -> rendered YAML; KeyError naming a placeholder that is not a ManifestValues field."""
    fields = values.as_strings()
    out = {}
    for name in templates(values):
        template = string.Template((k8s_dir / name).read_text())
        try:
            out[name] = template.substitute(fields)
        except KeyError as e:
            raise KeyError(f"k8s/{name}: ${{{e.args[0]}}} is not a ManifestValues field") from None
    return out


def documents(values: ManifestValues, k8s_dir: Path = K8S_DIR) -> list[dict[str, Any]]:
    """Every object of the rendered manifests, in apply order."""
    return [d for text in render(values, k8s_dir).values() for d in yaml.safe_load_all(text) if d]


def write(values: ManifestValues, dest: Path, k8s_dir: Path = K8S_DIR) -> list[Path]:
    """Render into ``dest`` (replacing what a previous render left there); the files written."""
    dest.mkdir(parents=True, exist_ok=True)
    for old in dest.glob("*.yaml"):
        old.unlink()
    written = []
    for name, text in render(values, k8s_dir).items():
        path = dest / name
        path.write_text("# Rendered by retrain_ops.manifests from k8s/" + name + "; do not edit.\n" + text)
        written.append(path)
    return written
