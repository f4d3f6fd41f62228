"""Who called an HTTP function, as Cloud Run verified it.

A function that requires authentication is reached only through Cloud Run's IAM check: the request's ID
token must name an account holding ``run.routes.invoke`` (infra/ grants no public invoker, and
tests/infra checks it).  Cloud Run checks ``X-Serverless-Authorization`` when a request carries it ("If
both headers are provided, only the X-Serverless-Authorization header is checked", cloud.google.com/run/
docs/authenticating/service-to-service), else ``Authorization``; the other header reaches the function
unchecked, so the caller is read from the checked one only.  Cloud Run hands the token on, though not
always signed: a user's token ("The user generates an ID token by using gcloud commands ... Google removes
the token signature", cloud.google.com/run/docs/troubleshooting#signature-removed) arrives as
``header.payload.SIGNATURE_REMOVED_BY_GOOGLE``.  So its claims are read without verifying a signature
again (which would refuse every user): Cloud Run's check is the verification.  Its ``email`` counts only
when Google issued it, ``email_verified``, and while it has not expired.
"""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Mapping
from typing import Any

from google.auth import exceptions, jwt

#: The header Cloud Run checks in place of ``Authorization`` when a request carries it.
SERVERLESS_AUTHORIZATION = "X-Serverless-Authorization"
#: What Google puts where a user token's signature was, before handing it to the function.
SIGNATURE_REMOVED = "SIGNATURE_REMOVED_BY_GOOGLE"
#: Google's ID tokens' issuers (google.oauth2.id_token: "accounts.google.com", "https://accounts.google.com").
GOOGLE_ISSUERS = frozenset({"accounts.google.com", "https://accounts.google.com"})


def forwarded_id_token(claims: Mapping[str, Any]) -> str:
    """An ID token with ``claims`` as Cloud Run hands a user's on: header and payload, and Google's mark
    where the signature was (what the local invoker front passes to a function, and what tests forge)."""
    header = {"alg": "RS256", "typ": "JWT"}
    segments = [
        base64.urlsafe_b64encode(json.dumps(part).encode()).rstrip(b"=").decode() for part in (header, claims)
    ]
    return ".".join([*segments, SIGNATURE_REMOVED])


def checked_token(headers: Mapping[str, str] | Any) -> str | None:
    """The bearer token of the header Cloud Run checked; None when there is none, or when that header
    comes more than once (which value was checked cannot be told)."""
    getlist = getattr(headers, "getlist", None)
    for name in (SERVERLESS_AUTHORIZATION, "Authorization"):
        values = list(getlist(name)) if getlist else ([headers[name]] if name in headers else [])
        if len(values) > 1:
            return None
        if values:
            scheme, _, token = str(values[0]).partition(" ")
            return token if scheme.lower() == "bearer" and token else None
    return None


def verified_caller(headers: Mapping[str, str] | Any, now: float | None = None) -> str | None:
    """The email of whoever Cloud Run let through; None when the checked header carries no Google ID
    token with a verified, unexpired email."""
    token = checked_token(headers)
    if token is None or token.count(".") != 2:
        return None
    try:
        claims = jwt.decode(token, verify=False)
    except (exceptions.GoogleAuthError, ValueError):
        return None
    email, expires = claims.get("email"), claims.get("exp")
    if claims.get("iss") not in GOOGLE_ISSUERS:
        return None
    if not isinstance(email, str) or claims.get("email_verified") is not True:
        return None
    if not isinstance(expires, int | float) or expires <= (time.time() if now is None else now):
        return None
    return email
