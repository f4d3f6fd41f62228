"""``retrain pin``: every third-party artifact the deployment runs or applies, pinned by digest.

``infra/pins.json`` is the lock file, the way Terraform's ``.terraform.lock.hcl`` pins providers:

* ``images``: each image reference the deployment names by tag (``registry/repository:tag``, e.g. the
  NeMo images, the GPUDirect-TCPX daemon, the Kueue and JobSet controllers) -> the digest of its
  manifest (``sha256:...``; for a multi-platform image, its index);
* ``files``: each manifest URL the app stage fetches (the Kueue and JobSet release manifests) -> the
  sha256 of its bytes;
* ``sources``: where a value was read, for a reviewer (a published record, or ``retrain pin``).

A ``null`` value is not pinned yet.  ``retrain pin`` resolves those (``--update``: every entry) from
the registries and URLs themselves and rewrites the file; ``retrain deploy`` does the same before
Terraform runs, so the first deploy records the pins and later ones apply exactly those bytes (commit
the file).  infra/app enforces it: it runs ``ref@digest`` and refuses to plan while an image it
deploys has no digest, and a fetched manifest whose sha256 differs from its pin fails the plan.

Digests are resolved with the OCI distribution API: ``GET /v2/<name>/manifests/<tag>`` with the index
and manifest media types in ``Accept``, the digest being the sha256 of the exact bytes returned
(``Docker-Content-Digest``, optional in the spec, is checked when present); a ``401`` with a
``WWW-Authenticate: Bearer realm=...`` challenge is answered with a token from that realm (distribution
spec v1.1.1, ``spec.md``, end-3; image-spec v1.1.1 ``media-types.md``).  Credentials: Artifact
Registry takes an OAuth access token of Application Default Credentials as the bearer
(cloud.google.com/artifact-registry/docs/reference/docker-api, "Authenticating using the Docker Registry
HTTP API"); nvcr.io's token realm takes ``$oauthtoken`` and ``NGC_API_KEY`` when that is set, else it
is asked anonymously.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import http.client
import json
import os
import re
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from email.message import Message
from pathlib import Path
from typing import Any

LOCK = Path(__file__).resolve().parents[1] / "infra" / "pins.json"
DIGEST_RE = re.compile(r"sha256:[0-9a-f]{64}")
SHA256_RE = re.compile(r"[0-9a-f]{64}")
#: What ``retrain pin`` asks a registry for: an index first, so a multi-platform image pins as a whole.
MANIFEST_TYPES = (
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.docker.distribution.manifest.v2+json",
)
TIMEOUT_S = 60.0
#: Plain HTTP is taken from loopback only (a registry or file server on this machine, as in the tests).
LOOPBACK = ("http://127.0.0.1:", "http://localhost:")
#: The most a manifest or fetched file may weigh (a release manifest is under 1 MB).
MAX_BYTES = 32 * 1024 * 1024


#: A registry host as a reference names it: DNS labels, an optional port; nothing a URL reads otherwise.
_HOST = re.compile(
    r"(?i)[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?(?:\.[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?)*(?::[0-9]{1,5})?"
)
#: Artifact Registry's Docker hosts: LOCATION-docker.pkg.dev
#: (cloud.google.com/artifact-registry/docs/docker/names).
_ARTIFACT_REGISTRY = re.compile(r"[a-z0-9]+(?:-[a-z0-9]+)*-docker\.pkg\.dev")


class PinError(RuntimeError):
    """An artifact could not be pinned; the message says which and why."""


@dataclass(frozen=True)
class ImageRef:
    """An image named by tag: ``registry/repository:tag`` (the registry host is always explicit)."""

    registry: str
    repository: str
    tag: str

    @classmethod
    def parse(cls, ref: str) -> ImageRef:
        if "@" in ref:
            raise PinError(f"{ref!r} is already pinned by digest")
        host, _, path = ref.partition("/")
        if not path or not ("." in host or ":" in host or host == "localhost"):
            raise PinError(f"{ref!r} does not name its registry host (e.g. nvcr.io/nvidia/nemo:24.12)")
        if not _HOST.fullmatch(host):
            # "evil.example#.pkg.dev" ends in .pkg.dev but its URL's host is evil.example
            raise PinError(f"{ref!r}: {host!r} is not a registry host (a DNS name, optionally :port)")
        repository, sep, tag = path.rpartition(":")
        if not sep or not tag or "/" in tag:
            raise PinError(f"{ref!r} has no tag")
        return cls(host, repository, tag)

    def __str__(self) -> str:
        return f"{self.registry}/{self.repository}:{self.tag}"

    @property
    def manifest_url(self) -> str:
        # A registry on loopback speaks plain HTTP (the local tests' registry); every other one HTTPS.
        scheme = "http" if f"http://{self.registry}".startswith(LOOPBACK) else "https"
        # Docker Hub's references say docker.io; "the registry itself is at https://registry-1.docker.io"
        # (docker/hub-feedback#1253, a Docker maintainer's answer).
        host = "registry-1.docker.io" if self.registry == "docker.io" else self.registry
        return f"{scheme}://{host}/v2/{self.repository}/manifests/{self.tag}"


@dataclass
class Lock:
    """The lock file's three maps (see the module's docstring)."""

    images: dict[str, str | None] = field(default_factory=dict)
    files: dict[str, str | None] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)

    @classmethod
    def load(cls, path: Path = LOCK) -> Lock:
        raw = json.loads(path.read_text())
        if not isinstance(raw, dict) or not all(
            isinstance(raw.get(k, {}), dict) for k in ("images", "files", "sources")
        ):
            raise PinError(f"{path}: not a lock (an object of images, files and sources)")
        lock = cls(dict(raw.get("images", {})), dict(raw.get("files", {})), dict(raw.get("sources", {})))
        for ref, digest in lock.images.items():
            ImageRef.parse(ref)
            if digest is not None and not DIGEST_RE.fullmatch(digest):
                raise PinError(f"{path}: {ref}: {digest!r} is not a sha256 digest")
        for url, sha in lock.files.items():
            if not url.startswith(("https://", *LOOPBACK)):
                raise PinError(f"{path}: {url!r} is not an https URL")
            if sha is not None and not SHA256_RE.fullmatch(sha):
                raise PinError(f"{path}: {url}: {sha!r} is not a sha256 hex digest")
        return lock

    def save(self, path: Path = LOCK) -> None:
        body = {"images": self.images, "files": self.files, "sources": self.sources}
        path.write_text(json.dumps(body, indent=2, sort_keys=True) + "\n")

    def unpinned(self) -> list[str]:
        return [k for k, v in {**self.images, **self.files}.items() if v is None]

    def pinned(self, ref: str) -> str:
        """``ref@digest`` for an image of the lock; PinError when it has no digest yet."""
        if DIGEST_RE.search(ref.partition("@")[2]):
            return ref
        digest = self.images.get(ref)
        if digest is None:
            raise PinError(f"{ref} is not pinned: run `retrain pin` (it fills {LOCK.name})")
        return f"{ref}@{digest}"


Credentials = Callable[[str], str | None]
"""A registry host -> the ``Authorization`` header value to send it, or None for anonymous."""


def default_credentials(host: str) -> str | None:
    """Artifact Registry: ADC's access token as the bearer; nvcr.io's realm: NGC_API_KEY if set."""
    if _ARTIFACT_REGISTRY.fullmatch(host):
        import google.auth
        import google.auth.exceptions
        import google.auth.transport.requests

        try:
            creds, _ = google.auth.default(scopes=["https://www.googleapis.com/auth/cloud-platform"])
            creds.refresh(google.auth.transport.requests.Request())
        except google.auth.exceptions.GoogleAuthError:
            return None  # no usable ADC: a public repository (gce-ai-infra) still answers anonymously
        return f"Bearer {creds.token}"
    if host == "nvcr.io" and (key := os.environ.get("NGC_API_KEY")):
        return "Basic " + base64.b64encode(f"$oauthtoken:{key}".encode()).decode()
    return None


class _Redirects(urllib.request.HTTPRedirectHandler):
    """Follows a redirect only to https (or loopback), and never carries ``Authorization`` to
    another host: a registry's blob store or a release's download host gets no credential."""

    def redirect_request(
        self,
        req: urllib.request.Request,
        fp: Any,
        code: int,
        msg: str,
        headers: http.client.HTTPMessage,
        newurl: str,
    ) -> urllib.request.Request | None:
        if not newurl.startswith(("https://", *LOOPBACK)):
            raise PinError(f"refused a redirect to {newurl[:200]}: not https")
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        if (
            new is not None
            and urllib.parse.urlsplit(newurl).netloc != urllib.parse.urlsplit(req.full_url).netloc
        ):
            new.remove_header("Authorization")
        return new


_OPENER = urllib.request.build_opener(_Redirects)


def _get(url: str, headers: Mapping[str, str]) -> tuple[int, Message, bytes]:
    request = urllib.request.Request(url, headers=dict(headers))
    try:
        with _OPENER.open(request, timeout=TIMEOUT_S) as response:
            return response.status, response.headers, response.read(MAX_BYTES + 1)
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read(64 * 1024)
    except (urllib.error.URLError, TimeoutError, OSError) as e:
        raise PinError(f"{urllib.parse.urlsplit(url).netloc}: {getattr(e, 'reason', e)}") from None


def bearer_challenge(header: str) -> dict[str, str]:
    """The parameters of a ``WWW-Authenticate: Bearer realm="...",service="...",scope="..."`` header."""
    scheme, _, params = header.strip().partition(" ")
    if scheme.lower() != "bearer":
        raise PinError(f"unsupported authentication challenge {header[:200]!r}")
    return {k.lower(): v for k, v in re.findall(r'(\w+)="([^"]*)"', params)}


def _token(challenge: Mapping[str, str], authorization: str | None, registry: str) -> str:
    """A token from the challenge's realm.  The registry's credential goes with the request only when the
    realm is on the registry's own host (nvcr.io's is https://nvcr.io/proxy_auth, sapcc/keppel#731):
    a challenge is the registry's answer, and must not send an operator's credential elsewhere."""
    realm = challenge.get("realm", "")
    if not realm.startswith(("https://", *LOOPBACK)):
        raise PinError(f"token realm {realm[:200]!r} is not https")
    if urllib.parse.urlsplit(realm).hostname != urllib.parse.urlsplit(f"//{registry}").hostname:
        authorization = None
    query = {k: challenge[k] for k in ("service", "scope") if k in challenge}
    url = realm + ("&" if "?" in realm else "?") + urllib.parse.urlencode(query) if query else realm
    status, _, body = _get(url, {"Authorization": authorization} if authorization else {})
    if status != 200:
        raise PinError(f"token from {realm}: HTTP {status}")
    try:
        answer = json.loads(body)
        token = answer.get("token") or answer.get("access_token")
    except (ValueError, AttributeError):
        raise PinError(f"token from {realm}: not a JSON object") from None
    if not isinstance(token, str) or not token:
        raise PinError(f"token from {realm}: no token in the answer")
    return token


def resolve_image(ref: ImageRef, credentials: Credentials = default_credentials) -> str:
    """The digest of ``ref``'s manifest (its index for a multi-platform image) as the registry serves it."""
    try:
        return _manifest_digest(ref, credentials)
    except PinError as e:
        raise PinError(f"cannot pin {ref}: {e}") from None


def _manifest_digest(ref: ImageRef, credentials: Credentials) -> str:
    headers = {"Accept": ", ".join(MANIFEST_TYPES)}
    authorization = credentials(ref.registry)
    if authorization and authorization.startswith("Bearer "):
        headers["Authorization"] = authorization
    status, answer, body = _get(ref.manifest_url, headers)
    if status == 401 and "Authorization" not in headers:
        challenge = bearer_challenge(answer.get("WWW-Authenticate", ""))
        headers["Authorization"] = f"Bearer {_token(challenge, authorization, ref.registry)}"
        status, answer, body = _get(ref.manifest_url, headers)
    if status != 200:
        raise PinError(f"the registry answered HTTP {status} for its manifest")
    if len(body) > MAX_BYTES:
        raise PinError(f"the manifest is over {MAX_BYTES} bytes")
    digest = "sha256:" + hashlib.sha256(body).hexdigest()
    served = answer.get("Docker-Content-Digest")
    if served and served != digest:
        raise PinError(f"the registry names digest {served}, its bytes hash to {digest}")
    return digest


def file_sha256(url: str) -> str:
    """The sha256 of the bytes ``url`` serves (after redirects), as Terraform's postcondition hashes them."""
    try:
        status, _, body = _get(url, {})
        if status != 200:
            raise PinError(f"HTTP {status}")
        if len(body) > MAX_BYTES:
            raise PinError(f"over {MAX_BYTES} bytes")
        body.decode("utf-8")  # Terraform's sha256() hashes the UTF-8 string the http data source holds
    except UnicodeDecodeError:
        raise PinError(f"cannot pin {url}: not UTF-8 text, so Terraform cannot check it") from None
    except PinError as e:
        raise PinError(f"cannot pin {url}: {e}") from None
    return hashlib.sha256(body).hexdigest()


def pin(
    lock: Lock,
    *,
    update: bool = False,
    credentials: Credentials = default_credentials,
    say: Callable[[str], None] = lambda _: None,
) -> list[str]:
    """Resolve every entry that has no value (``update``: every entry); the keys that changed.  Every
    entry is tried: one that cannot be resolved does not keep the others from their pins, and the
    PinError raised at the end names each that failed."""
    changed, failed = [], []
    wanted = [(ref, d, "image") for ref, d in lock.images.items()] + [
        (u, d, "file") for u, d in lock.files.items()
    ]
    for key, current, kind in sorted(wanted):
        if current is not None and not update:
            continue
        try:
            value = resolve_image(ImageRef.parse(key), credentials) if kind == "image" else file_sha256(key)
        except PinError as e:
            failed.append(str(e))
            continue
        say(f"{key} -> {value}")
        if value != current:
            if kind == "image":
                lock.images[key] = value
            else:
                lock.files[key] = value
            lock.sources[key] = "retrain pin: " + (
                "the registry's manifest" if kind == "image" else "sha256 of the bytes"
            )
            changed.append(key)
    if failed:
        raise PinError("; ".join(failed))
    return changed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="retrain pin", description=__doc__.split("\n\n")[0] if __doc__ else "")
    ap.add_argument("--lock", type=Path, default=LOCK, help=f"the lock file (default: {LOCK})")
    ap.add_argument("--update", action="store_true", help="resolve every entry again, not only unpinned ones")
    ap.add_argument("--check", action="store_true", help="only list what is not pinned (exit 1 if any)")
    ap.add_argument(
        "--add",
        action="append",
        default=[],
        metavar="IMAGE|URL",
        help="add an image (registry/repository:tag) or manifest URL (https://...) to the lock and pin it",
    )
    args = ap.parse_args(argv)
    try:
        lock = Lock.load(args.lock)
        for item in args.add:
            if item.startswith(("https://", *LOOPBACK)):
                lock.files.setdefault(item, None)
            else:
                lock.images.setdefault(str(ImageRef.parse(item)), None)
        if args.check:
            missing = lock.unpinned()
            for key in missing:
                print(f"not pinned: {key}")
            return 1 if missing else 0
        before = Lock(dict(lock.images), dict(lock.files), dict(lock.sources))
        try:
            changed = pin(lock, update=args.update, say=lambda line: print(line, file=sys.stderr))
        finally:
            if lock != before:
                lock.save(args.lock)  # what did resolve is kept
        print(f"{len(changed)} pin(s) written to {args.lock}" if changed else "every pin is current")
        return 0
    except (PinError, OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
