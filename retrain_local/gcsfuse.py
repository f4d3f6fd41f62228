"""Cloud Storage FUSE volumes, as the cluster twin stands them up for a pod's local processes.

On GKE, a ``csi`` volume of driver ``gcsfuse.csi.storage.gke.io`` shows a bucket as a folder: reads fetch
objects, a file closed after writing becomes an object, a deleted file deletes its object.  The twin has
no FUSE, so a :class:`FuseMount` is a host folder that holds the objects under every path the container's
command names (fetched before the container starts) and is written back to the bucket while the
container runs and once more when it stops: new and changed files are uploaded, files that disappeared
are deleted.  Hidden files (a writer's temporary ``.name.tmp``) are never uploaded, like a FUSE file
that is not closed yet.  Objects are reached through :mod:`retrain.adapters.objects` (the GCS emulator
locally), as the pod's Google account: the CSI driver authenticates with the pod's Workload Identity
(cloud.google.com/kubernetes-engine/docs/how-to/cloud-storage-fuse-csi-driver-setup#authentication), so
a read or write that account may not make is refused (``Forbidden``).
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Iterable
from pathlib import Path

from retrain.adapters import credentials, objects

log = logging.getLogger(__name__)

DRIVER = "gcsfuse.csi.storage.gke.io"


def named_paths(mount_path: str, texts: Iterable[str]) -> set[str]:
    """The paths under ``mount_path`` that ``texts`` (a command, its arguments, environment values)
    name, relative to it ("" for the mount itself)."""
    pattern = re.compile(re.escape(mount_path.rstrip("/")) + r"(?![\w.-])(/[^\s,\[\]'\"]*)?")
    found = set()
    for text in texts:
        for m in pattern.finditer(text):
            found.add((m.group(1) or "").strip("/"))
    return found


class FuseMount:
    """One bucket mounted at ``host_dir`` for one pod."""

    def __init__(self, bucket: str, host_dir: Path, read_only: bool, token: str | None = None) -> None:
        """``token``: the pod's local identity (None: this process's own)."""
        self.bucket = bucket
        self.host_dir = host_dir
        self.read_only = read_only
        self.token = token
        self._synced: dict[str, tuple[int, int]] = {}
        """relative path -> (size, mtime_ns) as last fetched or uploaded"""

    def _uri(self, rel: str) -> str:
        return f"gs://{self.bucket}/{rel}"

    def fetch(self, prefixes: Iterable[str]) -> int:
        """Bring the objects under each prefix into the folder; how many objects came."""
        with credentials.acting_as(self.token):
            return self._fetch(prefixes)

    def sync(self) -> tuple[int, int]:
        """Write the folder back to the bucket (read-write mounts only): (uploaded, deleted)."""
        with credentials.acting_as(self.token):
            return self._sync()

    def _fetch(self, prefixes: Iterable[str]) -> int:
        self.host_dir.mkdir(parents=True, exist_ok=True)
        count = 0
        for prefix in sorted(set(prefixes)):
            for info in objects.list_objects(self._uri(prefix)):
                rel = info.uri[len(f"gs://{self.bucket}/") :]
                if not rel or rel.endswith("/") or rel in self._synced:
                    continue
                local = self.host_dir / rel
                objects.download_file(info.uri, str(local))
                stat = local.stat()
                self._synced[rel] = (stat.st_size, stat.st_mtime_ns)
                count += 1
        return count

    def _sync(self) -> tuple[int, int]:
        if self.read_only or not self.host_dir.exists():
            return 0, 0
        seen: set[str] = set()
        uploaded = deleted = 0
        for path in sorted(p for p in self.host_dir.rglob("*") if p.is_file()):
            rel = path.relative_to(self.host_dir).as_posix()
            if any(part.startswith(".") for part in rel.split("/")):
                continue
            seen.add(rel)
            try:
                stat = path.stat()
            except FileNotFoundError:  # removed while we walked
                seen.discard(rel)
                continue
            if self._synced.get(rel) == (stat.st_size, stat.st_mtime_ns):
                continue
            objects.upload_file(str(path), self._uri(rel))
            self._synced[rel] = (stat.st_size, stat.st_mtime_ns)
            uploaded += 1
        for rel in [r for r in self._synced if r not in seen]:
            with contextlib.suppress(FileNotFoundError):
                objects.delete(self._uri(rel))
            del self._synced[rel]
            deleted += 1
        if uploaded or deleted:
            log.info("gcsfuse %s: %d object(s) written, %d deleted", self.bucket, uploaded, deleted)
        return uploaded, deleted
