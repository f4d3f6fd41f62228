"""``retrain pin`` against a real registry: the CNCF distribution registry (Debian's ``docker-registry``,
what ``registry:2`` runs), on loopback.  Images are pushed through the registry's own HTTP API (blob
uploads, then manifests), as a build would; pins are the digests of the exact bytes pushed."""

from __future__ import annotations

import base64
import datetime
import hashlib
import http.server
import json
import shutil
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from retrain_local import emulators, processes
from retrain_ops import deploy, pins

REGISTRY = shutil.which("docker-registry")
needs_registry = pytest.mark.skipif(
    REGISTRY is None, reason="docker-registry (Debian's package) is not installed; scripts/test installs it"
)
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"


def _serve(
    root: Path, data: Path, auth: dict[str, object] | None = None
) -> tuple[emulators.ManagedProcess, str]:
    return processes.start_on_a_free_port(lambda port: _registry(root, data, port, auth))


def _registry(
    root: Path, data: Path, port: int, auth: dict[str, object] | None
) -> tuple[emulators.ManagedProcess, str]:
    assert REGISTRY is not None
    config: dict[str, object] = {
        "version": 0.1,
        "log": {"level": "warn"},
        "storage": {"filesystem": {"rootdirectory": str(data)}},
        "http": {"addr": f"127.0.0.1:{port}"},
    }
    if auth:
        config["auth"] = auth
    (root / "config.yml").write_text(yaml.safe_dump(config))
    proc = emulators.ManagedProcess(
        "docker-registry",
        [REGISTRY, "serve", str(root / "config.yml")],
        root / "registry.log",
        None,
        probe_url=f"http://127.0.0.1:{port}/v2/",
    )
    return proc, f"127.0.0.1:{port}"


@pytest.fixture(scope="module")
def registry_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("registry-data")


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory, registry_data: Path) -> Iterator[str]:
    """A registry serving plain HTTP on 127.0.0.1 with no authentication: where the tests push."""
    proc, host = _serve(tmp_path_factory.mktemp("registry"), registry_data)
    yield host
    proc.stop()


class TokenRealm:
    """The token service of the distribution spec's token authentication: a JWT (RS256, its
    certificate in the ``x5c`` header) granting what the request's ``scope`` asks, signed by a key whose
    certificate the registry trusts.  Records each request's query and Authorization header."""

    def __init__(self, root: Path) -> None:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import rsa
        from cryptography.x509.oid import NameOID

        self.key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "retrain-test-token-issuer")])
        now = datetime.datetime.now(datetime.UTC)
        self.cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(self.key.public_key())
            .serial_number(1)
            .not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(hours=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(self.key, hashes.SHA256())
        )
        self.bundle = root / "issuer.pem"
        self.bundle.write_bytes(self.cert.public_bytes(serialization.Encoding.PEM))
        self.requests: list[tuple[dict[str, str], str | None]] = []
        realm = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                query = dict(urllib.parse.parse_qsl(urllib.parse.urlsplit(self.path).query))
                realm.requests.append((query, self.headers.get("Authorization")))
                body = json.dumps({"token": realm.token(query)}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/token"

    def token(self, query: dict[str, str]) -> str:
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import padding

        def b64(raw: bytes) -> str:
            return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()

        kind, name, actions = query["scope"].split(":")
        now = int(time.time())
        der = self.cert.public_bytes(serialization.Encoding.DER)
        header = {"alg": "RS256", "typ": "JWT", "x5c": [base64.b64encode(der).decode()]}
        claims = {
            "iss": "retrain-test",
            "sub": "anonymous",
            "aud": query["service"],
            "exp": now + 300,
            "nbf": now - 10,
            "iat": now,
            "jti": f"{now}-{len(self.requests)}",
            "access": [{"type": kind, "name": name, "actions": actions.split(",")}],
        }
        signing = b64(json.dumps(header).encode()) + "." + b64(json.dumps(claims).encode())
        signature = self.key.sign(signing.encode(), padding.PKCS1v15(), hashes.SHA256())
        return signing + "." + b64(signature)


@pytest.fixture(scope="module")
def token_registry(
    tmp_path_factory: pytest.TempPathFactory, registry_data: Path
) -> Iterator[tuple[str, TokenRealm]]:
    """The same storage served by a registry that answers 401 with a Bearer challenge to its realm."""
    root = tmp_path_factory.mktemp("token-registry")
    realm = TokenRealm(root)
    auth = {
        "token": {
            "realm": realm.url,
            "service": "retrain-test-registry",
            "issuer": "retrain-test",
            "rootcertbundle": str(realm.bundle),
        }
    }
    proc, host = _serve(root, registry_data, auth)
    yield host, realm
    proc.stop()
    realm.server.shutdown()


def _send(method: str, url: str, body: bytes = b"", content_type: str = "") -> tuple[int, dict[str, str]]:
    request = urllib.request.Request(url, data=body if method != "POST" or body else b"", method=method)
    if content_type:
        request.add_header("Content-Type", content_type)
    with urllib.request.urlopen(request, timeout=30) as response:
        return response.status, dict(response.headers)


def _blob(host: str, repository: str, body: bytes) -> dict[str, object]:
    """Upload ``body`` as a blob (POST then a monolithic PUT); its descriptor."""
    digest = "sha256:" + hashlib.sha256(body).hexdigest()
    _, headers = _send("POST", f"http://{host}/v2/{repository}/blobs/uploads/")
    location = headers["Location"]
    if location.startswith("/"):
        location = f"http://{host}{location}"
    sep = "&" if "?" in location else "?"
    _send("PUT", f"{location}{sep}digest={digest}", body, "application/octet-stream")
    return {"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": digest, "size": len(body)}


def _manifest(host: str, repository: str, reference: str, body: bytes, media_type: str) -> str:
    _send("PUT", f"http://{host}/v2/{repository}/manifests/{reference}", body, media_type)
    return "sha256:" + hashlib.sha256(body).hexdigest()


def push_image(
    host: str, repository: str, tag: str, build: str, platforms: tuple[str, ...] = ("amd64",)
) -> str:
    """Push one image per platform, and an index over them when there are several; the tag's digest."""
    entries = []
    for arch in platforms:
        config = json.dumps({"architecture": arch, "os": "linux", "build": build}).encode()
        layer = f"{build}-{arch}".encode()
        descriptor = _blob(host, repository, config)
        manifest = {
            "schemaVersion": 2,
            "mediaType": OCI_MANIFEST,
            "config": {**descriptor, "mediaType": "application/vnd.oci.image.config.v1+json"},
            "layers": [_blob(host, repository, layer)],
        }
        body = json.dumps(manifest, indent=3).encode()
        reference = tag if len(platforms) == 1 else f"{tag}-{arch}"
        digest = _manifest(host, repository, reference, body, OCI_MANIFEST)
        entries.append(
            {
                "mediaType": OCI_MANIFEST,
                "digest": digest,
                "size": len(body),
                "platform": {"os": "linux", "architecture": arch},
            }
        )
    if len(platforms) == 1:
        return str(entries[0]["digest"])
    index = json.dumps({"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": entries}).encode()
    return _manifest(host, repository, tag, index, OCI_INDEX)


def anonymous(host: str) -> None:
    return None


@pytest.mark.integration
@needs_registry
def test_a_multi_platform_image_pins_to_its_index_and_a_single_one_to_its_manifest(registry: str) -> None:
    both = push_image(registry, "team/trainer", "24.12", "b1", ("amd64", "arm64"))
    one = push_image(registry, "team/sidecar", "v2", "b1")
    assert pins.resolve_image(pins.ImageRef.parse(f"{registry}/team/trainer:24.12"), anonymous) == both
    assert pins.resolve_image(pins.ImageRef.parse(f"{registry}/team/sidecar:v2"), anonymous) == one
    with pytest.raises(pins.PinError, match="HTTP 404"):
        pins.resolve_image(pins.ImageRef.parse(f"{registry}/team/sidecar:missing"), anonymous)


@pytest.mark.integration
@needs_registry
def test_a_registry_behind_token_authentication_is_answered_through_its_realm(
    registry: str, token_registry: tuple[str, TokenRealm]
) -> None:
    """The registry answers 401 with ``WWW-Authenticate: Bearer realm=...,service=...,scope=...``; the
    pin asks that realm for a token with the challenge's service and scope (sending the registry's
    credential, e.g. NGC's, to the realm only) and reads the manifest with it."""
    host, realm = token_registry
    digest = push_image(registry, "nvidia/trainer", "25.01", "tok", ("amd64", "arm64"))
    ngc = "Basic " + base64.b64encode(b"$oauthtoken:not-a-real-key").decode()
    assert pins.resolve_image(pins.ImageRef.parse(f"{host}/nvidia/trainer:25.01"), lambda _: ngc) == digest
    ((query, authorization),) = realm.requests[-1:]
    assert query == {"service": "retrain-test-registry", "scope": "repository:nvidia/trainer:pull"}
    assert authorization == ngc
    with pytest.raises(pins.PinError, match="HTTP 401"):  # a bearer given up front is used as it is
        pins.resolve_image(pins.ImageRef.parse(f"{host}/nvidia/trainer:25.01"), lambda _: "Bearer stale")


@pytest.mark.integration
@needs_registry
def test_retrain_pin_fills_the_lock_keeps_pins_and_updates_only_when_asked(
    registry: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A tag moved after it was pinned keeps its pin (the lock is what deploys) until --update."""
    ref = f"{registry}/team/app:v1"
    first = push_image(registry, "team/app", "v1", "first")
    lock = tmp_path / "pins.json"
    pins.Lock(images={}, files={}).save(lock)

    assert pins.main(["--lock", str(lock), "--add", ref]) == 0
    assert json.loads(lock.read_text())["images"] == {ref: first}
    assert pins.main(["--lock", str(lock), "--check"]) == 0

    moved = push_image(registry, "team/app", "v1", "second")
    assert moved != first
    assert pins.main(["--lock", str(lock)]) == 0
    assert pins.Lock.load(lock).images[ref] == first and "every pin is current" in capsys.readouterr().out
    assert pins.main(["--lock", str(lock), "--update"]) == 0
    updated = pins.Lock.load(lock)
    assert updated.images[ref] == moved and updated.pinned(ref) == f"{ref}@{moved}"


def test_check_lists_what_is_not_pinned_and_a_lock_entry_must_be_a_digest(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lock = tmp_path / "pins.json"
    pins.Lock(images={"nvcr.io/nvidia/nemo:24.12": None}, files={}).save(lock)
    assert pins.main(["--lock", str(lock), "--check"]) == 1
    assert "not pinned: nvcr.io/nvidia/nemo:24.12" in capsys.readouterr().out
    with pytest.raises(pins.PinError, match="run `retrain pin`"):
        pins.Lock.load(lock).pinned("nvcr.io/nvidia/nemo:24.12")
    lock.write_text(json.dumps({"images": {"nvcr.io/nvidia/nemo:24.12": "latest"}}))
    assert pins.main(["--lock", str(lock), "--check"]) == 2
    assert "is not a sha256 digest" in capsys.readouterr().err


@pytest.mark.integration
@needs_registry
def test_deploy_pins_before_the_app_stage_and_keeps_what_resolved_when_one_fails(
    registry: str, tmp_path: Path
) -> None:
    """``retrain deploy`` pins what the lock leaves open before the app stage plans; an artifact that
    cannot be resolved stops it with the artifact named, and the pins that did resolve are kept."""
    ok = push_image(registry, "team/deployed", "v3", "d")
    (tmp_path / "infra").mkdir()
    lock = tmp_path / "infra" / "pins.json"
    gone = f"127.0.0.1:{processes.free_port()}/team/unreachable:v1"  # nothing listens there
    pins.Lock(images={f"{registry}/team/deployed:v3": None, gone: None}, files={}).save(lock)
    with pytest.raises(deploy.UsageError, match="team/unreachable:v1"):
        deploy.pin_artifacts(tmp_path, deploy.Progress())
    assert pins.Lock.load(lock).images == {f"{registry}/team/deployed:v3": ok, gone: None}


def test_the_shipped_lock_is_well_formed_and_names_every_default_image() -> None:
    """infra/pins.json loads (digests are sha256, URLs https) and lists the images the settings name."""
    from retrain.config import Settings

    lock = pins.Lock.load()
    defaults = Settings()
    for ref in (defaults.image, defaults.bridge_image, defaults.tcpx_image):
        assert ref in lock.images, ref
    assert all(key in lock.sources for key in (*lock.images, *lock.files))


def test_a_fetched_manifest_pins_to_the_sha256_of_its_bytes(tmp_path: Path) -> None:
    """What Terraform's postcondition compares (sha256 of the body); a non-UTF-8 body is refused, since
    Terraform could not hash it as fetched."""
    import functools
    import http.server
    import threading

    served = tmp_path / "served"
    served.mkdir()
    (served / "manifests.yaml").write_text(
        "apiVersion: v1\nkind: Namespace\nmetadata:\n  name: kueue-system\n"
    )
    (served / "binary.yaml").write_bytes(b"\xff\xfe not text")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(served))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        lock = tmp_path / "pins.json"
        pins.Lock().save(lock)
        assert pins.main(["--lock", str(lock), "--add", f"{base}/manifests.yaml"]) == 0
        want = hashlib.sha256((served / "manifests.yaml").read_bytes()).hexdigest()
        assert pins.Lock.load(lock).files == {f"{base}/manifests.yaml": want}
        with pytest.raises(pins.PinError, match="not UTF-8"):
            pins.file_sha256(f"{base}/binary.yaml")
        with pytest.raises(pins.PinError, match="HTTP 404"):
            pins.file_sha256(f"{base}/absent.yaml")
    finally:
        server.shutdown()


def test_the_app_stage_hands_out_the_pinned_images(tmp_path: Path) -> None:
    """The settings infra/app gives every component name each image by its pin (evaluated from the
    Terraform itself, as the local stack reads it): a pinned lock turns each tag into tag@digest."""
    from retrain_ops.deployment import Deployment

    shutil.copytree(Path(pins.__file__).resolve().parents[1] / "infra", tmp_path / "infra")
    lock = pins.Lock.load(tmp_path / "infra" / "pins.json")
    lock.images = {ref: "sha256:" + hashlib.sha256(ref.encode()).hexdigest() for ref in lock.images}
    lock.save(tmp_path / "infra" / "pins.json")
    env = Deployment(infra=tmp_path / "infra").env
    for setting in ("RETRAIN_IMAGE", "RETRAIN_BRIDGE_IMAGE", "RETRAIN_TCPX_IMAGE"):
        ref = Deployment().env[setting]  # the shipped lock: tags the local stack plays with stand-ins
        assert env[setting] == lock.pinned(ref) and env[setting].startswith(ref + "@sha256:"), setting


def test_a_reference_names_the_manifest_it_pins() -> None:
    """The registry host of a reference is explicit; Docker Hub's docker.io is served elsewhere, and
    only loopback registries are asked over plain HTTP."""
    assert pins.ImageRef.parse("nvcr.io/nvidia/nemo:24.12").manifest_url == (
        "https://nvcr.io/v2/nvidia/nemo/manifests/24.12"
    )
    assert pins.ImageRef.parse("docker.io/library/busybox:1.36").manifest_url == (
        "https://registry-1.docker.io/v2/library/busybox/manifests/1.36"
    )
    assert pins.ImageRef.parse("127.0.0.1:5000/team/app:v1").manifest_url.startswith(
        "http://127.0.0.1:5000/v2/"
    )
    for bad in ("nemo:24.12", "nvcr.io/nvidia/nemo", "nvcr.io/nvidia/nemo:24.12@sha256:" + "0" * 64):
        with pytest.raises(pins.PinError):
            pins.ImageRef.parse(bad)


def test_credentials_go_only_to_the_host_they_were_chosen_for() -> None:
    """A registry string that ends in .pkg.dev but names another host in its URL ("evil.example#.pkg.dev")
    is refused before any credential is chosen; ADC goes only to LOCATION-docker.pkg.dev; and a token
    realm on another host than the registry's gets no credential (nvcr.io's realm is its own host)."""
    for bad in ("evil.example#.pkg.dev/p/r/i:1", "evil.example?.pkg.dev/p/r/i:1", "a_b.example/x:1"):
        with pytest.raises(pins.PinError, match="is not a registry host"):
            pins.ImageRef.parse(bad)
    assert pins.ImageRef.parse("us-central1-docker.pkg.dev/p/r/i:1").registry == "us-central1-docker.pkg.dev"
    import google.auth

    def adc(*args: object, **kwargs: object) -> None:
        raise AssertionError("Application Default Credentials were asked for")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(google.auth, "default", adc)
        assert pins.default_credentials("evil.pkg.dev") is None  # not Artifact Registry: ADC never asked
        with pytest.raises(AssertionError, match="were asked for"):
            pins.default_credentials("europe-west4-docker.pkg.dev")  # Artifact Registry: ADC asked

    seen: list[str | None] = []

    class Realm(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            seen.append(self.headers.get("Authorization"))
            body = b'{"token": "t"}'
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Realm)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        realm = {"realm": f"http://127.0.0.1:{server.server_address[1]}/token"}
        assert pins._token(realm, "Basic secret", "127.0.0.1:5000") == "t"  # the registry's own host
        assert pins._token(realm, "Basic secret", "localhost:5000") == "t"  # another host: anonymous
        assert seen == ["Basic secret", None]
    finally:
        server.shutdown()
