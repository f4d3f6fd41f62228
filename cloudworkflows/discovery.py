"""Connector calls checked against Google's own API definitions before they are served.

A Workflows connector call ``googleapis.<api>.<version>.<resource>....<method>`` takes the REST method's
parameters as its arguments and the request as ``body`` (Cloud Workflows, "Connectors reference": each
method's arguments are its path and query parameters, ``body``, and ``connector_params``).  The
method, its parameters and its request schema are those of the API's discovery document, which
``google-api-python-client`` ships (``googleapiclient/discovery_cache/documents/<api>.<version>.json``).
A query parameter with a dotted name (Firestore's ``currentDocument.exists``, ``updateMask.fieldPaths``)
is one argument holding a map (the connector reference lists ``currentDocument`` as an object with
``exists`` and ``updateTime``).

:func:`check_call` refuses a call to a method the API does not have, an argument the method does not
take, a required parameter left out, and a ``body`` field (at any depth) the request schema does not
have, naming it: Google's APIs answer such a request with HTTP 400 ("Invalid JSON payload received.
Unknown name ..."), and so does the interpreter, whether or not a backend is bound.
"""

from __future__ import annotations

import importlib.util
import json
from functools import cache
from pathlib import Path
from typing import Any

#: Arguments every connector takes besides the method's (Workflows' connector_params: timeout, polling).
CONNECTOR_ARGS = frozenset({"body", "connector_params"})


class ConnectorCallError(ValueError):
    """A connector call the API would refuse; the message names what is wrong."""


def _documents() -> Path:
    spec = importlib.util.find_spec("googleapiclient")
    if spec is None or not spec.submodule_search_locations:
        raise ConnectorCallError(
            "google-api-python-client is not installed: no API definitions to check against"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "discovery_cache" / "documents"


@cache
def document(api: str, version: str) -> dict[str, Any] | None:
    """The discovery document of ``api`` ``version`` (None: Google has no such API here)."""
    path = _documents() / f"{api}.{version}.json"
    return dict(json.loads(path.read_text(encoding="utf-8"))) if path.exists() else None


def method(call: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The discovery document and the method of connector ``call``; ConnectorCallError otherwise."""
    parts = call.split(".")
    if len(parts) < 5 or parts[0] != "googleapis":
        raise ConnectorCallError(f"{call}: a connector is googleapis.API.VERSION.RESOURCE...METHOD")
    api, version, path = parts[1], parts[2], parts[3:]
    doc = document(api, version)
    if doc is None:
        raise ConnectorCallError(f"{call}: Google has no API {api} {version}")
    node: dict[str, Any] = doc
    for resource in path[:-1]:
        node = node.get("resources", {}).get(resource)
        if node is None:
            raise ConnectorCallError(f"{call}: {api} {version} has no resource {resource!r} there")
    found = node.get("methods", {}).get(path[-1])
    if found is None:
        known = sorted(node.get("methods", {}))
        raise ConnectorCallError(f"{call}: no method {path[-1]!r} (the resource has {', '.join(known)})")
    return doc, found


def check_call(call: str, args: dict[str, Any]) -> None:
    """Refuse ``args`` for connector ``call`` where the API would (see the module's notes)."""
    doc, found = method(call)
    params: dict[str, Any] = {**doc.get("parameters", {}), **found.get("parameters", {})}
    groups: dict[str, set[str]] = {}
    for name in params:
        head, dot, rest = name.partition(".")
        if dot:
            groups.setdefault(head, set()).add(rest)
    for name, value in args.items():
        if name in CONNECTOR_ARGS or name in params:
            continue
        if name in groups:
            if not isinstance(value, dict):
                raise ConnectorCallError(
                    f"{call}: argument {name} is a map of {', '.join(sorted(groups[name]))}"
                )
            for key in value:
                if key not in groups[name]:
                    raise ConnectorCallError(
                        f"{call}: unknown parameter {name}.{key} (the method takes "
                        f"{', '.join(f'{name}.{k}' for k in sorted(groups[name]))})"
                    )
            continue
        takes = ", ".join(sorted(found.get("parameters", {})))
        raise ConnectorCallError(f"{call}: unknown parameter {name!r} (the method takes {takes})")
    missing = [p for p, spec in found.get("parameters", {}).items() if spec.get("required") and p not in args]
    if missing:
        raise ConnectorCallError(f"{call}: missing required parameter(s) {', '.join(sorted(missing))}")
    request = found.get("request")
    if "body" in args and args["body"] is not None:
        if request is None:
            raise ConnectorCallError(f"{call}: the method takes no request body")
        _check_fields(call, "body", args["body"], {"$ref": request["$ref"]}, doc["schemas"])


def _check_fields(call: str, where: str, value: Any, schema: dict[str, Any], schemas: dict[str, Any]) -> None:
    while "$ref" in schema:
        schema = schemas[schema["$ref"]]
    kind = schema.get("type")
    if kind == "object" or "properties" in schema:
        if not isinstance(value, dict):
            return  # scalars and types are the API's to check; names are what is checked here
        props = schema.get("properties")
        extra = schema.get("additionalProperties")
        for key, item in value.items():
            if props is not None and key in props:
                _check_fields(call, f"{where}.{key}", item, props[key], schemas)
            elif extra is not None:
                _check_fields(call, f"{where}.{key}", item, extra, schemas)
            elif props is not None:
                raise ConnectorCallError(
                    f"{call}: unknown field {where}.{key} (it has {', '.join(sorted(props))})"
                )
    elif kind == "array" and isinstance(value, list):
        for i, item in enumerate(value):
            _check_fields(call, f"{where}[{i}]", item, schema.get("items", {}), schemas)


#: ``gke.request``'s arguments (Workflows connector reference, connectors/gke/request): the three
#: without a default are required.
GKE_REQUEST_ARGS = frozenset({"cluster_id", "path", "method", "project", "location", "timeout", "body"})
GKE_REQUEST_ARGS |= {"headers", "query"}
GKE_REQUEST_REQUIRED = ("cluster_id", "method", "path")
#: "ValueError: If timeout is > 1800" (the same reference).
GKE_REQUEST_MAX_TIMEOUT_S = 1800


def check_gke_request(args: dict[str, Any]) -> tuple[str, str] | None:
    """Why ``gke.request`` would refuse ``args``: the error's tag and message (None: it takes them)."""
    unknown = sorted(set(args) - GKE_REQUEST_ARGS - {"connector_params"})
    if unknown:
        takes = ", ".join(sorted(GKE_REQUEST_ARGS))
        return "TypeError", f"gke.request: unknown argument(s) {', '.join(unknown)} (it takes {takes})"
    missing = [a for a in GKE_REQUEST_REQUIRED if a not in args]
    if missing:
        return "TypeError", f"gke.request: missing argument(s) {', '.join(missing)}"
    nulls = [a for a in ("body", "query", "headers") if a in args and args[a] is None]
    if nulls:
        # "query: Optional query parameters. If present, must be a map of simple types" (headers alike);
        # how a null body is sent is not documented either: a call leaves such keys out.
        return "TypeError", f"gke.request: {', '.join(nulls)} is null (leave an argument out instead)"
    timeout = args.get("timeout")
    if isinstance(timeout, int | float) and timeout > GKE_REQUEST_MAX_TIMEOUT_S:
        return "ValueError", f"gke.request: timeout {timeout} is over {GKE_REQUEST_MAX_TIMEOUT_S} s"
    return None
