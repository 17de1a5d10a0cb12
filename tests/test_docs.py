"""The docs a user follows: every relative link in README.md, ARCHITECTURE.md, CHANGELOG.md and docs/ resolves (the
file, and the `#anchor` by GitHub's rules), and every fix the plugin declares has its page, its row in README's fix
table and its switches in README's switches table. Read from the declarations, so a fix added or renamed without its
docs fails here."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from trl_vlm_fixes.declaration import Fix
from trl_vlm_fixes.patches import ALL_FIXES

pytestmark = pytest.mark.stack_independent  # reads the checkout's Markdown and the declarations: no TRL/vLLM code

# the checkout (scripts/test.sh runs pytest from a stage folder of symlinks: resolve them back to the real files)
ROOT = Path(__file__).resolve().parents[1]
README_LINES_AT_MOST = 250  # issue 39: a README a new user reads in five minutes

FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
HTML_ANCHOR = re.compile(r"""<a\s+(?:id|name)=["']([^"']+)["']""")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)  # http:, https:, mailto:...


def documentation() -> list[Path]:
    return [ROOT / "README.md", ROOT / "ARCHITECTURE.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md"))]


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading: its rendered text, lower-cased, without punctuation (hyphens and underscores
    stay), each space a hyphen (github-slugger; repeated hyphens are kept)."""
    text = CODE_SPAN.sub(lambda code: code.group(2), heading)
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link's text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = re.sub(r"(\*+)(.+?)\1", r"\2", text)  # emphasis
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


@dataclass
class Page:
    anchors: set[str]
    links: list[tuple[int, str]]  # (line number, target)


def read_page(path: Path) -> Page:
    """The anchors a page defines (headings, with GitHub's -1, -2 for repeats; <a id/name>) and the links it holds,
    outside fenced code blocks and code spans."""
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    links: list[tuple[int, str]] = []
    fenced = False
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if fenced:
            continue
        anchors.update(HTML_ANCHOR.findall(line))
        heading = HEADING.match(line)
        if heading:
            slug = github_slug(heading.group(2))
            repeat = seen.get(slug, 0)
            seen[slug] = repeat + 1
            anchors.add(slug if repeat == 0 else f"{slug}-{repeat}")
        prose = CODE_SPAN.sub("code", line)
        links.extend((number, target) for target in LINK.findall(prose))
    return Page(anchors, links)


def broken_links(path: Path) -> list[tuple[int, str, str]]:
    """(line, target, why) for each relative link of the page that does not resolve."""
    problems = []
    for number, target in read_page(path).links:
        if EXTERNAL.match(target):
            continue
        file_part, _, anchor = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        if not linked.exists():
            problems.append((number, target, f"no file {linked}"))
        elif anchor and linked.suffix != ".md":
            problems.append((number, target, "an anchor into a file that is not Markdown"))
        elif anchor and anchor not in read_page(linked).anchors:
            problems.append((number, target, f"no anchor #{anchor} in {linked.name}"))
    return problems


def section_rows(path: Path, title: str) -> list[str]:
    """The table rows (after the header and its rule) of the first table under the heading `title`."""
    lines = path.read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if HEADING.match(line) and line.lstrip("#").strip() == title)
    rows: list[str] = []
    for line in lines[start + 1 :]:
        if HEADING.match(line):
            break
        if line.startswith("|"):
            rows.append(line)
        elif rows:
            break
    return rows[2:]


def test_every_relative_link_in_the_docs_resolves_to_a_file_and_anchor() -> None:
    pages = documentation()
    assert ROOT / "docs" / "gpu-results.md" in pages and len(pages) > 3
    problems = [
        f"{page.relative_to(ROOT)}:{number}: {target}: {why}"
        for page in pages
        for number, target, why in broken_links(page)
    ]
    assert not problems, "\n".join(problems)


def test_the_link_checker_follows_githubs_anchor_rules(tmp_path: Path) -> None:
    """The rules the link test relies on, on headings of the kinds the docs use."""
    assert github_slug("Server mode on TRL >= 1.11") == "server-mode-on-trl--111"
    assert github_slug("Known, not fixed: Qwen3-VL-MoE on vLLM >= 0.26") == "known-not-fixed-qwen3-vl-moe-on-vllm--026"
    assert github_slug("The watchdog (`patches/watchdog/`)") == "the-watchdog-patcheswatchdog"
    assert github_slug("`mm_realign`: vision markers") == "mm_realign-vision-markers"
    page = tmp_path / "page.md"
    page.write_text(
        '# Title\n## Cost\n## Cost\n<a id="pinned"></a>\n```bash\n# not a heading\n[x](missing.md)\n```\n'
        "[a](#cost-1) [b](#pinned) `[c](missing.md)` [d](#not-a-heading) [e](https://example.com/#x) [f](gone.md#y)\n"
    )
    parsed = read_page(page)
    assert {"title", "cost", "cost-1", "pinned"} <= parsed.anchors and "not-a-heading" not in parsed.anchors
    assert [target for _, target in parsed.links] == [
        "#cost-1",
        "#pinned",
        "#not-a-heading",
        "https://example.com/#x",
        "gone.md#y",
    ]
    assert [(target, why) for _, target, why in broken_links(page)] == [
        ("#not-a-heading", "no anchor #not-a-heading in page.md"),
        ("gone.md#y", f"no file {(tmp_path / 'gone.md').resolve()}"),
    ]


@pytest.mark.parametrize("fix", ALL_FIXES, ids=lambda fix: fix.name)
def test_every_fix_has_its_page_naming_its_switches_and_metrics(fix: Fix) -> None:
    page = ROOT / "docs" / "fixes" / f"{fix.name}.md"
    assert page.is_file(), f"{fix.name} has no page {page.relative_to(ROOT)}"
    text = page.read_text(encoding="utf-8")
    declared = [fix.switch, *(s.variable for s in fix.settings), *(c.name for c in fix.counters)]
    missing = [name for name in declared if f"`{name}`" not in text]
    assert not missing, f"{page.relative_to(ROOT)} does not name {missing}"


def test_every_page_under_docs_fixes_is_a_declared_fix() -> None:
    pages = {page.stem for page in (ROOT / "docs" / "fixes").glob("*.md")}
    assert pages == {fix.name for fix in ALL_FIXES}


def test_readme_fix_table_has_one_row_per_fix_linking_its_page_and_switch() -> None:
    rows = section_rows(ROOT / "README.md", "The fixes")
    assert len(rows) == len(ALL_FIXES), f"README's fix table has {len(rows)} rows for {len(ALL_FIXES)} fixes"
    for fix in ALL_FIXES:
        mine = [row for row in rows if f"](docs/fixes/{fix.name}.md)" in row]
        assert len(mine) == 1, f"README's fix table: {len(mine)} rows link docs/fixes/{fix.name}.md"
        assert f"`{fix.switch}`" in mine[0], f"README's fix table: {fix.name}'s row does not name {fix.switch}"


def test_readme_switches_table_names_every_declared_switch_and_setting() -> None:
    named = {row.split("|")[1].strip().strip("`") for row in section_rows(ROOT / "README.md", "Switches")}
    declared = {variable for fix in ALL_FIXES for variable in (fix.switch, *(s.variable for s in fix.settings))}
    assert declared <= named, f"README's switches table lacks {sorted(declared - named)}"


def test_readme_is_read_in_five_minutes() -> None:
    lines = len((ROOT / "README.md").read_text(encoding="utf-8").splitlines())
    assert lines <= README_LINES_AT_MOST, f"README.md has {lines} lines; the depth belongs under docs/"
