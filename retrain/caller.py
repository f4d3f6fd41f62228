"""Who called an HTTP function, as Cloud Run verified it.

A function that requires authentication is reached only through Cloud Run's IAM check: the request's
``Authorization: Bearer`` ID token must name an account holding ``run.routes.invoke`` (infra/ grants no
public invoker, and tests/infra checks it).  Cloud Run then hands the request on with the token, though
not always signed: a user's token ("The user generates an ID token by using gcloud commands ... Google
removes the token signature", cloud.google.com/run/docs/troubleshooting#signature-removed) arrives as
``header.payload.SIGNATURE_REMOVED_BY_GOOGLE``.  So the caller is read from the token's claims without
verifying a signature again (which would refuse every user): Cloud Run's check is the verification, and
a token that reached the function passed it.  Its ``email`` counts only when ``email_verified`` and
while the token has not expired.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from google.auth import exceptions, jwt


def verified_caller(headers: Mapping[str, str], now: float | None = None) -> str | None:
    """The email of whoever Cloud Run let through (the ``Authorization`` header's ID token); None when
    the request carries no token with a verified, unexpired email."""
    authorization = headers.get("Authorization") or ""
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or token.count(".") != 2:
        return None
    try:
        claims = jwt.decode(token, verify=False)
    except (exceptions.GoogleAuthError, ValueError):
        return None
    email, expires = claims.get("email"), claims.get("exp")
    if not isinstance(email, str) or claims.get("email_verified") is not True:
        return None
    if not isinstance(expires, int | float) or expires <= (time.time() if now is None else now):
        return None
    return email
