"""retrain.caller: the caller of an HTTP function, as Cloud Run passes the ID token on."""

from __future__ import annotations

import base64
from typing import Any

import pytest

from retrain.caller import SIGNATURE_REMOVED, forwarded_id_token, verified_caller

NOW = 1_800_000_000.0


def token(claims: dict[str, Any], signature: str = SIGNATURE_REMOVED) -> str:
    unsigned = forwarded_id_token(claims).rsplit(".", 1)[0]
    return f"Bearer {unsigned}.{signature}"


GOOD = {
    "iss": "https://accounts.google.com",
    "email": "oncall@example.com",
    "email_verified": True,
    "exp": NOW + 60,
    "aud": "https://run-http",
}


def test_a_user_token_cloud_run_let_through_names_its_email() -> None:
    # a gcloud user's token arrives with Google's mark where its signature was
    # (cloud.google.com/run/docs/troubleshooting#signature-removed); a service account's keeps its own
    assert verified_caller({"Authorization": token(GOOD)}, NOW) == "oncall@example.com"
    signed = token(GOOD, base64.urlsafe_b64encode(b"\x01" * 256).rstrip(b"=").decode())
    assert verified_caller({"Authorization": signed}, NOW) == "oncall@example.com"


@pytest.mark.parametrize(
    "authorization",
    [
        None,
        "",
        "Basic b25jYWxsOnB3",
        "Bearer ya29.an-access-token",  # not an ID token
        "Bearer a.b",
        "Bearer !!!.@@@.###",
        token({**GOOD, "email_verified": False}),
        token({k: v for k, v in GOOD.items() if k != "email_verified"}),
        token({**GOOD, "exp": NOW - 1}),  # expired
        token({k: v for k, v in GOOD.items() if k != "exp"}),
        token({**GOOD, "email": ["a@b"]}),
        token({**GOOD, "iss": "https://evil.example"}),  # not Google's
    ],
    ids=[
        "no header",
        "empty",
        "basic",
        "access token",
        "two segments",
        "not base64",
        "email unverified",
        "verification unsaid",
        "expired",
        "no expiry",
        "email not a string",
        "another issuer",
    ],
)
def test_no_verified_unexpired_email_is_no_caller(authorization: str | None) -> None:
    headers = {} if authorization is None else {"Authorization": authorization}
    assert verified_caller(headers, NOW) is None


def test_the_caller_is_read_from_the_header_cloud_run_checked() -> None:
    """With X-Serverless-Authorization, Cloud Run checks that header alone and hands Authorization on
    unchecked: a token written there by the caller names nobody."""
    forged = token({**GOOD, "email": "the-ceo@example.com"})
    headers = {"X-Serverless-Authorization": token(GOOD), "Authorization": forged}
    assert verified_caller(headers, NOW) == "oncall@example.com"
    assert verified_caller({"X-Serverless-Authorization": "Basic x", "Authorization": forged}, NOW) is None


def test_a_header_given_twice_names_nobody() -> None:
    from werkzeug.datastructures import Headers

    twice = Headers([("Authorization", token(GOOD)), ("Authorization", token({**GOOD, "email": "x@y"}))])
    assert verified_caller(twice, NOW) is None
    assert verified_caller(Headers([("Authorization", token(GOOD))]), NOW) == "oncall@example.com"
