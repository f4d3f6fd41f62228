"""The real emulators the local stack and the tests run: Firestore, Pub/Sub (Google Cloud SDK, Java) and
GCS (gcp-storage-emulator).

Each is started through its own launcher in a new process group, bound to 127.0.0.1, considered up
when it prints its "started" line, and stopped by signalling that group, so no Java is left behind.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING

from retrain_local.processes import EmulatorError, ManagedProcess

if TYPE_CHECKING:
    from retrain_local.bigquery_gcs import ExportsProxy


def sdk_platform_dir() -> Path | None:
    """The Google Cloud SDK's ``platform/`` folder, where the emulators' launchers live."""
    candidates = []
    if os.environ.get("CLOUDSDK_ROOT_DIR"):
        candidates.append(Path(os.environ["CLOUDSDK_ROOT_DIR"]))
    gcloud = shutil.which("gcloud")
    if gcloud:
        candidates.append(Path(os.path.realpath(gcloud)).parent.parent)
    candidates += [Path("/usr/lib/google-cloud-sdk"), Path("/usr/share/google-cloud-sdk")]
    for root in candidates:
        if (root / "platform").is_dir():
            return root / "platform"
    return None


JAVA_OPTIONS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
"""The Java emulators' JVM options (``JAVA_TOOL_OPTIONS``): only the C1 compiler (full speed after seconds;
C2 spends minutes of CPU compiling for a process that lives as long as a test module) and the serial
collector (no collector threads beside a small heap on two shared cores).  A stack's boot and three runs:
the Pub/Sub emulator 3 CPU s against 5, twice."""


def java_emulators_unavailable_reason() -> str | None:
    """None when the Firestore and Pub/Sub emulators can run here; else why not."""
    if shutil.which("java") is None:
        return "java not found (the Firestore and Pub/Sub emulators need Java 17+)"
    platform = sdk_platform_dir()
    if platform is None:
        return "Google Cloud SDK not found (set CLOUDSDK_ROOT_DIR)"
    for launcher in (FIRESTORE_LAUNCHER, PUBSUB_LAUNCHER):
        if not (platform / launcher).exists():
            return f"{platform / launcher} missing: install the SDK's emulator components"
    return None


FIRESTORE_LAUNCHER = "cloud-firestore-emulator/cloud_firestore_emulator"
PUBSUB_LAUNCHER = "pubsub-emulator/bin/cloud-pubsub-emulator"


def firestore(state_dir: Path, port: int, import_from: Path | None = None) -> tuple[ManagedProcess, str]:
    """The Firestore emulator; returns the process and its FIRESTORE_EMULATOR_HOST value.

    ``import_from`` is an export folder written by :func:`export_firestore` (state kept across restarts).
    """
    platform = sdk_platform_dir()
    if platform is None:
        raise EmulatorError("Google Cloud SDK not found")
    argv = [str(platform / FIRESTORE_LAUNCHER), "--host", "127.0.0.1", "--port", str(port)]
    if import_from is not None:
        meta = sorted(import_from.glob("*.overall_export_metadata"))
        if meta:
            argv += ["--import-data", str(meta[0])]
    # The emulator logs a full stack trace for every failed precondition, and a storm's duplicate
    # deliveries are exactly that (a create of an existing arrival): the errors still reach the client,
    # only the per-error stack trace is muted.
    state_dir.mkdir(parents=True, exist_ok=True)
    logging_config = state_dir / "firestore-logging.properties"
    logging_config.write_text(
        "handlers=java.util.logging.ConsoleHandler\n"
        "com.google.cloud.datastore.emulator.impl.util.WrappedStreamObserver.level=OFF\n"
    )
    java_options = f"-Djava.util.logging.config.file={logging_config} {JAVA_OPTIONS}"
    proc = ManagedProcess(
        "firestore-emulator",
        argv,
        state_dir / "firestore.log",
        ready_line=r"Dev App Server is now running",
        env={"JAVA_TOOL_OPTIONS": java_options},
    )
    return proc, f"127.0.0.1:{port}"


def export_firestore(host: str, project: str, into: Path) -> Path:
    """Export the emulator's data (its own REST export); returns the export folder, replacing ``into``."""
    staging = into.with_name(into.name + ".new")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    body = json.dumps(
        {"database": f"projects/{project}/databases/(default)", "export_directory": str(staging)}
    ).encode()
    req = urllib.request.Request(
        f"http://{host}/emulator/v1/projects/{project}:export",
        data=body,
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(req, timeout=60):
        pass
    (export,) = [p for p in staging.iterdir() if p.is_dir()]
    shutil.rmtree(into, ignore_errors=True)
    export.rename(into)
    shutil.rmtree(staging, ignore_errors=True)
    return into


def pubsub(state_dir: Path, port: int) -> tuple[ManagedProcess, str]:
    """The Pub/Sub emulator; returns the process and its PUBSUB_EMULATOR_HOST value."""
    platform = sdk_platform_dir()
    if platform is None:
        raise EmulatorError("Google Cloud SDK not found")
    proc = ManagedProcess(
        "pubsub-emulator",
        [str(platform / PUBSUB_LAUNCHER), "--host=127.0.0.1", f"--port={port}"],
        state_dir / "pubsub.log",
        ready_line=r"Server started, listening on",
        env={"JAVA_TOOL_OPTIONS": JAVA_OPTIONS},
    )
    return proc, f"127.0.0.1:{port}"


def gcs(state_dir: Path, port: int) -> tuple[ManagedProcess, str]:
    """gcp-storage-emulator (``retrain_local.gcs_emulator``: a gone generation is a 404, as on Cloud
    Storage), storing objects under ``state_dir/gcs``; returns it and STORAGE_EMULATOR_HOST."""
    proc = ManagedProcess(
        "gcs-emulator",
        [
            sys.executable,
            "-m",
            "retrain_local.gcs_emulator",
            "start",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ],
        state_dir / "gcs.log",
        ready_line=r"All services started",  # after its bind ("Starting server" comes before)
        env={"STORAGE_BASE": str(state_dir), "STORAGE_DIR": "gcs"},
        probe_url=f"http://127.0.0.1:{port}/storage/v1/b",
    )
    return proc, f"http://127.0.0.1:{port}"


def bqemulator_path() -> Path | None:
    """The ``bqemulator`` CLI: ``RETRAIN_BQEMULATOR``, else the copy scripts/test installs in .tools/."""
    configured = os.environ.get("RETRAIN_BQEMULATOR")
    candidates = [Path(configured)] if configured else []
    candidates.append(Path(__file__).resolve().parents[1] / ".tools" / "bqemulator" / "bin" / "bqemulator")
    return next((c for c in candidates if c.is_file()), None)


def bigquery(state_dir: Path, port: int, project: str = "retrain-local") -> tuple[ExportsProxy, str]:
    """bqemulator (an optional tier: scripts/test installs it with duckdb 1.5.5 and its spatial
    extension from PyPI wheels, so it never downloads anything), behind the proxy that puts the files
    its jobs export into the storage emulator; returns it and BIGQUERY_EMULATOR_HOST."""
    from retrain_local.bigquery_gcs import ExportsProxy

    cli = bqemulator_path()
    if cli is None:
        raise EmulatorError("bqemulator is not installed (scripts/test puts it in .tools/bqemulator)")
    argv = [str(cli), "start", "--rest-host", "127.0.0.1", "--rest-port", str(port), "--grpc-port", "0"]
    argv += ["--project", project, "--log-level", "warning"]
    url = f"http://127.0.0.1:{port}"
    export_root = state_dir / "bq-gcs"
    proc = ManagedProcess(
        "bigquery-emulator",
        argv,
        state_dir / "bigquery.log",
        ready_line=None,
        env={"BQEMU_ENABLE_FORMAT_EXTENSIONS": "false", "BQEMU_GCS_LOCAL_ROOT": str(export_root)},
        probe_url=url + "/healthz",
    )
    proxy = ExportsProxy(proc, url, export_root)
    return proxy, proxy.url
