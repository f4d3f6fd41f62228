"""A small structural-schema checker for CRD ``openAPIV3Schema`` (what a v1.20 API server enforces,
plus unknown-field detection: the server would prune those silently, the checker reports them).

CEL rules (``x-kubernetes-validations``) are not evaluated; ``format`` is not checked.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

_TYPES: dict[str, tuple[type, ...]] = {
    "object": (dict,),
    "array": (list,),
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
}


def validate(obj: Any, schema: dict[str, Any], path: str = "") -> list[str]:
    """Errors of ``obj`` against one structural schema node (empty when valid)."""
    errs: list[str] = []
    where = path or "<root>"
    if obj is None:
        if not schema.get("nullable"):
            errs.append(f"{where}: null not allowed")
        return errs
    if schema.get("x-kubernetes-int-or-string"):
        if isinstance(obj, bool) or not isinstance(obj, int | str):
            errs.append(f"{where}: must be an integer or a string")
        return errs
    t = schema.get("type")
    if t:
        ok = isinstance(obj, _TYPES[t]) and not (t in ("integer", "number") and isinstance(obj, bool))
        if not ok:
            return [f"{where}: expected {t}, got {type(obj).__name__}"]
    if "enum" in schema and obj not in schema["enum"]:
        errs.append(f"{where}: {obj!r} not in {schema['enum']}")
    if isinstance(obj, str):
        if "maxLength" in schema and len(obj) > schema["maxLength"]:
            errs.append(f"{where}: longer than {schema['maxLength']}")
        if "minLength" in schema and len(obj) < schema["minLength"]:
            errs.append(f"{where}: shorter than {schema['minLength']}")
        if "pattern" in schema:
            try:
                if not re.search(schema["pattern"], obj):
                    errs.append(f"{where}: {obj!r} does not match {schema['pattern']}")
            except re.error:
                pass
    if isinstance(obj, int | float) and not isinstance(obj, bool):
        if "minimum" in schema and obj < schema["minimum"]:
            errs.append(f"{where}: below minimum {schema['minimum']}")
        if "maximum" in schema and obj > schema["maximum"]:
            errs.append(f"{where}: above maximum {schema['maximum']}")
    if isinstance(obj, list):
        if "maxItems" in schema and len(obj) > schema["maxItems"]:
            errs.append(f"{where}: more than {schema['maxItems']} items")
        if "minItems" in schema and len(obj) < schema["minItems"]:
            errs.append(f"{where}: fewer than {schema['minItems']} items")
        items = schema.get("items")
        if isinstance(items, dict):
            for i, item in enumerate(obj):
                errs += validate(item, items, f"{path}[{i}]")
    if isinstance(obj, dict):
        for req in schema.get("required", []):
            if req not in obj:
                errs.append(f"{where}: missing required field {req!r}")
        if "maxProperties" in schema and len(obj) > schema["maxProperties"]:
            errs.append(f"{where}: more than {schema['maxProperties']} properties")
        props = schema.get("properties")
        addl = schema.get("additionalProperties")
        preserve = schema.get("x-kubernetes-preserve-unknown-fields")
        for k, v in obj.items():
            sub = f"{path}.{k}" if path else k
            if props is not None and k in props:
                errs += validate(v, props[k], sub)
            elif isinstance(addl, dict):
                errs += validate(v, addl, sub)
            elif (props is not None or addl is False) and not preserve:
                errs.append(f"{sub}: unknown field (the API server would prune it)")
    return errs


_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def load_crds(directory: Path) -> list[dict[str, Any]]:
    """Every CustomResourceDefinition in ``directory``'s ``*.yaml`` files (parsed once per process)."""
    directory = Path(directory).resolve()
    key = (str(directory), tuple((f.name, f.stat().st_mtime_ns) for f in sorted(directory.glob("*.yaml"))))
    if key not in _CACHE:
        out = []
        for f in sorted(directory.glob("*.yaml")):
            for doc in yaml.load_all(f.read_text(), Loader=_Loader):
                if doc and doc.get("kind") == "CustomResourceDefinition":
                    out.append(doc)
        _CACHE[key] = out
    return copy.deepcopy(_CACHE[key])


_CACHE: dict[Any, list[dict[str, Any]]] = {}


def schema_for(api_version: str, kind: str, crds: Iterable[dict[str, Any]]) -> dict[str, Any] | None:
    group, _, version = api_version.rpartition("/")
    for crd in crds:
        spec = crd["spec"]
        if spec["group"] == group and spec["names"]["kind"] == kind:
            for v in spec["versions"]:
                if v["name"] == version and v.get("served", True):
                    return dict(v["schema"]["openAPIV3Schema"])
    return None


def validate_resource(obj: dict[str, Any], crds: Iterable[dict[str, Any]]) -> list[str]:
    """Errors of a custom resource against its CRD's schema; an error if no CRD serves its kind."""
    schema = schema_for(obj.get("apiVersion", ""), obj.get("kind", ""), crds)
    if schema is None:
        return [f"no CRD serves {obj.get('apiVersion')} {obj.get('kind')}"]
    # apiVersion/kind/metadata are the server's own; check only what the CRD describes below them.
    body = {k: v for k, v in obj.items() if k not in ("apiVersion", "kind", "metadata")}
    props = {
        k: v for k, v in schema.get("properties", {}).items() if k not in ("apiVersion", "kind", "metadata")
    }
    return validate(
        body,
        {
            **schema,
            "properties": props,
            "required": [
                r for r in schema.get("required", []) if r not in ("apiVersion", "kind", "metadata")
            ],
        },
    )
