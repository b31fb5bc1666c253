"""The README and the pages of docs/ link to each other: every relative link reaches a file
that exists, and every #anchor a heading of that file (as GitHub names headings)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.support.paths import REPO_ROOT

PAGES = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_FENCED = re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE)


def anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces to -."""
    text = _FENCED.sub("", page.read_text())
    titles = re.findall(r"^#{1,6} (.+)$", text, re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-") for title in titles}


def links(page: Path) -> list[str]:
    return _LINK.findall(_FENCED.sub("", page.read_text()))


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.relative_to(REPO_ROOT).as_posix())
def test_every_relative_link_and_anchor_exists(page: Path) -> None:
    broken = []
    for target in links(page):
        if re.match(r"[a-z]+:", target):  # https:, mailto: ...
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no file {file.relative_to(REPO_ROOT)}")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target}: no heading #{anchor} in {file.relative_to(REPO_ROOT)}")
    assert broken == []


def test_the_readme_links_every_page_of_docs() -> None:
    linked = {target.partition("#")[0] for target in links(REPO_ROOT / "README.md")}
    pages = {f"docs/{page.name}" for page in PAGES[1:]}
    assert pages - linked == set()
