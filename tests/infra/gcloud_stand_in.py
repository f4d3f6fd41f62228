"""A stand-in ``gcloud`` for the image builds: it records each call and answers ``builds submit --async``
and ``builds describe`` with Build resources shaped as the Cloud Build API's v1 Build (``id``,
``status``, ``logUrl``, ``results.images[].name/digest``)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

DIGEST = "sha256:" + "ab" * 32

SCRIPT = """#!{python}
import json, os, sys
with open(os.environ["FAKE_GCLOUD_LOG"], "a") as log:
    log.write(json.dumps(sys.argv[1:]) + "\\n")
args = sys.argv[1:]
sub = [a.split("=", 1)[1] for a in args if a.startswith("--substitutions=")]
fields = dict(kv.split("=", 1) for kv in sub[0].split(",")) if sub else {{}}
state = os.environ["FAKE_GCLOUD_LOG"] + ".build"
if args[:2] == ["builds", "submit"]:
    with open(state, "w") as f:
        json.dump(fields, f)
    print(json.dumps({{"id": "b-7", "status": "QUEUED", "logUrl": "https://console/b-7"}}))
elif args[:2] == ["builds", "describe"]:
    with open(state) as f:
        fields = json.load(f)
    names = [fields["_REGISTRY"] + "/" + n + ":" + fields["_TAG"] for n in ("tokenize", "retrain")]
    images = [{{"name": n, "digest": "{digest}"}} for n in names]
    status = os.environ.get("FAKE_BUILD_STATUS", "SUCCESS")
    print(json.dumps({{"id": "b-7", "status": status, "results": {{"images": images}}}}))
else:
    sys.exit("stand-in gcloud: unexpected " + repr(args))
"""


def install(bin_dir: Path, monkeypatch: pytest.MonkeyPatch, log: Path) -> None:
    """``gcloud`` first on PATH, logging its calls to ``log``."""
    bin_dir.mkdir(exist_ok=True)
    exe = bin_dir / "gcloud"
    exe.write_text(SCRIPT.format(python=sys.executable, digest=DIGEST))
    exe.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_GCLOUD_LOG", str(log))


def calls(log: Path) -> list[list[Any]]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
