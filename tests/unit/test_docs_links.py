"""README is the front door and docs/ the manual: every link in them leads somewhere, every page
is found from README, and README stays short with exactly two set-up commands.

Read from the Markdown source, as GitHub renders it: links are ``[text](target)`` outside fenced
code blocks, inline code spans and HTML comments (the comments hold the notes left for a merge);
an anchor is a heading's GitHub slug. README's set-up section is the one headed ``## Quick
start``: its commands are the lines of its fenced code blocks, and README has no other shell
block, so a newcomer finds the two commands in one place.
"""

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.paths import ROOT

README = ROOT / "README.md"
DOCS = ROOT / "docs"
MAX_README_LINES = 250
SETUP_HEADING = "## Quick start"
#: Fence info strings that mark a block of shell commands (an unlabelled fence counts too).
SHELL_FENCES = {"", "sh", "bash", "shell", "console"}

FENCE = re.compile(r"^\s*(```|~~~)\s*([\w+-]*)")
LINK = re.compile(r"(?<!!)\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
IMAGE = re.compile(r"!\[[^\]]*\]\(\s*<?([^)\s>]+)>?\s*\)")
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
COMMENT = re.compile(r"<!--.*?-->", re.S)
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def _pages() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


def _prose_lines(text: str, *, keep_code: bool = False) -> Iterator[tuple[int, str]]:
    """The lines outside fenced code blocks, with HTML comments (and code spans) blanked."""
    text = COMMENT.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    fence: str | None = None
    for number, line in enumerate(text.splitlines(), 1):
        opened = FENCE.match(line)
        if opened and fence is None:
            fence = opened.group(1)
            continue
        if fence is not None:
            if line.strip().startswith(fence):
                fence = None
            continue
        yield number, line if keep_code else CODE_SPAN.sub("", line)


def _links(path: Path) -> list[tuple[int, str]]:
    found = []
    for number, line in _prose_lines(path.read_text()):
        found += [(number, target) for target in LINK.findall(line)]
        found += [(number, target) for target in IMAGE.findall(line)]
    return found


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, markup and punctuation dropped, spaces to -."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = re.sub(r"[`*_]", "", text).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    for _, line in _prose_lines(path.read_text(), keep_code=True):
        heading = HEADING.match(line)
        if heading is None:
            continue
        slug = _slug(heading.group(2))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def _is_external(target: str) -> bool:
    return re.match(r"^[a-z][a-z0-9+.-]*:", target) is not None


def _resolve(page: Path, target: str) -> tuple[Path, str]:
    file_part, _, anchor = target.partition("#")
    return (page.parent / file_part).resolve() if file_part else page, anchor


@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_points_to_a_file_and_heading_that_exist(page: Path) -> None:
    broken = []
    for number, target in _links(page):
        if _is_external(target):
            continue
        path, anchor = _resolve(page, target)
        if not path.exists():
            broken.append(f"line {number}: {target} (no such file)")
        elif not path.is_relative_to(ROOT):
            broken.append(f"line {number}: {target} (outside the repository)")
        elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
            broken.append(f"line {number}: {target} (no heading #{anchor} in {path.name})")
    assert not broken, f"{page.relative_to(ROOT)}:\n" + "\n".join(broken)


def test_every_docs_page_is_reachable_from_readme() -> None:
    reached = {README.resolve()}
    queue = [README]
    while queue:
        page = queue.pop()
        for _, target in _links(page):
            if _is_external(target):
                continue
            path, _ = _resolve(page, target)
            if path.suffix == ".md" and path.is_file() and path not in reached:
                reached.add(path)
                queue.append(path)
    unreached = [p.relative_to(ROOT) for p in DOCS.rglob("*.md") if p.resolve() not in reached]
    assert not unreached, f"not linked from README or a page it reaches: {unreached}"


def test_readme_is_a_front_door_not_a_manual() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_README_LINES, f"README has {len(lines)} lines"


def _blocks(text: str) -> Iterator[tuple[str, str, list[str]]]:
    """Each fenced block as (the section heading above it, its info string, its lines)."""
    section, fence, info, body = "", None, "", []
    for line in COMMENT.sub("", text).splitlines():
        opened = FENCE.match(line)
        if fence is None:
            if opened:
                fence, info, body = opened.group(1), opened.group(2).lower(), []
            elif line.startswith("## "):
                section = line.strip()
        elif line.strip().startswith(fence):
            yield section, info, body
            fence = None
        else:
            body.append(line)


def _setup_commands() -> list[str]:
    commands = []
    for section, _, body in _blocks(README.read_text()):
        if section == SETUP_HEADING:
            commands += [line.strip() for line in body if line.strip()]
    return commands


def test_readme_sets_up_with_two_commands_one_for_the_demo_one_for_the_tests() -> None:
    commands = _setup_commands()
    assert len(commands) == 2, commands
    demo = [c for c in commands if c.endswith(".venv/bin/email-platform demo")]
    tests = [c for c in commands if c.endswith(".venv/bin/python -m pytest")]
    assert len(demo) == 1 and len(tests) == 1, commands
    for command in commands:
        # A fresh machine: each command makes its own virtual environment and installs into it.
        assert "python3 -m venv .venv && .venv/bin/pip install" in command, command


def test_readme_has_no_shell_block_outside_its_setup_section() -> None:
    stray = [
        (section, body[:1])
        for section, info, body in _blocks(README.read_text())
        if section != SETUP_HEADING and info in SHELL_FENCES
    ]
    assert not stray, stray
