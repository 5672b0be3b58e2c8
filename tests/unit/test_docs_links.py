"""Every relative link in the README and ``docs/`` points at a file of the repository, and
every ``#anchor`` at a heading of the page it names (GitHub's heading slugs)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE)


def prose(page: Path) -> str:
    """The page without its fenced code blocks (a link there is code, not a link)."""
    return FENCE.sub("", page.read_text())


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: inline code marks dropped, lowercase, punctuation
    other than ``-`` and ``_`` removed, spaces turned into hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "").lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    return {slug(m.group(1).strip())
            for m in re.finditer(r"^#{1,6} (.+)$", prose(page), re.MULTILINE)}


def relative_links(page: Path) -> list[str]:
    return [t for t in LINK.findall(prose(page))
            if not re.match(r"[a-z][a-z0-9+.-]*:", t)]  # http:, https:, mailto:


def test_the_pages_exist_and_link_somewhere() -> None:
    assert (ROOT / "docs").is_dir() and len(PAGES) > 1
    assert all(relative_links(page) for page in PAGES)


def test_the_readme_links_every_docs_page() -> None:
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in relative_links(ROOT / "README.md")}
    assert [p.name for p in PAGES[1:] if p.resolve() not in linked] == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_resolves(page: Path) -> None:
    broken = []
    for target in relative_links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists() or not dest.resolve().is_relative_to(ROOT):
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(target)
    assert broken == []


def test_slugs_follow_github() -> None:
    assert slug("Requests (`pd_cache/core/request.py`)") == "requests-pd_cachecorerequestpy"
    assert slug("`POST /v1/generate`, errors and `/healthz`") == \
        "post-v1generate-errors-and-healthz"
    assert slug("Model, tiers and write policies") == "model-tiers-and-write-policies"
