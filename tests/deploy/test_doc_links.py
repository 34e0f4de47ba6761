"""Relative links between the project's Markdown documents resolve: the file exists and, when the link names an
anchor, the target has a heading with that anchor (GitHub's rule: lower case, punctuation dropped, spaces to
hyphens, `-1`, `-2`, ... for repeated headings). A renamed or moved heading breaks the links to it; this finds them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = sorted([REPO / "README.md", *(REPO / "docs").glob("*.md")])
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~)")


def _prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks (a `#` there is a shell comment, not a heading)."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line.lstrip()):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def anchors(text: str) -> set[str]:
    """GitHub's anchors for the Markdown headings of `text`."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    for line in _prose_lines(text):
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_anchor_rule_matches_githubs_on_known_headings():
    text = "# A title\n## 9. ZeRO offload: `x` — 2026-12-01\n## Same\n## Same\n```\n# not a heading\n```\n"
    assert anchors(text) == {"a-title", "9-zero-offload-x--2026-12-01", "same", "same-1"}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(doc: Path):
    broken = []
    text = doc.read_text()
    for line in _prose_lines(text):
        for target in LINK.findall(line):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = doc if not path else (doc.parent / path).resolve()
            if not dest.exists():
                broken.append(f"{target}: no such file")
                continue
            if anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
                broken.append(f"{target}: no heading with that anchor in {dest.relative_to(REPO)}")
    assert not broken, f"{doc.relative_to(REPO)}: " + "; ".join(broken)


SECTION_REF = re.compile(r"(docs/)?(benchmarks(?:-archive)?\.md),? §(\d+)")
SOURCES = ("README.md", "docs", "benchmarks", "inference_svc", "shared_model", "lt_plugins", "tandem_native", "scripts")


def _numbered_sections(doc: Path) -> set[str]:
    return set(re.findall(r"^## (\d+)\. ", doc.read_text(), flags=re.MULTILINE))


def test_section_references_to_the_benchmarks_docs_name_existing_sections():
    """'docs/benchmarks.md §N' (and the archive's) in docs and docstrings names a numbered section of that file."""
    sections = {name: _numbered_sections(REPO / "docs" / name) for name in ("benchmarks.md", "benchmarks-archive.md")}
    broken = []
    for root in SOURCES:
        base = REPO / root
        files = [base] if base.is_file() else [*base.rglob("*.py"), *base.rglob("*.md")]
        for f in files:
            for _, name, number in SECTION_REF.findall(f.read_text(errors="replace")):
                if number not in sections[name]:
                    broken.append(f"{f.relative_to(REPO)}: {name} §{number}")
    assert not broken, "no such section: " + "; ".join(broken)
