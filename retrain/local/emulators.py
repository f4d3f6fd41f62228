"""The real emulators the local stack and the tests run: Firestore, Pub/Sub (Google Cloud SDK, Java) and
GCS (gcp-storage-emulator).

Each is started through its own launcher in a new process group, bound to 127.0.0.1, considered up
when it prints its "started" line, and stopped by signalling that group, so no Java is left behind.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path


class EmulatorError(RuntimeError):
    """An emulator that could not be found or did not come up."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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


@dataclass
class ManagedProcess:
    """A child process in its own process group, with its output in a log file."""

    name: str
    argv: list[str]
    log_path: Path
    ready_line: str
    env: dict[str, str] = field(default_factory=dict)
    probe_url: str | None = None
    proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 60.0) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "wb")  # noqa: SIM115 - lives as long as the process
        self.proc = subprocess.Popen(
            self.argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **self.env},
            start_new_session=True,
        )
        log.close()
        pattern = re.compile(self.ready_line)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            text = self.log_path.read_text(errors="replace")
            if pattern.search(text) and self._probe():
                return
            if self.proc.poll() is not None:
                raise EmulatorError(f"{self.name} exited with {self.proc.returncode}: {text[-2000:]}")
            time.sleep(0.1)
        self.stop()
        raise EmulatorError(f"{self.name} did not start in {timeout_s:.0f}s; see {self.log_path}")

    def _probe(self) -> bool:
        if self.probe_url is None:
            return True
        try:
            with urllib.request.urlopen(self.probe_url, timeout=2):
                return True
        except (OSError, urllib.error.URLError):
            return False

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def stop(self, grace_s: float = 5.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(grace_s)
        except ProcessLookupError:
            pass


def firestore(state_dir: Path, port: int | None = None) -> tuple[ManagedProcess, str]:
    """The Firestore emulator; returns the process and its FIRESTORE_EMULATOR_HOST value."""
    platform = sdk_platform_dir()
    if platform is None:
        raise EmulatorError("Google Cloud SDK not found")
    port = port or free_port()
    proc = ManagedProcess(
        "firestore-emulator",
        [str(platform / FIRESTORE_LAUNCHER), "--host", "127.0.0.1", "--port", str(port)],
        state_dir / "firestore.log",
        ready_line=r"Dev App Server is now running",
    )
    return proc, f"127.0.0.1:{port}"


def pubsub(state_dir: Path, port: int | None = None) -> tuple[ManagedProcess, str]:
    """The Pub/Sub emulator; returns the process and its PUBSUB_EMULATOR_HOST value."""
    platform = sdk_platform_dir()
    if platform is None:
        raise EmulatorError("Google Cloud SDK not found")
    port = port or free_port()
    proc = ManagedProcess(
        "pubsub-emulator",
        [str(platform / PUBSUB_LAUNCHER), "--host=127.0.0.1", f"--port={port}"],
        state_dir / "pubsub.log",
        ready_line=r"Server started, listening on",
    )
    return proc, f"127.0.0.1:{port}"


def gcs(state_dir: Path, port: int | None = None) -> tuple[ManagedProcess, str]:
    """gcp-storage-emulator (in memory); returns the process and its STORAGE_EMULATOR_HOST value."""
    port = port or free_port()
    proc = ManagedProcess(
        "gcs-emulator",
        [
            sys.executable,
            "-c",
            "from gcp_storage_emulator.__main__ import main; main()",
            "start",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--in-memory",
        ],
        state_dir / "gcs.log",
        ready_line=r"Starting server",
        probe_url=f"http://127.0.0.1:{port}/storage/v1/b",
    )
    return proc, f"http://127.0.0.1:{port}"
