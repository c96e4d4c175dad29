"""Every relative link in README.md and docs/*.md points at a file that exists, and every
#anchor at a heading of its target as GitHub names it. External http(s) links are not fetched."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import unquote, urlsplit

from docs.markdown import anchors, links, slug

ROOT = Path(__file__).resolve().parent.parent
EXTERNAL = ("http", "https", "mailto", "ftp")


def check_links(files: list[Path], root: Path) -> list[str]:
    """'file:line: target: what is wrong' for every broken link in `files`."""
    problems = []
    anchor_cache: dict[Path, set[str]] = {}

    def anchors_of(path: Path) -> set[str]:
        if path not in anchor_cache:
            anchor_cache[path] = set(anchors(path.read_text()))
        return anchor_cache[path]

    for source in files:
        for line, target in links(source.read_text()):
            parts = urlsplit(target)
            if parts.scheme in EXTERNAL or parts.netloc:
                continue
            where = f"{source.relative_to(root)}:{line}: {target}"
            path = (source.parent / unquote(parts.path)).resolve() if parts.path else source
            if not path.exists():
                problems.append(f"{where}: no such file")
                continue
            if not path.resolve().is_relative_to(root.resolve()):
                problems.append(f"{where}: outside the repository")
                continue
            fragment = unquote(parts.fragment)
            if fragment and path.suffix == ".md" and fragment.lower() not in anchors_of(path):
                problems.append(f"{where}: no heading #{fragment} in {path.relative_to(root.resolve())}")
    return problems


def doc_files(root: Path) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def test_readme_and_docs_links_resolve() -> None:
    problems = check_links(doc_files(ROOT), ROOT)
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_broken_links_and_anchors_are_reported(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "b.md").write_text("# B page\n\n## Set `--flag` (twice)\n\n## Set `--flag` (twice)\n"
                                            '<a id="custom"></a>\n')
    (tmp_path / "README.md").write_text(
        "# Top\n\n"
        "[ok](docs/b.md) [ok](docs/b.md#b-page) [ok](docs/b.md#set---flag-twice-1) [ok](docs/b.md#custom)\n"
        "[ok](#top) [ok](https://example.com/missing) ![ok](docs/b.md \"title\") [ok](docs/)\n"
        "[gone](docs/missing.md) [bad anchor](docs/b.md#set---flag-twice-2)\n"
        "[bad local](#nowhere)\n"
        "```\n[not a link](nothing.md)\n```\n"
        "`[not a link either](nothing.md)`\n"
        "[ref]: docs/nothing.md\n")
    problems = check_links([tmp_path / "README.md"], tmp_path)
    assert problems == [
        "README.md:5: docs/missing.md: no such file",
        "README.md:5: docs/b.md#set---flag-twice-2: no heading #set---flag-twice-2 in docs/b.md",
        "README.md:6: #nowhere: no heading #nowhere in README.md",
        "README.md:11: docs/nothing.md: no such file",
    ]


def test_slugs_follow_github() -> None:
    assert slug("Engine vs transformers (make bench-engine)") == "engine-vs-transformers-make-bench-engine"
    assert slug("What's new? 2.0 & more") == "whats-new-20--more"
    assert slug("max_tokens_x") == "max_tokens_x"
    assert anchors("# A\n## A\n```\n# not a heading\n```\n# `code` *em* [link](x.md)\n") == [
        "a", "a-1", "code-em-link"]
