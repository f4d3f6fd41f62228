"""README.md is one page that leads to docs/: every relative link in them reaches a file, and every
``#anchor`` a heading of that file (as GitHub makes a heading's anchor), so a moved section or a renamed
heading fails here instead of leaving a reader at a dead link."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCS = sorted((REPO / "docs").glob("*.md"))
PAGES = [REPO / "README.md", *DOCS, REPO / "cloudworkflows" / "README.md"]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but hyphens dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {anchor(m.group(1)) for m in re.finditer(r"^#+ (.+)$", text, flags=re.M)}


def test_an_anchor_is_made_as_github_makes_it() -> None:
    assert anchor("Nothing lost: every object accounted for") == "nothing-lost-every-object-accounted-for"
    assert anchor("Which trainer: `nemo-24.12` or `bridge`") == "which-trainer-nemo-2412-or-bridge"


def test_every_relative_link_reaches_a_file_and_a_heading() -> None:
    broken = []
    for page in PAGES:
        for target in LINK.findall(page.read_text()):
            if re.match(r"[a-z]+:", target):
                continue  # https: and the like, not this repository's
            path, _, fragment = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(REPO)}: {target} (no file)")
            elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
                broken.append(f"{page.relative_to(REPO)}: {target} (no such heading)")
    assert broken == []


def test_the_readme_is_one_page_that_leads_to_every_doc() -> None:
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) < 120
    linked = {Path(t.partition("#")[0]).name for t in LINK.findall(readme) if t.startswith("docs/")}
    assert linked == {p.name for p in DOCS}
