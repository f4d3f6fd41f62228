"""The Workflows standard library, implemented against a small runtime interface.

Names, argument names and raised error tags follow cloud.google.com/workflows/docs/reference/stdlib.
Blocking functions (HTTP, sleep, log, callbacks) are only callable from ``call`` steps, as in
Workflows; the loader enforces that.
"""

from __future__ import annotations

import base64 as _b64
import binascii
import hashlib
import hmac
import json as _json
import logging
import math as _math
import re
import uuid as _uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Protocol
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import requests

from .errors import WorkflowError, error, http_error, key_error, type_error, value_error
from .expressions import FunctionRef, check_int, is_number, json_safe, to_display_string, wtype
from .re2 import RE2Error, compile_re2
from .re2 import matches as re2_matches

log = logging.getLogger("cloudworkflows.sys.log")


class Runtime(Protocol):
    """What stdlib functions may use from the running execution."""

    env: Mapping[str, str]
    execution_name: str
    hub: Any
    executions: Any
    connectors: Any

    def sleep(self, seconds: float) -> None: ...

    def now(self) -> float: ...

    def check_cancel(self) -> None: ...


@dataclass
class StdFunction:
    name: str
    fn: Callable[..., Any]
    params: tuple[str, ...]
    required: int
    blocking: bool = False
    extra_args: tuple[str, ...] = field(default_factory=tuple)

    def invoke(self, rt: Runtime, args: list[Any] | None = None, kwargs: dict[str, Any] | None = None) -> Any:
        positional = list(args or [])
        named = dict(kwargs or {})
        if len(positional) > len(self.params):
            raise type_error(
                f"{self.name}() takes at most {len(self.params)} arguments, got {len(positional)}"
            )
        for name in named:
            if name not in self.params and name not in self.extra_args:
                raise type_error(f"{self.name}() got an unexpected argument '{name}'")
        bound = dict(zip(self.params, positional, strict=False))
        bound.update({k: v for k, v in named.items() if k in self.params})
        missing = [p for p in self.params[: self.required] if p not in bound]
        if missing:
            raise type_error(f"{self.name}() missing required argument(s): {', '.join(missing)}")
        return self.fn(rt, **bound)


@dataclass(frozen=True)
class RetryPolicy:
    """A named retry policy object such as ``http.default_retry``."""

    name: str
    predicate: str
    max_retries: int = 5
    initial_delay: float = 1.0
    max_delay: float = 60.0
    multiplier: float = 1.25


FUNCTIONS: dict[str, StdFunction] = {}
POLICIES: dict[str, RetryPolicy] = {
    "http.default_retry": RetryPolicy("http.default_retry", "http.default_retry_predicate"),
    "http.default_retry_non_idempotent": RetryPolicy(
        "http.default_retry_non_idempotent", "http.default_retry_predicate_non_idempotent"
    ),
}
OBJECTS: dict[str, Any] = {"retry.default_backoff": {"initial_delay": 1, "max_delay": 60, "multiplier": 1.25}}


def _register(
    name: str,
    params: str = "",
    required: int | None = None,
    blocking: bool = False,
    extra: tuple[str, ...] = (),
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    names = tuple(p for p in params.split(",") if p)

    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        FUNCTIONS[name] = StdFunction(
            name, fn, names, len(names) if required is None else required, blocking, extra
        )
        return fn

    return deco


def _want(value: Any, kind: str, fn: str, arg: str) -> None:
    ok = {
        "string": isinstance(value, str),
        "list": isinstance(value, list),
        "map": isinstance(value, dict),
        "number": is_number(value),
        "integer": isinstance(value, int) and not isinstance(value, bool),
        "bytes": isinstance(value, bytes | bytearray),
        "boolean": isinstance(value, bool),
    }[kind]
    if not ok:
        raise type_error(f"{fn}: argument '{arg}' must be {kind}, got {wtype(value)}")


# --------------------------------------------------------------------------- expression helpers


@_register("default", "value,default_value")
def _default(rt: Runtime, value: Any, default_value: Any) -> Any:
    return default_value if value is None else value


@_register("if", "condition,ifTrue,ifFalse")
def _if(rt: Runtime, condition: Any, ifTrue: Any, ifFalse: Any) -> Any:
    """ "If condition evaluates to true, ifTrue is returned. If condition evaluates to false or null,
    ifFalse is returned." (cloud.google.com/workflows/docs/reference/stdlib/expression-helpers). A
    condition of another type is a TypeError here: the page names no other outcome."""
    if condition is not None and not isinstance(condition, bool):
        raise type_error(f"if: condition must be a boolean or null, got {wtype(condition)}")
    return ifTrue if condition else ifFalse


@_register("keys", "map")
def _keys(rt: Runtime, map: Any) -> Any:
    _want(map, "map", "keys", "map")
    return list(map.keys())


@_register("len", "value")
def _len(rt: Runtime, value: Any) -> Any:
    if isinstance(value, str | list | dict | bytes | bytearray):
        return len(value)
    raise type_error(f"len: unsupported type {wtype(value)}")


@_register("int", "value")
def _int(rt: Runtime, value: Any) -> Any:
    if isinstance(value, bool):
        raise type_error("int: cannot convert boolean")
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        if not _math.isfinite(value):
            raise value_error(f"int: cannot convert {value}")
        return check_int(int(value))
    if isinstance(value, str):
        try:
            return check_int(int(value.strip()))
        except ValueError:
            try:
                return check_int(int(float(value.strip())))
            except ValueError:
                raise value_error(f"int: cannot convert '{value}'") from None
    raise type_error(f"int: cannot convert {wtype(value)}")


@_register("double", "value")
def _double(rt: Runtime, value: Any) -> Any:
    if isinstance(value, bool):
        raise type_error("double: cannot convert boolean")
    if is_number(value):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value.strip())
        except ValueError:
            raise value_error(f"double: cannot convert '{value}'") from None
    raise type_error(f"double: cannot convert {wtype(value)}")


@_register("string", "value")
def _string(rt: Runtime, value: Any) -> Any:
    return to_display_string(value)


@_register("get_type", "value")
def _get_type(rt: Runtime, value: Any) -> Any:
    return wtype(value)


# --------------------------------------------------------------------------- list / map


@_register("list.concat", "objs,val")
def _list_concat(rt: Runtime, objs: Any, val: Any) -> Any:
    _want(objs, "list", "list.concat", "objs")
    return [*objs, val]


@_register("list.prepend", "objs,val")
def _list_prepend(rt: Runtime, objs: Any, val: Any) -> Any:
    _want(objs, "list", "list.prepend", "objs")
    return [val, *objs]


@_register("map.get", "map,keys")
def _map_get(rt: Runtime, map: Any, keys: Any) -> Any:
    if map is None:
        return None
    _want(map, "map", "map.get", "map")
    path = keys if isinstance(keys, list) else [keys]
    current: Any = map
    for key in path:
        if not isinstance(key, str):
            raise type_error(f"map.get: keys must be strings, got {wtype(key)}")
        if not isinstance(current, dict) or key not in current:
            return None
        current = current[key]
    return current


@_register("map.merge", "first,second")
def _map_merge(rt: Runtime, first: Any, second: Any) -> Any:
    _want(first, "map", "map.merge", "first")
    _want(second, "map", "map.merge", "second")
    return {**first, **second}


def _deep_merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    out = dict(a)
    for key, value in b.items():
        if isinstance(out.get(key), dict) and isinstance(value, dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


@_register("map.merge_nested", "first,second")
def _map_merge_nested(rt: Runtime, first: Any, second: Any) -> Any:
    _want(first, "map", "map.merge_nested", "first")
    _want(second, "map", "map.merge_nested", "second")
    return _deep_merge(first, second)


@_register("map.delete", "map,key")
def _map_delete(rt: Runtime, map: Any, key: Any) -> Any:
    _want(map, "map", "map.delete", "map")
    _want(key, "string", "map.delete", "key")
    return {k: v for k, v in map.items() if k != key}


# --------------------------------------------------------------------------- text


@_register("text.split", "source,separator")
def _text_split(rt: Runtime, source: Any, separator: Any) -> Any:
    _want(source, "string", "text.split", "source")
    _want(separator, "string", "text.split", "separator")
    if separator == "":
        return list(source)
    return source.split(separator)


@_register("text.replace_all", "source,substr,repl")
def _text_replace_all(rt: Runtime, source: Any, substr: Any, repl: Any) -> Any:
    for arg, v in (("source", source), ("substr", substr), ("repl", repl)):
        _want(v, "string", "text.replace_all", arg)
    return source.replace(substr, repl)


@_register("text.replace_all_regex", "source,regexp,repl")
def _text_replace_all_regex(rt: Runtime, source: Any, regexp: Any, repl: Any) -> Any:
    """ "regular expression backreferences are not supported and you can't refer to text previously
    matched by a capturing group": ``repl`` is inserted as written (.../stdlib/text/replace_all_regex)."""
    for arg, v in (("source", source), ("regexp", regexp), ("repl", repl)):
        _want(v, "string", "text.replace_all_regex", arg)
    out, at = [], 0
    for m in re2_matches(_compile(regexp, longest=True), source):
        out += [source[at : m.start()], repl]
        at = m.end()
    return "".join(out) + source[at:]


@_register("text.find_all", "source,substr")
def _text_find_all(rt: Runtime, source: Any, substr: Any) -> Any:
    _want(source, "string", "text.find_all", "source")
    _want(substr, "string", "text.find_all", "substr")
    # "A sorted list of indexes where the substring is found": non-overlapping, leftmost first, over code
    # points (cloud.google.com/workflows/docs/reference/stdlib/text/find_all; find_all_regex returns maps).
    out, start = [], 0
    if substr == "":
        return []
    while (idx := source.find(substr, start)) != -1:
        out.append(idx)
        start = idx + len(substr)
    return out


def _compile(regexp: str, longest: bool = False) -> Any:
    """``regexp`` in RE2's syntax (``re2.translate``); ``longest``: "if multiple matches start at the same
    index, then the longest one" is taken (.../stdlib/text/replace_all_regex, find_all_regex)."""
    try:
        return compile_re2(regexp, longest)
    except RE2Error as exc:
        raise value_error(f"invalid regular expression: {exc}") from None


@_register("text.match_regex", "source,regexp")
def _text_match_regex(rt: Runtime, source: Any, regexp: Any) -> Any:
    _want(source, "string", "text.match_regex", "source")
    _want(regexp, "string", "text.match_regex", "regexp")
    return _compile(regexp).search(source) is not None


@_register("text.find_all_regex", "source,regexp")
def _text_find_all_regex(rt: Runtime, source: Any, regexp: Any) -> Any:
    _want(source, "string", "text.find_all_regex", "source")
    _want(regexp, "string", "text.find_all_regex", "regexp")
    found = re2_matches(_compile(regexp, longest=True), source)
    return [{"index": m.start(), "match": m.group(0)} for m in found]


@_register("text.to_lower", "source")
def _text_to_lower(rt: Runtime, source: Any) -> Any:
    _want(source, "string", "text.to_lower", "source")
    return source.lower()


@_register("text.to_upper", "source")
def _text_to_upper(rt: Runtime, source: Any) -> Any:
    _want(source, "string", "text.to_upper", "source")
    return source.upper()


@_register("text.substring", "source,start,end")
def _text_substring(rt: Runtime, source: Any, start: Any, end: Any) -> Any:
    _want(source, "string", "text.substring", "source")
    _want(start, "integer", "text.substring", "start")
    _want(end, "integer", "text.substring", "end")
    # "A negative index is considered an offset from the end of the string. If an index is outside of the
    # source string's range, it is clamped to the bounds of the range."
    # (cloud.google.com/workflows/docs/reference/stdlib/text/substring)
    n = len(source)
    start, end = (min(max(i + n if i < 0 else i, 0), n) for i in (start, end))
    return source[start:end] if start < end else ""


@_register("text.decode", "data,charset", required=1)
def _text_decode(rt: Runtime, data: Any, charset: Any = "UTF-8") -> Any:
    _want(data, "bytes", "text.decode", "data")
    try:
        return bytes(data).decode(str(charset))
    except (LookupError, UnicodeDecodeError) as exc:
        raise value_error(f"text.decode: {exc}") from None


@_register("text.encode", "text,charset", required=1)
def _text_encode(rt: Runtime, text: Any, charset: Any = "UTF-8") -> Any:
    _want(text, "string", "text.encode", "text")
    try:
        return text.encode(str(charset))
    except (LookupError, UnicodeEncodeError) as exc:
        raise value_error(f"text.encode: {exc}") from None


@_register("text.url_encode", "source")
def _text_url_encode(rt: Runtime, source: Any) -> Any:
    """ "Letters, digits, and the characters .-_ are not escaped" (so "~" is, unlike Python's quote)
    (cloud.google.com/workflows/docs/reference/stdlib/text/url_encode)."""
    from urllib.parse import quote

    _want(source, "string", "text.url_encode", "source")
    return quote(source, safe="").replace("~", "%7E")


@_register("text.url_encode_plus", "source")
def _text_url_encode_plus(rt: Runtime, source: Any) -> Any:
    """Like text.url_encode, with "spaces replaced by pluses (+)" (.../stdlib/text/url_encode_plus)."""
    from urllib.parse import quote_plus

    _want(source, "string", "text.url_encode_plus", "source")
    return quote_plus(source, safe="").replace("~", "%7E")


@_register("text.url_decode", "source")
def _text_url_decode(rt: Runtime, source: Any) -> Any:
    """ "Plus signs (+) are replaced with spaces. Percent-encoded sequences are converted into UTF-8";
    ValueError "If source contains any % not followed by two hexadecimal characters"
    (cloud.google.com/workflows/docs/reference/stdlib/text/url_decode)."""
    from urllib.parse import unquote_plus

    _want(source, "string", "text.url_decode", "source")
    if re.search(r"%(?![0-9A-Fa-f]{2})", source):
        raise value_error(f"text.url_decode: a '%' not followed by two hexadecimal digits in '{source}'")
    return unquote_plus(source)


# --------------------------------------------------------------------------- json / base64


def _json_text(data: Any, indent: Any = None) -> str:
    """``indent``: "either a boolean, or a dictionary with two optional string attributes: prefix
    (defaulting to an empty string), and indent (defaulting to four spaces). Setting indent to true is
    equivalent to setting it to an empty dictionary" (cloud.google.com/workflows/docs/reference/stdlib/
    json/encode)."""
    if indent is True:
        indent = {}
    # "ValueError If the input contains types that cannot be JSON-encoded. Examples of such types include
    # callable and bytes." (the same page)
    data = json_safe(data, value_error)
    try:
        if isinstance(indent, dict):
            prefix = str(indent.get("prefix", ""))
            ind = indent.get("indent", "    ")
            text = _json.dumps(data, indent=ind, ensure_ascii=False)
            return "\n".join(prefix + line for line in text.split("\n"))
        return _json.dumps(data, separators=(",", ":"), ensure_ascii=False)
    except ValueError as exc:
        raise value_error(f"json.encode: {exc}") from None


@_register("json.encode", "data,indent", required=1)
def _json_encode(rt: Runtime, data: Any, indent: Any = None) -> Any:
    return _json_text(data, indent).encode("utf-8")


@_register("json.encode_to_string", "data,indent", required=1)
def _json_encode_to_string(rt: Runtime, data: Any, indent: Any = None) -> Any:
    return _json_text(data, indent)


@_register("json.decode", "data")
def _json_decode(rt: Runtime, data: Any) -> Any:
    if isinstance(data, bytes | bytearray):
        try:
            data = bytes(data).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise value_error(f"json.decode: {exc}") from None
    if not isinstance(data, str):
        raise type_error(f"json.decode: expected bytes or string, got {wtype(data)}")
    try:
        return _json.loads(data)
    except ValueError as exc:
        raise value_error(f"json.decode: {exc}") from None


@_register("base64.encode", "data,padding", required=1)
def _base64_encode(rt: Runtime, data: Any, padding: Any = True) -> Any:
    _want(data, "bytes", "base64.encode", "data")
    out = _b64.b64encode(bytes(data)).decode("ascii")
    return out if padding else out.rstrip("=")


#: hash.compute_checksum's algorithms, as its page lists them ("Supported algorithms: MD5, SHA1, SHA224,
#: SHA256, SHA384, SHA512"; cloud.google.com/workflows/docs/reference/stdlib/hash/compute_checksum).
CHECKSUM_ALGORITHMS = {
    "MD5": "md5",
    "SHA1": "sha1",
    "SHA224": "sha224",
    "SHA256": "sha256",
    "SHA384": "sha384",
    "SHA512": "sha512",
}


def _hash_algorithm(fn: str, algorithm: Any) -> str:
    """hashlib's name for a documented algorithm: TypeError for a non-string, ValueError otherwise."""
    _want(algorithm, "string", fn, "algorithm")
    name = CHECKSUM_ALGORITHMS.get(algorithm)
    if name is None:
        raise value_error(f"{fn}: unsupported algorithm {algorithm!r}")
    return name


@_register("hash.compute_checksum", "data,algorithm")
def _hash_compute_checksum(rt: Runtime, data: Any, algorithm: Any) -> Any:
    """ "TypeError If data is not in bytes, or if algorithm is not a string. ValueError If the provided
    hashing algorithm is not supported." Returns the checksum in bytes."""
    _want(data, "bytes", "hash.compute_checksum", "data")
    return hashlib.new(_hash_algorithm("hash.compute_checksum", algorithm), bytes(data)).digest()


@_register("hash.compute_hmac", "key,data,algorithm")
def _hash_compute_hmac(rt: Runtime, key: Any, data: Any, algorithm: Any) -> Any:
    """ "Computes the hash-based message authentication code (HMAC) for data given a secret key and
    hashing algorithm": the same algorithms, "TypeError If key and data are not in bytes, or if
    algorithm is not a string. ValueError If the provided hashing algorithm is not supported."
    (cloud.google.com/workflows/docs/reference/stdlib/hash/compute_hmac)."""
    _want(key, "bytes", "hash.compute_hmac", "key")
    _want(data, "bytes", "hash.compute_hmac", "data")
    return hmac.new(bytes(key), bytes(data), _hash_algorithm("hash.compute_hmac", algorithm)).digest()


@_register("base64.decode", "data,padding", required=1)
def _base64_decode(rt: Runtime, data: Any, padding: Any = True) -> Any:
    _want(data, "string", "base64.decode", "data")
    text = data if padding else data + "=" * (-len(data) % 4)
    try:
        return _b64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise value_error(f"base64.decode: {exc}") from None


# --------------------------------------------------------------------------- time / sys / math / uuid


@_register("time.format", "seconds,timezone", required=1)
def _time_format(rt: Runtime, seconds: Any, timezone: Any = None) -> Any:
    # "If not specified or if an empty string, the default is UTC"; time.format(1720788633, "GMT") ->
    # "2024-07-12T12:50:33.000000Z" (cloud.google.com/workflows/docs/reference/stdlib/time/format).
    _want(seconds, "number", "time.format", "seconds")
    tz: Any = UTC
    if timezone is not None and timezone not in ("", "UTC", "GMT"):
        try:
            tz = ZoneInfo(str(timezone))
        except (ZoneInfoNotFoundError, ValueError):
            raise value_error(f"time.format: unknown timezone '{timezone}'") from None
    dt = datetime.fromtimestamp(float(seconds), tz)
    text = dt.isoformat(timespec="microseconds")
    return text.replace("+00:00", "Z") if tz is UTC else text


@_register("time.parse", "value")
def _time_parse(rt: Runtime, value: Any) -> Any:
    _want(value, "string", "time.parse", "value")
    text = value.strip()
    if text.endswith(("Z", "z")):
        text = text[:-1] + "+00:00"
    match = re.match(r"^(.*T\d\d:\d\d:\d\d)(\.\d+)?(.*)$", text)
    if match and match.group(2) and len(match.group(2)) > 7:  # fromisoformat takes at most 6 digits
        text = match.group(1) + match.group(2)[:7] + match.group(3)
    try:
        dt = datetime.fromisoformat(text)
    except ValueError:
        raise value_error(f"time.parse: not an RFC 3339 timestamp: '{value}'") from None
    if dt.tzinfo is None:
        raise value_error(f"time.parse: timestamp needs a time zone offset: '{value}'")
    return dt.timestamp()


@_register("sys.now")
def _sys_now(rt: Runtime) -> Any:
    return rt.now()


@_register("sys.get_env", "name,default", required=1)
def _sys_get_env(rt: Runtime, name: Any, default: Any = None) -> Any:
    _want(name, "string", "sys.get_env", "name")
    if default is not None:
        _want(default, "string", "sys.get_env", "default")
    return rt.env.get(name, default)


#: "Maximum is 31536000 (one year)" (.../stdlib/sys/sleep); "The latest allowed time is one year from
#: now" (.../stdlib/sys/sleep_until).
MAX_SLEEP_S = 31_536_000


@_register("sys.sleep", "seconds", blocking=True)
def _sys_sleep(rt: Runtime, seconds: Any) -> Any:
    _want(seconds, "number", "sys.sleep", "seconds")
    if not 0 <= seconds <= MAX_SLEEP_S:
        raise value_error(f"sys.sleep: seconds must be between 0 and {MAX_SLEEP_S}, got {seconds}")
    rt.sleep(float(seconds))
    return None


@_register("sys.sleep_until", "time", blocking=True)
def _sys_sleep_until(rt: Runtime, time: Any) -> Any:
    """TypeError "If time is not a string", ValueError "If time is not ISO 8601-compatible"; a time
    already past returns at once (.../stdlib/sys/sleep_until)."""
    target = _time_parse(rt, time)
    if target - rt.now() > MAX_SLEEP_S:
        raise value_error(f"sys.sleep_until: {time} is more than a year from now")
    rt.sleep(max(0.0, target - rt.now()))
    return None


_SEVERITIES = {
    "DEFAULT": logging.INFO,
    "DEBUG": logging.DEBUG,
    "INFO": logging.INFO,
    "NOTICE": logging.INFO,
    "WARNING": logging.WARNING,
    "ERROR": logging.ERROR,
    "CRITICAL": logging.CRITICAL,
    "ALERT": logging.CRITICAL,
    "EMERGENCY": logging.CRITICAL,
}


@_register("sys.log", "data,severity,text,json,timeout", required=0, blocking=True)
def _sys_log(
    rt: Runtime,
    data: Any = None,
    severity: Any = "DEFAULT",
    text: Any = None,
    json: Any = None,
    timeout: Any = None,
) -> Any:
    """ "Writes one of data, text, or json"; TypeError when more than one or none of them is given, when
    json is not a map, or data or text is not one of the listed types (.../stdlib/sys/log)."""
    given = [v for v in (text, json, data) if v is not None]
    if len(given) != 1:
        raise type_error(f"sys.log: give exactly one of data, text or json, got {len(given)}")
    if json is not None:
        _want(json, "map", "sys.log", "json")
    if text is not None and not isinstance(text, str | int | float | bool | list | dict):
        raise type_error(f"sys.log: text cannot be {wtype(text)}")
    if data is not None and not isinstance(data, str | int | float | bool | list | dict):
        raise type_error(f"sys.log: data cannot be {wtype(data)}")
    payload = given[0]
    level = _SEVERITIES.get(str(severity).upper())
    if level is None:
        raise value_error(f"sys.log: unknown severity '{severity}'")
    message = payload if isinstance(payload, str) else _json_text(payload)
    log.log(level, "%s", message, extra={"workflow_execution": rt.execution_name})
    return None


@_register("math.abs", "x")
def _math_abs(rt: Runtime, x: Any) -> Any:
    _want(x, "number", "math.abs", "x")
    return check_int(abs(x)) if isinstance(x, int) else abs(x)


def _int_or_float(x: Any, y: Any, pick: Any) -> Any:
    """ "If both numbers are integers, returns an integer; otherwise, a floating-point number"
    (cloud.google.com/workflows/docs/reference/stdlib/math/max, .../math/min)."""
    return pick if isinstance(x, int) and isinstance(y, int) else float(pick)


@_register("math.max", "x,y")
def _math_max(rt: Runtime, x: Any, y: Any) -> Any:
    _want(x, "number", "math.max", "x")
    _want(y, "number", "math.max", "y")
    return _int_or_float(x, y, x if x >= y else y)


@_register("math.min", "x,y")
def _math_min(rt: Runtime, x: Any, y: Any) -> Any:
    _want(x, "number", "math.min", "x")
    _want(y, "number", "math.min", "y")
    return _int_or_float(x, y, x if x <= y else y)


@_register("math.floor", "x")
def _math_floor(rt: Runtime, x: Any) -> Any:
    _want(x, "number", "math.floor", "x")
    if isinstance(x, float) and not _math.isfinite(x):
        raise value_error("math.floor: value is not finite")
    return check_int(_math.floor(x))


@_register("uuid.generate")
def _uuid_generate(rt: Runtime) -> Any:
    return str(_uuid.uuid4())


# --------------------------------------------------------------------------- retry predicates


@_register("retry.always", "e")
def _retry_always(rt: Runtime, e: Any) -> Any:
    return True


@_register("retry.never", "e")
def _retry_never(rt: Runtime, e: Any) -> Any:
    return False


def _tags(e: Any) -> list[Any]:
    if isinstance(e, dict) and isinstance(e.get("tags"), list):
        return list(e["tags"])
    return []


def _code(e: Any) -> Any:
    return e.get("code") if isinstance(e, dict) else None


@_register("http.default_retry_predicate", "e")
def _http_default_retry_predicate(rt: Runtime, e: Any) -> Any:
    """429, 502, 503, 504, ConnectionError, ConnectionFailedError and TimeoutError."""
    if _code(e) in (429, 502, 503, 504):
        return True
    return any(t in ("ConnectionError", "ConnectionFailedError", "TimeoutError") for t in _tags(e))


@_register("http.default_retry_predicate_non_idempotent", "e")
def _http_default_retry_predicate_non_idempotent(rt: Runtime, e: Any) -> Any:
    """429, 503 and ConnectionFailedError only: the request may have been processed otherwise."""
    if _code(e) in (429, 503):
        return True
    return "ConnectionFailedError" in _tags(e)


# --------------------------------------------------------------------------- http

MAX_HTTP_TIMEOUT_S = 1800


def _encode_body(body: Any, headers: dict[str, str]) -> bytes | None:
    """ "If a Content-Type header is not specified and if the body value is bytes, the header is set to
    Content-Type: application/octet-stream; otherwise, the body is JSON-encoded and the header is set to
    Content-type: application/json; charset=utf-8" (cloud.google.com/workflows/docs/reference/stdlib/
    http/request)."""
    if body is None:
        return None
    ctype = next((v for k, v in headers.items() if k.lower() == "content-type"), None)
    if isinstance(body, bytes | bytearray):
        if ctype is None:
            headers["Content-Type"] = "application/octet-stream"
        return bytes(body)
    if isinstance(body, str) and ctype is not None and "json" not in ctype.lower():
        return body.encode("utf-8")
    if ctype is None:
        headers["Content-Type"] = "application/json; charset=utf-8"
    return _json_text(body).encode("utf-8")


def _decode_body(resp: requests.Response) -> Any:
    ctype = resp.headers.get("Content-Type", "").lower()
    raw = resp.content
    if not raw:
        return None if "json" in ctype or not ctype else ""
    if "json" in ctype:
        try:
            return _json.loads(raw.decode(resp.encoding or "utf-8"))
        except ValueError:
            return raw.decode("utf-8", "replace")
    if ctype.startswith("text/") or "xml" in ctype or "charset" in ctype:
        return raw.decode(resp.encoding or "utf-8", "replace")
    return raw


def _query(query: Any) -> list[tuple[str, str]] | None:
    if query is None:
        return None
    _want(query, "map", "http", "query")
    out: list[tuple[str, str]] = []
    for k, v in query.items():
        for item in v if isinstance(v, list) else [v]:
            out.append((k, to_display_string(item)))
    return out


def http_request(
    rt: Runtime,
    method: Any,
    url: Any,
    headers: Any = None,
    query: Any = None,
    body: Any = None,
    auth: Any = None,
    timeout: Any = None,
    private_service_name: Any = None,
) -> Any:
    """Real HTTP through requests; with ``auth``, the request carries the execution's identity (the
    registry's token: the workflow service account's, locally) as Workflows adds the account's token."""
    _want(url, "string", "http.request", "url")
    _want(method, "string", "http.request", "method")
    hdrs: dict[str, str] = {}
    if headers is not None:
        _want(headers, "map", "http.request", "headers")
        hdrs = {str(k): to_display_string(v) for k, v in headers.items()}
    data = _encode_body(body, hdrs)
    token = getattr(rt.connectors, "token", None)
    if auth is not None and token:
        hdrs["Authorization"] = f"Bearer {token}"
    # "default: 300.0 ... The maximum allowed timeout is 1800 seconds"; ValueError "If timeout is > 1800"
    # (cloud.google.com/workflows/docs/reference/stdlib/http/request, .../http/get).
    if timeout is not None:
        _want(timeout, "number", "http.request", "timeout")
        if not 0 < timeout <= MAX_HTTP_TIMEOUT_S:
            limit = MAX_HTTP_TIMEOUT_S
            raise value_error(f"http.request: timeout must be in (0, {limit}] seconds, got {timeout}")
    seconds = 300.0 if timeout is None else float(timeout)
    rt.check_cancel()
    route = getattr(rt.connectors, "route", None)
    target = route(url) if route else url
    return send(method.upper(), target, headers=hdrs, params=_query(query), data=data, timeout=seconds)


def send(method: str, url: str, session: requests.Session | None = None, **kwargs: Any) -> dict[str, Any]:
    """One HTTP request, answered as Workflows answers it: ``{body, code, headers}``, an HttpError map
    for any status from 400 up, and Workflows' connection/timeout errors (also for connector bindings)."""
    try:
        resp = session.request(method, url, **kwargs) if session else requests.request(method, url, **kwargs)
    except requests.exceptions.ConnectTimeout as exc:
        raise error("ConnectionFailedError", f"connection to {url} failed: {exc}") from None
    except requests.exceptions.Timeout as exc:
        raise error("TimeoutError", f"request to {url} timed out: {exc}") from None
    except requests.exceptions.ConnectionError as exc:
        if isinstance(exc, requests.exceptions.ChunkedEncodingError) or "Read" in type(exc).__name__:
            raise error("ConnectionError", f"connection to {url} broke: {exc}") from None
        raise error("ConnectionFailedError", f"connection to {url} failed: {exc}") from None
    except requests.exceptions.RequestException as exc:
        raise error("ConnectionError", f"request to {url} failed: {exc}") from None
    result = {"body": _decode_body(resp), "code": resp.status_code, "headers": dict(resp.headers)}
    # "Workflows considers any HTTP request that returns status code 400 or greater failed"
    # (cloud.google.com/workflows/docs/reference/syntax/catching-errors); HttpError "If the response
    # status is >= 400" (.../stdlib/http/get).
    if resp.status_code >= 400:
        raise WorkflowError(http_error(resp.status_code, body=result["body"], headers=result["headers"]))
    return result


_HTTP_ARGS = "url,headers,query,body,auth,timeout,private_service_name"
for _method in ("get", "post", "put", "patch", "delete"):

    def _make(method: str) -> Callable[..., Any]:
        def call(rt: Runtime, **kw: Any) -> Any:
            return http_request(rt, method.upper(), **kw)

        return call

    FUNCTIONS[f"http.{_method}"] = StdFunction(
        f"http.{_method}", _make(_method), tuple(_HTTP_ARGS.split(",")), 1, blocking=True
    )
FUNCTIONS["http.request"] = StdFunction(
    "http.request", http_request, ("method", *_HTTP_ARGS.split(",")), 2, blocking=True
)


# --------------------------------------------------------------------------- callbacks


@_register("events.create_callback_endpoint", "http_callback_method", required=0, blocking=True)
def _create_callback_endpoint(rt: Runtime, http_callback_method: Any = "POST") -> Any:
    if rt.hub is None:
        raise error("SystemError", "callbacks need a CallbackHub (run through ExecutionsServer or pass hub=)")
    _want(http_callback_method, "string", "events.create_callback_endpoint", "http_callback_method")
    return rt.hub.create_endpoint(rt.execution_name, http_callback_method)


@_register("events.await_callback", "callback,timeout", required=1, blocking=True)
def _await_callback(rt: Runtime, callback: Any, timeout: Any = 43200) -> Any:
    if rt.hub is None:
        raise error("SystemError", "callbacks need a CallbackHub")
    _want(callback, "map", "events.await_callback", "callback")
    if "url" not in callback:
        raise key_error("events.await_callback: callback has no url")
    _want(timeout, "number", "events.await_callback", "timeout")
    return rt.hub.await_callback(callback, float(timeout), cancel=getattr(rt, "cancel", None))


# --------------------------------------------------------------------------- experimental.executions


@_register(
    "experimental.executions.map",
    "workflow_id,arguments,timeout,location,project_id",
    required=2,
    blocking=True,
)
def _executions_map(
    rt: Runtime,
    workflow_id: Any,
    arguments: Any,
    timeout: Any = 1800.0,
    location: Any = None,
    project_id: Any = None,
) -> Any:
    """ "Starts workflow executions and waits for all of them to finish": one per element of
    ``arguments``; "A list where each element is the result of a workflow execution"; ExecutionError "If
    any of the executions finish unsuccessfully", TimeoutError past ``timeout`` (default 1800.0); the
    caller's location and project by default (cloud.google.com/workflows/docs/reference/stdlib/
    experimental.executions/map). The results keep the arguments' order, as the migration page's example
    output does (.../docs/migrate-function-to-parallel)."""
    _want(workflow_id, "string", "experimental.executions.map", "workflow_id")
    _want(arguments, "list", "experimental.executions.map", "arguments")
    _want(timeout, "number", "experimental.executions.map", "timeout")
    for name, value in (("location", location), ("project_id", project_id)):
        if value is not None:
            _want(value, "string", "experimental.executions.map", name)
    if rt.executions is None:
        raise error("SystemError", "experimental.executions needs the executions service (ExecutionsServer)")
    project = project_id or rt.env.get("GOOGLE_CLOUD_PROJECT_ID", "")
    where = location or rt.env.get("GOOGLE_CLOUD_LOCATION", "")
    parent = f"projects/{project}/locations/{where}/workflows/{workflow_id}"
    return rt.executions.run_children(parent, arguments, float(timeout), rt.check_cancel)


@_register(
    "experimental.executions.run",
    "workflow_id,argument,timeout,location,project_id",
    required=1,
    blocking=True,
)
def _executions_run(
    rt: Runtime,
    workflow_id: Any,
    argument: Any = None,
    timeout: Any = 1800.0,
    location: Any = None,
    project_id: Any = None,
) -> Any:
    """ "Starts a workflow execution and waits for it to finish" (the stdlib overview). Its own page could
    not be read here: its arguments are map's, with one ``argument``, as the connector that replaces it
    names them (.../googleapis/workflowexecutions/v1/projects.locations.workflows.executions/run)."""
    return _executions_map(rt, workflow_id, [argument], timeout, location, project_id)[0]


def resolve_object(name: str) -> Any:
    """A named function/policy/object used as a value, or None."""
    if name in FUNCTIONS:
        return FunctionRef(name)
    if name in POLICIES:
        return POLICIES[name]
    if name in OBJECTS:
        return dict(OBJECTS[name])
    return None
