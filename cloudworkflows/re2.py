"""RE2 patterns, as Workflows' text functions read them, run on the ``regex`` module.

The text functions' ``regexp`` "Uses RE2 syntax" (cloud.google.com/workflows/docs/reference/stdlib/text/
find_all_regex). RE2's syntax reference (github.com/google/re2/wiki/Syntax) names what it accepts and
strikes out what it does not; Python's engines accept more and read some of the same text differently.
``translate`` refuses what RE2 refuses and rewrites what differs:

* refused: backreferences (``\\1``), lookarounds, atomic groups and every other ``(?`` group but
  ``(?:``, named groups and flags; possessive quantifiers (``a++``), ``\\Z``, ``\\C`` and unknown escapes;
* rewritten: ``\\d \\s \\w`` and ``\\b \\B`` are ASCII in RE2 (Unicode in Python), octal escapes
  (``\\12`` is a backreference in Python), ``\\x{10FFFF}``, ``\\Q...\\E``, ``\\z``, ``$`` (the end of
  the text in RE2, also before a final newline in Python) and a ``{`` that starts no repetition (a literal
  in RE2, fuzzy matching in ``regex``).

Two gaps remain: ``\\D \\S \\W`` inside a character class keep Python's Unicode reading, and RE2's
ungreedy flag ``U``, which Python lacks, is refused with that reason rather than matched differently.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import regex


class RE2Error(ValueError):
    """A pattern RE2 would refuse (or this translation cannot run faithfully)."""


#: RE2's Perl classes are ASCII: "\d digits (== [0-9])", "\s whitespace (== [\t\n\f\r ])", "\w word
#: characters (== [0-9A-Za-z_])".
_PERL_CLASSES = {"d": "0-9", "s": "\\t\\n\\f\\r ", "w": "0-9A-Za-z_"}
_REPETITION = re.compile(r"\{(\d+)(,(\d*))?\}")
_GROUP_NAME = re.compile(r"(?:P)?<([A-Za-z_][A-Za-z0-9_]*)>")
_FLAGS = re.compile(r"([imsU]*)(?:-([imsU]+))?([:)])")


def translate(pattern: str) -> str:
    """``pattern`` in RE2's syntax as the ``regex`` module's; RE2Error naming what RE2 refuses."""
    out: list[str] = []
    multiline = False
    i, n = 0, len(pattern)
    quantified = False  # the previous token was a quantifier (so a following + would be possessive)
    while i < n:
        c = pattern[i]
        if c == "\\":
            text, i = _escape(pattern, i, in_class=False)
            out.append(text)
            quantified = False
            continue
        if c == "[":
            text, i = _char_class(pattern, i)
            out.append(text)
            quantified = False
            continue
        if c == "(" and pattern.startswith("(?", i):
            text, i, sets_multiline = _group(pattern, i)
            multiline = multiline or sets_multiline
            out.append(text)
            quantified = False
            continue
        if c == "(" and pattern.startswith("(*", i):
            raise RE2Error(f"missing argument to repetition operator: '(*' at {i}")
        if c in "*+?":
            if quantified and c == "+":
                raise RE2Error(f"bad repetition operator: possessive '+' at {i}")
            out.append(c)
            # a lazy '?' after a quantifier ends it; anything else may be followed by one
            quantified = not (c == "?" and quantified)
            i += 1
            continue
        if c == "{":
            rep = _REPETITION.match(pattern, i)
            if rep is None:
                out.append("\\{")  # "{" that starts no repetition is a literal in RE2
                i += 1
                quantified = False
                continue
            out.append(rep.group(0))
            i = rep.end()
            quantified = True
            continue
        if c == "$":
            out.append("$" if multiline else "\\Z")
        else:
            out.append(c)
        quantified = False
        i += 1
    return "".join(out)


def _escape(pattern: str, i: int, in_class: bool) -> tuple[str, int]:
    """The escape at ``pattern[i]`` (a backslash) as Python's, and where it ends."""
    if i + 1 >= len(pattern):
        raise RE2Error("trailing backslash at end of expression")
    e = pattern[i + 1]
    if e == "Q":  # \Q...\E: literal text
        end = pattern.find("\\E", i + 2)
        literal = pattern[i + 2 :] if end < 0 else pattern[i + 2 : end]
        return regex.escape(literal), len(pattern) if end < 0 else end + 2
    if e in "afntrv":
        return "\\" + e, i + 2
    if e == "x":
        if pattern.startswith("{", i + 2):
            end = pattern.find("}", i + 3)
            digits = pattern[i + 3 : end] if end > 0 else ""
            if not re.fullmatch(r"[0-9A-Fa-f]{1,8}", digits) or int(digits, 16) > 0x10FFFF:
                raise RE2Error(f"invalid escape sequence at {i}")
            return f"\\U{int(digits, 16):08x}", end + 1
        if not re.fullmatch(r"[0-9A-Fa-f]{2}", pattern[i + 2 : i + 4]):
            raise RE2Error(f"invalid escape sequence at {i}")
        return pattern[i : i + 4], i + 4
    if e.isdigit():
        # "\123 octal character code (up to three digits)"; a lone \1..\9 is a backreference, which RE2
        # does not support (Go's regexp/syntax, RE2's port, reads them the same way).
        octal = re.match(r"0[0-7]{0,2}|[1-7][0-7]{1,2}", pattern[i + 1 :])
        if octal is None:
            raise RE2Error(f"invalid escape sequence: backreference \\{e} at {i}")
        return f"\\U{int(octal.group(0), 8):08x}", i + 1 + octal.end()
    if e in _PERL_CLASSES:
        return (_PERL_CLASSES[e] if in_class else f"[{_PERL_CLASSES[e]}]"), i + 2
    if e in "DSW":
        return ("\\" + e if in_class else f"[^{_PERL_CLASSES[e.lower()]}]"), i + 2
    if e in "bB" and not in_class:
        return f"(?a:\\{e})", i + 2
    if e == "A" and not in_class:
        return "\\A", i + 2
    if e == "z" and not in_class:
        return "\\Z", i + 2
    if e == "C":
        raise RE2Error("\\C (any byte) is not supported by this interpreter, which matches characters")
    if e in "pP":
        prop = re.match(r"\{\^?[A-Za-z_]+\}|[A-Za-z]", pattern[i + 2 :])
        if prop is None:
            raise RE2Error(f"invalid character class range at {i}")
        return pattern[i : i + 2 + prop.end()], i + 2 + prop.end()
    if e.isalnum() or e == "_":
        raise RE2Error(f"invalid escape sequence: \\{e} at {i}")
    return "\\" + e, i + 2


def _char_class(pattern: str, i: int) -> tuple[str, int]:
    """The class ``[...]`` starting at ``pattern[i]``, its escapes translated, and where it ends."""
    out = ["["]
    j = i + 1
    if pattern.startswith("^", j):
        out.append("^")
        j += 1
    if pattern.startswith("]", j):  # a leading ] is a literal
        out.append("\\]")
        j += 1
    while j < len(pattern):
        c = pattern[j]
        if c == "]":
            out.append("]")
            return "".join(out), j + 1
        if c == "\\":
            text, j = _escape(pattern, j, in_class=True)
            out.append(text)
            continue
        if c == "[" and (posix := re.match(r"\[:\^?[a-z]+:\]", pattern[j:])):
            out.append(posix.group(0))
            j += posix.end()
            continue
        out.append("\\[" if c == "[" else c)  # a nested [ is a literal in RE2, a set in regex V1
        j += 1
    raise RE2Error(f"missing closing ]: '{pattern[i:]}'")


def _group(pattern: str, i: int) -> tuple[str, int, bool]:
    """A ``(?`` construct: ``(?:``, a named group, or flags; RE2Error for any other."""
    rest = pattern[i + 2 :]
    if rest.startswith(":"):
        return "(?:", i + 3, False
    if name := _GROUP_NAME.match(rest):
        return f"(?P<{name.group(1)}>", i + 2 + name.end(), False
    flags = _FLAGS.match(rest)
    if flags is None or not (flags.group(1) or flags.group(2)):
        raise RE2Error(f"invalid or unsupported Perl syntax: '{pattern[i : i + 3]}'")
    if "U" in (flags.group(1) or "") + (flags.group(2) or ""):
        raise RE2Error("RE2's ungreedy flag U is not supported by this interpreter")
    on = flags.group(1) or ""
    return pattern[i : i + 2 + flags.end()], i + 2 + flags.end(), "m" in on


def compile_re2(pattern: str, longest: bool = False) -> Any:
    """``pattern`` compiled; ``longest``: leftmost-longest matches (the ``regex`` module's POSIX flag)."""
    flags = regex.VERSION0 | (regex.POSIX if longest else 0)
    try:
        return regex.compile(translate(pattern), flags)
    except (regex.error, ValueError, OverflowError) as exc:
        raise RE2Error(str(exc)) from None


def matches(compiled: Any, source: str) -> Iterator[Any]:
    """Successive non-overlapping matches, as RE2's GlobalReplace takes them: an empty match where the
    previous match ended is skipped ("Disallow empty match at end of last match", re2/re2.cc), which
    Python (3.7 and later) keeps."""
    last_end = -1
    for m in compiled.finditer(source):
        if m.start() == m.end() == last_end:
            continue
        last_end = m.end()
        yield m
