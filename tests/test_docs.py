"""The README and docs/: every relative link resolves (the file exists; a #fragment names a heading of the page it
points to, by GitHub's rule), the README is a ten-minute read (at most 300 lines, what flatgrpo is in its first
ten), and nothing links to a directory outside the repository."""

import glob
import os
import re

import pytest

from conftest import ROOT

PAGES = ["README.md", *sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def anchors(path: str) -> set[str]:
    """GitHub's heading anchors of a markdown file: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
    with open(path) as f:
        text = re.sub(r"```.*?```", "", f.read(), flags=re.DOTALL)
    out = set()
    for heading in re.findall(r"(?m)^#+ (.+)$", text):
        out.add(re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-"))
    return out


@pytest.mark.parametrize("page", PAGES)
def test_every_relative_link_resolves(page):
    with open(os.path.join(ROOT, page)) as f:
        text = re.sub(r"```.*?```", "", f.read(), flags=re.DOTALL)
    broken = []
    for target in LINK.findall(text):
        if re.match(r"^(https?|mailto):", target):
            continue
        path, _, fragment = target.partition("#")
        resolved = (
            os.path.normpath(os.path.join(ROOT, os.path.dirname(page), path)) if path else os.path.join(ROOT, page)
        )
        if not resolved.startswith(ROOT + os.sep) or not os.path.exists(resolved):
            broken.append(target)
        elif fragment and (not resolved.endswith(".md") or fragment not in anchors(resolved)):
            broken.append(target)
    assert not broken, f"{page}: links that do not resolve: {broken}"


def test_the_readme_is_a_ten_minute_read():
    with open(os.path.join(ROOT, "README.md")) as f:
        lines = f.read().splitlines()
    assert len(lines) <= 300, len(lines)
    assert "flatgrpo is a reference GRPO trainer" in "\n".join(lines[:10])
    assert "make demo" in "\n".join(lines[:12]) and "make test" in "\n".join(lines[:12])
