"""The docs as a newcomer meets them: a README that fits on a page, an index of every doc, links
that resolve, and text that describes the project rather than its tracker or files it does not ship."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"```.*?```", re.DOTALL)
#: Files whose text is checked for references to the tracker or to files outside the repository.
TEXT_SUFFIXES = {".py", ".md", ".toml", ".yaml", ".yml", ".sh", ".js", ".html", ".txt"}
SKIPPED_DIRS = {
    ".git", ".venv", ".cache", "runs", "node_modules", "__pycache__", ".pytest_cache", ".ruff_cache",
}  # fmt: skip
# Built from pieces so this file does not match itself.
OUTSIDE_REFERENCES = re.compile(
    r"\b(?:" + "|".join(["SP" + "EC", "ANCH" + "ORS", "DES" + "IGN", "STY" + "LE"]) + r")\.md\b"
    r"|\bSP" + r"EC §|shared/" + r"docs"
)
ISSUE_NUMBER = re.compile(r"\b[Ii]ss" + r"ue #?\d+")


def markdown_files() -> list[Path]:
    return [
        REPO_ROOT / "README.md",
        REPO_ROOT / "bench" / "README.md",
        *sorted((REPO_ROOT / "docs").rglob("*.md")),
        *sorted((REPO_ROOT / "models").glob("*/MODEL_CARD.md")),
    ]


def heading_anchors(path: Path) -> set[str]:
    """GitHub's anchors of a Markdown file's headings (lower case, punctuation dropped, spaces to
    hyphens, ``-1``, ``-2`` for repeats)."""
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    for line in FENCE.sub("", path.read_text()).splitlines():
        match = re.match(r"#{1,6}\s+(.*)", line)
        if match:
            slug = re.sub(r"[^\w\- ]", "", match[1].strip().lower()).replace(" ", "-")
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def broken_links(path: Path) -> list[str]:
    broken = []
    for target in LINK.findall(FENCE.sub("", path.read_text())):
        if re.match(r"[a-z]+:", target):
            continue
        file_part, _, fragment = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            broken.append(f"{path.relative_to(REPO_ROOT)}: {target} (no such file)")
        elif fragment and dest.suffix == ".md" and fragment not in heading_anchors(dest):
            broken.append(f"{path.relative_to(REPO_ROOT)}: {target} (no such heading)")
    return broken


def project_text_files() -> list[Path]:
    found = []
    for path in REPO_ROOT.rglob("*"):
        parts = set(path.relative_to(REPO_ROOT).parts)
        if parts & SKIPPED_DIRS or not path.is_file():
            continue
        if path.suffix in TEXT_SUFFIXES or path.name in ("Makefile", "Dockerfile", "Dockerfile.train"):
            found.append(path)
    return found


def test_the_readme_fits_on_a_page_and_gives_the_two_set_up_commands():
    readme = (REPO_ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 150
    assert "\n    make serve\n" in readme and "\n    make test\n" in readme
    assert "make test" in (REPO_ROOT / ".ci" / "run").read_text()


def test_the_docs_index_lists_every_doc():
    index = REPO_ROOT / "docs" / "README.md"
    targets = LINK.findall(index.read_text())
    linked = {(index.parent / target.partition("#")[0]).resolve() for target in targets}
    docs = {path.resolve() for path in (REPO_ROOT / "docs").rglob("*.md")} - {index.resolve()}
    assert sorted(str(path.relative_to(REPO_ROOT)) for path in docs - linked) == []
    for group in ("Guides", "Reference", "Results"):
        assert re.search(rf"^##\s+{group}", index.read_text(), re.MULTILINE), group


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_relative_links_and_anchors_resolve(path: Path):
    assert broken_links(path) == []


def test_no_text_cites_the_tracker_or_files_outside_the_repository():
    found = []
    for path in project_text_files():
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if OUTSIDE_REFERENCES.search(line) or ISSUE_NUMBER.search(line):
                found.append(f"{path.relative_to(REPO_ROOT)}:{number}: {line.strip()[:100]}")
    assert found == []


def test_docs_named_in_code_and_make_targets_exist():
    """A docstring, help text or Makefile comment that sends a reader to ``docs/...md`` names a doc
    that is there."""
    named = re.compile(r"\bdocs/[\w./-]+\.md\b")
    missing = []
    for path in project_text_files():
        if path.suffix == ".md" or path == Path(__file__):
            continue
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            missing += [
                f"{path.relative_to(REPO_ROOT)}:{number}: {doc}"
                for doc in named.findall(line)
                if not (REPO_ROOT / doc).exists()
            ]
    assert missing == []


def test_the_checks_catch_what_they_look_for(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A broken link, a missing heading and both kinds of reference are reported."""
    monkeypatch.setitem(globals(), "REPO_ROOT", tmp_path)
    doc = tmp_path / "a.md"
    (tmp_path / "b.md").write_text("# Only heading\n")
    doc.write_text("[x](b.md#only-heading) [y](b.md#other) [z](c.md) [w](https://example.org)\n")
    assert [entry.split(": ", 1)[1] for entry in broken_links(doc)] == [
        "b.md#other (no such heading)",
        "c.md (no such file)",
    ]
    assert OUTSIDE_REFERENCES.search("see " + "SP" + "EC.md §1.4")
    assert OUTSIDE_REFERENCES.search("../" + "shared/" + "docs/GPU.md")
    assert ISSUE_NUMBER.search("fixed by " + "iss" + "ue 12")
    assert not ISSUE_NUMBER.search("frigate#19692 asks for it")
