"""Container images as the cluster twin's kubelet runs them: local processes that see the host's files.

A kubelet pulls an image and runs the container's command inside the image's filesystem, with volumes
mounted at their paths.  The twin runs the command as a local process instead, so a local image is what
it provides -- files at container paths (:attr:`LocalImage.files`) and executables first on ``PATH``
(:attr:`LocalImage.path`) -- and every container path that the command, its arguments or its
environment names is translated to the host path standing for it: an image file, a pod's emptyDir
folder, or the folder standing for a Cloud Storage FUSE mount (:mod:`retrain_local.gcsfuse`).

The local stack plays the deployment's training images with :data:`NEMO_STANDIN` (NeMo's pre-training
script is :mod:`retrain_local.train.standin`) and :data:`BRIDGE_STANDIN` (Megatron-Bridge's run_recipe.py is
:mod:`retrain_local.train.bridge_standin`); in both ``torchrun`` is PyTorch's own (or, without PyTorch, the
stand-in launcher :mod:`retrain_local.torchrun`).  :data:`HOST` runs commands as they are (tests).
"""

from __future__ import annotations

import re
import shutil
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from retrain.trainers import megatron_bridge, nemo
from retrain_ops.deployment import BRIDGE_STANDIN, NEMO_STANDIN

REPO = Path(__file__).resolve().parents[1]

#: Commands run on the host as they are (no file is translated).
HOST = "local"
#: The local stand-in of this project's tokenize image: the launcher runs dataflow/main.py in place.
TOKENIZE_STANDIN = "retrain.local/tokenize"


def tokenize_standin() -> str:
    """The tokenize stand-in by digest, the way the app stage names an image: the digest of what it runs
    (the template's Dockerfile and program), so the local template spec has the deployment's shape."""
    import hashlib

    h = hashlib.sha256()
    for part in ("dataflow/Dockerfile", "dataflow/main.py"):
        h.update((REPO / part).read_bytes())
    return f"{TOKENIZE_STANDIN}@sha256:{h.hexdigest()}"


@dataclass(frozen=True)
class LocalImage:
    files: Mapping[str, str] = field(default_factory=dict)
    """Container path -> host path of the files the image provides."""
    path: tuple[str, ...] = ()
    """Host folders put first on ``PATH`` (the image's executables)."""
    env: Mapping[str, str] = field(default_factory=dict)
    """The image's own environment (a Dockerfile's ``ENV``): what the container's ``env`` does not set."""


#: The stand-in trainers' environment: OpenMP's idle threads sleep instead of spinning.  A stand-in rank
#: trains on CPU cores it shares with the stack and other ranks; with OpenMP's default (active) wait, a
#: thread between two parallel regions spins for its core, and with more threads than free cores the
#: spinning was most of the work: two tests/train tests side by side on two cores took 161 CPU s in 90 s,
#: against 25 CPU s in 21 s with OMP_WAIT_POLICY=PASSIVE (libgomp reads it as PyTorch loads it).
STANDIN_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}


def _launcher_dir(workdir: Path, standin: bool = False, fork_server: Path | None = None) -> str:
    """A folder holding ``torchrun``: PyTorch's own next to this interpreter (unless ``standin``), else
    the stand-in's, forking its ranks from ``fork_server`` when one is given."""
    own = Path(sys.executable).with_name("torchrun")
    if not standin and own.exists() and shutil.which("torchrun", path=str(own.parent)):
        return str(own.parent)
    folder = workdir / "bin"
    folder.mkdir(parents=True, exist_ok=True)
    shim = folder / "torchrun"
    server = f"Path({str(fork_server)!r})" if fork_server else "None"
    shim.write_text(
        f"#!{sys.executable}\nfrom pathlib import Path\n\nfrom retrain_local.torchrun import main\n\n"
        f"raise SystemExit(main(fork_server={server}))\n"
    )
    shim.chmod(0o755)
    return str(folder)


def local_images(
    workdir: Path, *, standin_launcher: bool = False, fork_server: Path | None = None
) -> dict[str, LocalImage]:
    """The images the twin can run, by name.  ``standin_launcher``: the training images launch with the
    stand-in ``torchrun`` even where PyTorch's is installed -- for runs whose point is not the launcher
    (PyTorch's agent imports torch: some 2.5 s of CPU a pod), and its ranks fork from ``fork_server``
    (:mod:`retrain_local.forkserver`) when one is given (each rank's own import is as much again)."""
    launcher = (_launcher_dir(workdir, standin_launcher, fork_server),)
    train = REPO / "retrain_local" / "train"
    nemo_image = LocalImage(files={nemo.SCRIPT: str(train / "standin.py")}, path=launcher, env=STANDIN_ENV)
    bridge_image = LocalImage(
        files={megatron_bridge.RUN_RECIPE: str(train / "bridge_standin.py")}, path=launcher, env=STANDIN_ENV
    )
    return {HOST: LocalImage(), NEMO_STANDIN: nemo_image, BRIDGE_STANDIN: bridge_image}


def translate(text: str, mapping: Mapping[str, str]) -> str:
    """``text`` with every container path of ``mapping`` (a whole path component) replaced by its host
    path, the longest first."""
    for container in sorted(mapping, key=len, reverse=True):
        pattern = r"(?<![\w./-])" + re.escape(container.rstrip("/")) + r"(?![\w.-])"
        host = mapping[container]
        text = re.sub(pattern, lambda _m, host=host: host, text)  # type: ignore[misc]
    return text
