"""What GitHub makes of Markdown headings and links: anchors (heading slugs) and link targets.

Used by docs/gen_perf.py (the headline links to docs/performance.md's sections) and by
tests/test_docs_links.py (every relative link and #anchor resolves).
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterator

FENCE = re.compile(r"^\s{0,3}(```|~~~)")
ATX_HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
HTML_ANCHOR = re.compile(r"""<a\s[^>]*?(?:id|name)\s*=\s*["']([^"']+)["']""", re.IGNORECASE)
INLINE_CODE = re.compile(r"(`+)(.+?)\1")
# [text](target "title") and ![alt](target); the target may be <bracketed>
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*(<[^>]*>|[^\s)]+)(?:\s+[\"'(].*?[\"')])?\s*\)")
REFERENCE_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)")
HTML_LINK = re.compile(r"""<(?:a|img)\s[^>]*?(?:href|src)\s*=\s*["']([^"']+)["']""", re.IGNORECASE)


def prose_lines(text: str) -> Iterator[tuple[int, str]]:
    """(line number, line) outside fenced code blocks."""
    fence = None
    for number, line in enumerate(text.splitlines(), 1):
        match = FENCE.match(line)
        if match:
            if fence is None:
                fence = match.group(1)
            elif match.group(1) == fence:
                fence = None
            continue
        if fence is None:
            yield number, line


def heading_text(markdown: str) -> str:
    """A heading's text as rendered: code spans, links, emphasis and HTML tags reduced to text."""
    text = INLINE_CODE.sub(lambda m: m.group(2).strip(), markdown)
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"<[^>]+>", "", text)
    text = re.sub(r"(\*{1,3}|_{1,3})(\S(?:.*?\S)?)\1", r"\2", text)
    return text


def slug(text: str) -> str:
    """GitHub's heading id (github-slugger): lower case, punctuation but '-' and '_' dropped,
    each space a '-'."""
    text = text.strip().lower()
    kept = [c for c in text if c in " -_" or unicodedata.category(c)[0] in "LNM"]
    return "".join(kept).replace(" ", "-")


def anchors(text: str) -> list[str]:
    """Every anchor of a Markdown file, in order: heading slugs (a repeated one gets -1, -2, ...)
    and explicit <a id/name=...> anchors."""
    seen: dict[str, int] = {}
    out = []
    for _, line in prose_lines(text):
        out += HTML_ANCHOR.findall(line)
        match = ATX_HEADING.match(line)
        if not match:
            continue
        base = slug(heading_text(match.group(2)))
        count = seen.get(base, 0)
        seen[base] = count + 1
        out.append(base if count == 0 else f"{base}-{count}")
    return out


def links(text: str) -> Iterator[tuple[int, str]]:
    """(line number, target) of every link and image outside code."""
    for number, line in prose_lines(text):
        line = INLINE_CODE.sub("", line)
        for pattern in (INLINE_LINK, REFERENCE_DEF, HTML_LINK):
            for target in pattern.findall(line):
                yield number, target.strip("<>")
