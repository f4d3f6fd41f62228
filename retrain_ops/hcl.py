"""Read Terraform (HCL) the way Terraform does, for the few expressions ``infra/`` uses.

The local stack and the tests read the deployment instead of restating it: a stage's variable
defaults, locals, resource attributes and outputs are evaluated here from the ``.tf`` files
themselves (parsed by python-hcl2, whose Lark tree is walked below).  Supported: literals, string
templates, references (``var.``, ``local.``, ``each.``, resources, data sources), indexing, unary and
binary operators, conditionals, ``for`` expressions and the functions listed in :data:`FUNCTIONS`.
Anything else raises :class:`HclError` naming the expression, so an unsupported construct is noticed
rather than misread.

Values the cloud computes (a service account's email, a topic's id, the project number) have
stand-ins built the way Google forms them; see :meth:`Stage.computed`.
"""

from __future__ import annotations

import base64
import contextlib
import copy
import hashlib
import importlib.metadata
import json
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import hcl2
from lark import Token, Tree

_HCL2 = importlib.metadata.version("python-hcl2")


class HclError(ValueError):
    """An expression this reader cannot evaluate (or a reference to something that does not exist)."""


#: The project number Google would compute, as the local stand-ins use it.
LOCAL_PROJECT_NUMBER = "000000000000"


def _tostring(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float) and v.is_integer():
        return str(int(v))
    if isinstance(v, (int, float, str)):
        return str(v)
    raise HclError(f"tostring: cannot convert {type(v).__name__}")


def _jsonencode(v: Any) -> str:
    return json.dumps(v, separators=(",", ":"))


#: Terraform's functions, as far as infra/ uses them.
FUNCTIONS: dict[str, Callable[..., Any]] = {
    "tostring": _tostring,
    "tonumber": lambda v: float(v) if "." in str(v) else int(v),
    "jsonencode": _jsonencode,
    "jsondecode": json.loads,
    "file": lambda path: Path(str(path)).read_text(),
    "fileexists": lambda path: Path(str(path)).is_file(),
    "abspath": lambda path: os.path.abspath(str(path)),
    "base64encode": lambda s: base64.b64encode(str(s).encode()).decode(),
    "base64decode": lambda s: base64.b64decode(str(s)).decode(),
    "join": lambda sep, items: str(sep).join(_tostring(i) for i in items),
    "split": lambda sep, s: str(s).split(str(sep)),
    "lower": lambda s: str(s).lower(),
    "upper": lambda s: str(s).upper(),
    "replace": lambda s, old, new: str(s).replace(str(old), str(new)),
    "length": len,
    "max": max,
    "min": min,
    "keys": lambda m: sorted(m),
    "values": lambda m: [m[k] for k in sorted(m)],
    "merge": lambda *ms: {k: v for m in ms for k, v in m.items()},
    "lookup": lambda m, k, *default: m[k] if k in m or not default else default[0],
    "contains": lambda items, v: v in items,
    "alltrue": lambda items: all(items),
    "concat": lambda *ls: [x for seq in ls for x in seq],
    "toset": lambda items: sorted(set(items), key=str),
    "tolist": list,
    "tomap": dict,
    "coalesce": lambda *xs: next(x for x in xs if x not in (None, "")),
    "format": lambda fmt, *args: str(fmt).replace("%s", "{}").replace("%d", "{}").format(*args),
}


def unquote(key: str) -> str:
    """python-hcl2 keeps the quotes of quoted block labels and keys."""
    return key[1:-1] if len(key) >= 2 and key[0] == key[-1] == '"' else key


@cache
def _parse_expression(source: str) -> Tree:
    tree = hcl2.parses_to_tree(f"x = {source}\n")
    body = next(c for c in tree.children if isinstance(c, Tree) and c.data == "body")
    attribute = next(c for c in body.children if isinstance(c, Tree) and c.data == "attribute")
    return [c for c in attribute.children if isinstance(c, Tree)][-1]


def _trees(node: Tree) -> list[Tree]:
    return [c for c in node.children if isinstance(c, Tree)]


def _token(node: Tree) -> str:
    return "".join(str(c) for c in node.children if isinstance(c, Token))


Resolve = Callable[[str], Any]


@dataclass
class Evaluator:
    """Evaluates python-hcl2 values: ``resolve`` answers a root name (``var``, ``local``, a resource
    type, ``each`` ...) with a mapping, walked by the attribute and index accesses that follow."""

    resolve: Resolve
    bound: dict[str, Any] = field(default_factory=dict)

    def value(self, raw: Any) -> Any:
        """A value as python-hcl2 gives it: quoted strings and ``${...}`` are expressions."""
        if isinstance(raw, str):
            if raw.startswith("${") and raw.endswith("}"):
                return self.expression(raw[2:-1])
            if raw.startswith('"') and raw.endswith('"'):
                return self.expression(raw)
            return raw
        if isinstance(raw, list):
            return [self.value(v) for v in raw]
        if isinstance(raw, dict):
            return {unquote(k): self.value(v) for k, v in raw.items() if k != "__is_block__"}
        return raw

    def expression(self, source: str) -> Any:
        try:
            return self.eval(_parse_expression(source))
        except HclError as e:
            raise HclError(f"{source}: {e}") from None
        except Exception as e:  # a parse error or a type error in a function
            raise HclError(f"{source}: {type(e).__name__}: {e}") from None

    def eval(self, node: Tree) -> Any:
        kind = node.data
        kids = _trees(node)
        if kind in ("expr_term", "binary_term") and len(kids) == 1 and kind == "expr_term":
            return self.eval(kids[0])
        if kind == "expr_term" and not kids:
            return None  # "()" or empty
        if kind == "identifier":
            name = _token(node)
            if name in self.bound:
                return self.bound[name]
            return self.resolve(name)
        if kind == "int_lit":
            return int(_token(node))
        if kind == "float_lit":
            return float(_token(node))
        if kind == "literal_value":
            return {"true": True, "false": False, "null": None}[_token(node)]
        if kind == "string":
            parts = [self._string_part(p) for p in kids]
            return (
                parts[0]
                if len(parts) == 1 and not isinstance(parts[0], str)
                else "".join(_tostring(p) for p in parts)
            )
        if kind in ("tuple",):
            return [self.eval(k) for k in kids]
        if kind == "object":
            out = {}
            for elem in kids:
                key_node, value_node = _trees(elem)
                key_tree = _trees(key_node)[0]
                inner = _trees(key_tree)
                if key_tree.data == "expr_term" and inner and inner[0].data == "identifier":
                    key = _token(inner[0])  # a bare key names itself
                else:
                    key = _tostring(self.eval(key_tree))
                out[key] = self.eval(value_node)
            return out
        if kind == "get_attr_expr_term":
            base, attr = kids
            return self._get(self.eval(base), _token(_trees(attr)[0]))
        if kind == "index_expr_term":
            base, index = kids
            return self._get(self.eval(base), self.eval(_trees(index)[0]))
        if kind == "attr_splat_expr_term":
            base, splat = kids
            names = [_token(_trees(g)[0]) for g in _trees(splat)]
            out_list = []
            for item in self.eval(base):
                for n in names:
                    item = self._get(item, n)
                out_list.append(item)
            return out_list
        if kind == "function_call":
            name = _token(kids[0])
            if name == "try":  # lazy: the first argument that evaluates
                for arg in _trees(kids[1]):
                    try:
                        return self.eval(arg)
                    except HclError:
                        continue
                raise HclError("no argument of try() evaluates")
            args = [self.eval(a) for a in (_trees(kids[1]) if len(kids) > 1 else [])]
            if name not in FUNCTIONS:
                raise HclError(f"function {name}() is not supported")
            return FUNCTIONS[name](*args)
        if kind == "conditional":
            cond, yes, no = kids
            return self.eval(yes) if self.eval(cond) else self.eval(no)
        if kind == "unary_op":
            op = _token(node).strip()
            v = self.eval(kids[0])
            return -v if op == "-" else not v
        if kind == "binary_op":
            left = self.eval(kids[0])
            term = kids[1]
            op_node, right_node = _trees(term)
            return _binary(_token(op_node).strip(), left, self.eval(right_node))
        if kind in ("for_tuple_expr", "for_object_expr"):
            return self._for(kind, kids)
        raise HclError(f"unsupported expression ({kind})")

    def _string_part(self, part: Tree) -> Any:
        inner = _trees(part)
        if inner and inner[0].data == "interpolation":
            return self.eval(_trees(inner[0])[0])
        return _token(part).replace('\\"', '"').replace("\\n", "\n")

    @staticmethod
    def _get(base: Any, key: Any) -> Any:
        try:
            return base[key]
        except (KeyError, IndexError, TypeError):
            raise HclError(f"no {key!r} in {str(base)[:80]}") from None

    def _for(self, kind: str, kids: list[Tree]) -> Any:
        intro, *rest = kids
        names = [_token(i) for i in _trees(intro) if i.data == "identifier"]
        collection = self.eval(_trees(intro)[-1])
        cond = rest[-1] if rest and rest[-1].data == "for_cond" else None
        body = rest[:-1] if cond is not None else rest
        items = collection.items() if isinstance(collection, dict) else enumerate(collection)
        out_list: list[Any] = []
        out_map: dict[str, Any] = {}
        for k, v in items:
            scope = dict(zip(names, (k, v) if len(names) == 2 else (v,), strict=False))
            inner = Evaluator(self.resolve, {**self.bound, **scope})
            if cond is not None and not inner.eval(_trees(cond)[0]):
                continue
            if kind == "for_tuple_expr":
                out_list.append(inner.eval(body[0]))
            else:
                out_map[_tostring(inner.eval(body[0]))] = inner.eval(body[1])
        return out_list if kind == "for_tuple_expr" else out_map


def _binary(op: str, a: Any, b: Any) -> Any:
    ops: dict[str, Callable[[Any, Any], Any]] = {
        "==": lambda x, y: x == y,
        "!=": lambda x, y: x != y,
        "<": lambda x, y: x < y,
        ">": lambda x, y: x > y,
        "<=": lambda x, y: x <= y,
        ">=": lambda x, y: x >= y,
        "&&": lambda x, y: x and y,
        "||": lambda x, y: x or y,
        "+": lambda x, y: x + y,
        "-": lambda x, y: x - y,
        "*": lambda x, y: x * y,
        "/": lambda x, y: x / y,
        "%": lambda x, y: x % y,
    }
    if op not in ops:
        raise HclError(f"operator {op} is not supported")
    return ops[op](a, b)


class _Lazy(Mapping[str, Any]):
    """A mapping whose values are computed on first access (locals, outputs, resource attributes)."""

    def __init__(self, names: Iterator[str] | list[str], get: Callable[[str], Any]) -> None:
        self._names = list(names)
        self._get = get
        self._cache: dict[str, Any] = {}

    def __getitem__(self, key: str) -> Any:
        if key not in self._names:
            raise KeyError(key)
        if key not in self._cache:
            self._cache[key] = self._get(key)
        return self._cache[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def parse(text: str) -> dict[str, Any]:
    """A file's blocks as python-hcl2 parses them, once per content (:func:`_parsed`): every settings load,
    deploy and test reads the stages again, and lark's parse is most of their cost. A copy: no reader
    shares another's blocks."""
    return copy.deepcopy(_parsed(text))


def cache_dir() -> Path:
    """Where parsed files are kept across processes (the XDG cache folder: ``~/.cache/retrain/hcl``)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "retrain" / "hcl"


@cache
def _parsed(text: str) -> dict[str, Any]:
    """The file's parse, kept on disk by its content and the parser's version: lark's parse of infra/ was
    about 40% of a ``retrain`` command's CPU, and of every test process that reads the deployment.  A
    cache that cannot be read or written is parsed around, never an error."""
    key = hashlib.sha256(f"python-hcl2 {_HCL2}\0{text}".encode()).hexdigest()
    kept = cache_dir() / f"{key}.json"
    with contextlib.suppress(OSError, ValueError):
        parsed = json.loads(kept.read_text())
        if isinstance(parsed, dict):
            return parsed
    parsed = hcl2.loads(text)
    with contextlib.suppress(OSError):
        kept.parent.mkdir(parents=True, exist_ok=True)
        partial = kept.with_name(f"{kept.name}.{os.getpid()}.{threading.get_ident()}")
        partial.write_text(json.dumps(parsed))
        os.replace(partial, kept)  # whole or not at all, whoever writes the same key beside it
    return parsed


@dataclass
class Stage:
    """One Terraform root module (``infra/<stage>``): its blocks, evaluated on demand.

    ``variables`` override the declared defaults (a required variable has none); ``platform`` stands for
    ``data.terraform_remote_state.platform.outputs`` (the app stage reads the platform stage's outputs).
    """

    path: Path
    variables: Mapping[str, Any] = field(default_factory=dict)
    platform: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        self.blocks: dict[str, list[Any]] = {}
        for tf in sorted(self.path.glob("*.tf")):
            for kind, items in parse(tf.read_text()).items():
                self.blocks.setdefault(kind, []).extend(items)
        self.declared = {unquote(n): b for item in self.blocks.get("variable", []) for n, b in item.items()}
        self.locals_raw = {
            k: v for item in self.blocks.get("locals", []) for k, v in item.items() if k != "__is_block__"
        }
        self.outputs_raw = {unquote(n): b for item in self.blocks.get("output", []) for n, b in item.items()}
        self.evaluator = Evaluator(self._root)

    # --- what other code asks for ---

    def var(self, name: str) -> Any:
        if name in self.variables:
            return self.variables[name]
        if name not in self.declared:
            raise HclError(f"variable {name!r} is not declared in {self.path}")
        if "default" not in self.declared[name]:
            raise HclError(f"variable {name!r} has no default: give it a value")
        return self.evaluator.value(self.declared[name]["default"])

    def local(self, name: str) -> Any:
        if name not in self.locals_raw:
            raise HclError(f"local {name!r} is not defined in {self.path}")
        return self.evaluator.value(self.locals_raw[name])

    def output(self, name: str) -> Any:
        if name not in self.outputs_raw:
            raise HclError(f"output {name!r} is not defined in {self.path}")
        return self.evaluator.value(self.outputs_raw[name]["value"])

    def outputs(self) -> Mapping[str, Any]:
        return _Lazy(list(self.outputs_raw), self.output)

    def resource(self, rtype: str, name: str, kind: str = "resource") -> dict[str, Any]:
        """The raw (unevaluated) body of a resource or data block."""
        for item in self.blocks.get(kind, []):
            for t, named in item.items():
                if unquote(t) != rtype:
                    continue
                for n, body in named.items():
                    if unquote(n) == name:
                        return dict(body)
        raise HclError(f"{kind} {rtype}.{name} is not defined in {self.path}")

    def resources(self, rtype: str, kind: str = "resource") -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for item in self.blocks.get(kind, []):
            for t, named in item.items():
                if unquote(t) == rtype:
                    out.update({unquote(n): dict(b) for n, b in named.items()})
        return out

    def evaluate(self, raw: Any, **bound: Any) -> Any:
        """A raw value of this stage (e.g. a resource attribute), with names bound (``each``)."""
        return Evaluator(self._root, bound).value(raw)

    # --- reference resolution ---

    def _root(self, name: str) -> Any:
        if name == "var":
            return _Lazy(list(self.declared), self.var)
        if name == "local":
            names = list(self.locals_raw) + (["platform"] if self.platform is not None else [])
            return _Lazy(names, lambda k: self.platform if k == "platform" else self.local(k))
        if name == "path":
            return {"module": str(self.path)}
        if name == "data":
            return _Lazy(self._types("data"), lambda t: self._named(t, "data"))
        if name in self._types("resource"):
            return self._named(name, "resource")
        raise HclError(f"unknown reference {name!r}")

    def _types(self, kind: str) -> list[str]:
        return [unquote(t) for item in self.blocks.get(kind, []) for t in item]

    def _named(self, rtype: str, kind: str) -> Mapping[str, Any]:
        names = list(self.resources(rtype, kind))
        return _Lazy(names, lambda n: self._attributes(rtype, n, kind))

    def _attributes(self, rtype: str, name: str, kind: str) -> Any:
        """A resource's attributes; a resource with ``count`` is the list of its instances."""
        body = self.resource(rtype, name, kind)
        if "count" in body:
            return [
                self._instance(rtype, body, {"count": {"index": i}})
                for i in range(int(self.evaluate(body["count"])))
            ]
        return self._instance(rtype, body, {})

    def _instance(self, rtype: str, body: Mapping[str, Any], bound: Mapping[str, Any]) -> Mapping[str, Any]:
        plain = [k for k in body if k not in ("__is_block__", "count")]
        computed = self.computed(rtype, body, bound)
        return _Lazy(
            sorted(set(plain) | set(computed)),
            lambda a: computed[a]() if a in computed and a not in body else self.evaluate(body[a], **bound),
        )

    def computed(
        self, rtype: str, body: Mapping[str, Any], bound: Mapping[str, Any] | None = None
    ) -> dict[str, Callable[[], Any]]:
        """Stand-ins for attributes Google computes, formed the way Google forms them (no API call)."""
        ev = lambda k: self.evaluate(body[k], **(bound or {}))  # noqa: E731
        project = lambda: ev("project") if "project" in body else self.var("project_id")  # noqa: E731
        out: dict[str, Callable[[], Any]] = {}
        if rtype == "google_service_account":
            email = lambda: f"{ev('account_id')}@{project()}.iam.gserviceaccount.com"  # noqa: E731
            out["email"] = email
            out["id"] = lambda: f"projects/{project()}/serviceAccounts/{email()}"
            out["name"] = out["id"]
        elif rtype == "google_pubsub_topic":
            out["id"] = lambda: f"projects/{project()}/topics/{ev('name')}"
        elif rtype == "google_pubsub_subscription":
            out["id"] = lambda: f"projects/{project()}/subscriptions/{ev('name')}"
        elif rtype == "google_container_cluster":
            out["id"] = lambda: f"projects/{project()}/locations/{ev('location')}/clusters/{ev('name')}"
            out["endpoint"] = lambda: ""
            out["master_auth"] = lambda: [{"cluster_ca_certificate": ""}]
        elif rtype in ("google_compute_network", "google_compute_subnetwork"):
            base = "https://www.googleapis.com/compute/v1/projects/{}/{}/{}"
            if rtype == "google_compute_network":
                out["self_link"] = lambda: base.format(project(), "global/networks", ev("name"))
            else:
                region = lambda: ev("region") if "region" in body else self.var("region")  # noqa: E731
                out["self_link"] = lambda: base.format(
                    project(), f"regions/{region()}/subnetworks", ev("name")
                )
            out["id"] = out["self_link"]
        elif rtype == "google_artifact_registry_repository":
            out["id"] = lambda: (
                f"projects/{project()}/locations/{ev('location')}/repositories/{ev('repository_id')}"
            )
            out["name"] = lambda: ev("repository_id")
        elif rtype == "google_project_iam_custom_role":
            out["name"] = lambda: f"projects/{project()}/roles/{ev('role_id')}"
            out["id"] = out["name"]
        elif rtype == "google_cloudfunctions2_function":
            out["name"] = lambda: ev("name")
        elif rtype == "google_project":  # data source: the number is Google's; a fixed local stand-in
            out["number"] = lambda: LOCAL_PROJECT_NUMBER
        elif rtype == "google_storage_project_service_account":  # data source: Cloud Storage's agent
            agent = "gs-project-accounts"
            out["email_address"] = lambda: f"service-{LOCAL_PROJECT_NUMBER}@{agent}.iam.gserviceaccount.com"
            out["member"] = lambda: f"serviceAccount:{out['email_address']()}"
        elif rtype == "google_project_service_identity":
            # a service's agent (cloud.google.com/iam/docs/service-agents)
            agent = {"pubsub.googleapis.com": "gcp-sa-pubsub"}.get(str(ev("service")), "gcp-sa-unknown")
            out["email"] = lambda: f"service-{LOCAL_PROJECT_NUMBER}@{agent}.iam.gserviceaccount.com"
            out["member"] = lambda: f"serviceAccount:{out['email']()}"
        return out
