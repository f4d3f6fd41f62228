"""RE2's syntax on Python's regex engine (cloudworkflows.re2): what RE2 refuses is refused, what
Python reads differently is rewritten. Each row follows RE2's syntax reference
(github.com/google/re2/wiki/Syntax)."""

from __future__ import annotations

import pytest

from cloudworkflows.re2 import RE2Error, compile_re2, matches

#: Struck out in RE2's reference, accepted by Python's engines.
REFUSED = [
    r"(a)\1",  # backreference
    "a(?=b)",  # lookahead
    "(?<=a)b",  # lookbehind
    "(?>a)",  # atomic group
    "a++",  # possessive
    "a*+",
    "(?R)",  # recursion
    "(?|a|b)",  # branch reset
    "(?x)a",  # a flag RE2 lacks
    r"\Z",
    r"\K",
    r"\G",
    r"\g<1>",
    "(*FAIL)",
    "[a",
]

#: (pattern, text, whether it matches): RE2's reading where Python's differs.
READ_AS_RE2 = [
    (r"\101", "A", True),  # octal, not a backreference
    (r"\12", "\n", True),
    (r"\x{41}", "A", True),
    (r"\Q.*\E", ".*", True),  # literal text
    (r"\Q.*\E", "ab", False),
    ("a{e<=1}", "a{e<=1}", True),  # a literal {, not fuzzy matching
    (r"^\d$", "٣", False),  # Perl classes are ASCII
    (r"^\w$", "é", False),
    (r"^\s$", "\u00a0", False),
    (r"\bx", "éx", True),  # ASCII word boundary: é is no word character
    ("a$", "a\n", False),  # $ is the end of the text
    ("(?m)a$", "a\nb", True),  # ... or of a line under m
    (r"\z", "", True),
    (r"\p{Greek}", "\u03b1", True),  # alpha
    ("[[:alpha:]]", "b", True),
    ("(?P<n>a)(?<m>b)", "ab", True),
    ("(?i)A", "a", True),
    ("[]a]", "]", True),
    ("a{2,}", "aa", True),
]


@pytest.mark.parametrize("pattern", REFUSED)
def test_what_re2_refuses_is_refused(pattern: str) -> None:
    with pytest.raises(RE2Error):
        compile_re2(pattern)


@pytest.mark.parametrize(("pattern", "text", "matched"), READ_AS_RE2)
def test_patterns_read_as_re2_reads_them(pattern: str, text: str, matched: bool) -> None:
    assert (compile_re2(pattern).search(text) is not None) is matched


def test_matches_are_leftmost_longest_and_skip_an_empty_match_abutting_the_last() -> None:
    found = [(m.start(), m.group(0)) for m in matches(compile_re2("a*", longest=True), "baaac")]
    assert found == [(0, ""), (1, "aaa"), (5, "")]
    assert [m.group(0) for m in matches(compile_re2("a|ab", longest=True), "abab")] == ["ab", "ab"]
    assert [m.group(0) for m in matches(compile_re2("a|ab"), "abab")] == ["a", "a"]
