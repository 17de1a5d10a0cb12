"""The docs a user follows: every relative link in README.md, ARCHITECTURE.md, CHANGELOG.md and docs/ resolves (the
file, and the `#anchor` by GitHub's rules), and every fix the plugin declares has its page, its row in README's fix
table and its switches in README's switches table. Read from the declarations, so a fix added or renamed without its
docs fails here."""

from __future__ import annotations

import itertools
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


# --- what a new user reads: no internal references, no machine-only paths, a way back, tables from declarations ---

USER_DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
# "issue 40" means nothing to a reader without this project's tracker: say what was measured, where, when
ISSUE_REFERENCE = re.compile(r"\bissues?\s+#?\d+", re.IGNORECASE)
# paths that exist only on the machines the GPU records were made on (a record says how to reproduce it from here)
MACHINE_ONLY = re.compile(r"/root/|\.\./shared/|(?:make|install)_bundles\.sh|`\.gpu/|PYTHONPATH=\S|/tmp/")
LONGEST_README_CELL = 300
MODE_TABLE_HEADER = (
    "| fix | no vLLM | colocate | server |"  # a table cell is a line of a table; the details belong on the fix's page
)
BACK_LINK = re.compile(r"\]\((?:\.\./)*README\.md(?:#[^)]*)?\)")


def prose_lines(path: Path) -> list[tuple[int, str]]:
    """(number, line) of every line outside fenced code blocks."""
    lines, fenced = [], False
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            lines.append((number, line))
    return lines


def test_user_docs_cite_no_issue_of_this_project() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{number}: {match.group(0)!r}"
        for path in USER_DOCS
        for number, line in prose_lines(path)
        for match in ISSUE_REFERENCE.finditer(line)
    ]
    assert not found, "\n".join(found)


def test_user_docs_name_no_path_of_the_measuring_machines() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()[:120]}"
        for path in USER_DOCS
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if MACHINE_ONLY.search(line)
    ]
    assert not found, "\n".join(found)


def test_the_checkers_refuse_what_the_issue_saw() -> None:
    assert ISSUE_REFERENCE.search("(issue 37, H100)") and ISSUE_REFERENCE.search("Issue 40: exact")
    assert not ISSUE_REFERENCE.search("[record](gpu-results.md#issue40-sampling), run_issue32.sh")
    assert MACHINE_ONLY.search("PYTHONPATH=.:/root/site python3 x.py") and MACHINE_ONLY.search("`.gpu/a`")
    assert not MACHINE_ONLY.search("`sitecustomize.py` goes first on `PYTHONPATH`")


@pytest.mark.parametrize("page", sorted((ROOT / "docs").rglob("*.md")), ids=lambda page: page.name)
def test_every_docs_page_links_back_at_its_top(page: Path) -> None:
    top = page.read_text(encoding="utf-8").splitlines()[:5]
    assert any(BACK_LINK.search(line) for line in top), f"{page.relative_to(ROOT)} has no link back in its first lines"


def test_gpu_results_has_a_table_of_contents_of_every_section() -> None:
    page = ROOT / "docs" / "gpu-results.md"
    lines = [line for _, line in prose_lines(page)]
    contents = lines.index("## Contents")
    toc = {target for _, target in read_page(page).links if target.startswith("#")}
    sections = [line for line in lines[contents + 1 :] if line.startswith("## ")]
    assert len(sections) >= 13
    anchors = [HTML_ANCHOR.findall(lines[lines.index(s) - 1]) or [github_slug(s[3:])] for s in sections]
    missing = [s for s, anchor in zip(sections, anchors, strict=True) if f"#{anchor[0]}" not in toc]
    assert not missing, f"gpu-results.md's contents lack {missing}"


def test_readme_table_cells_are_short() -> None:
    long = [
        f"README.md:{number}: {len(cell)} characters: {cell[:60]}..."
        for number, line in prose_lines(ROOT / "README.md")
        if line.startswith("|")
        for cell in line.strip().strip("|").split(" | ")
        if len(cell) > LONGEST_README_CELL
    ]
    assert not long, "\n".join(long)


def family_configs() -> dict[str, dict[str, object]]:
    """The config.json of each Qwen family's tiny checkpoint (its layers as released; no weights built)."""
    from helpers import QWEN_FAMILIES

    from trl_vlm_fixes.selftest.tiny_model import SPECIAL_TOKENS, build_config

    ids = {token: 300 + index for index, token in enumerate(SPECIAL_TOKENS)}
    return {family: build_config(320, ids, family=family).to_dict() for family in QWEN_FAMILIES}


def acting_families(fix: Fix, mode: str, sleep_mode: bool, configs: dict[str, dict[str, object]]) -> list[str]:
    """The families ``fix`` acts for in ``mode``, by its declaration alone: its ``applicability`` data (families,
    modes, sleep mode; ``tests/test_applicability.py`` checks its rule agrees on these configs), or, for a fix that
    declares none yet, its ``applies`` asked of each family's config (no question asked of this machine)."""
    from trl_vlm_fixes.declaration import Plan

    if fix.applicability is not None:
        return [name for name in configs if fix.applicability.acts(mode, name, sleep_mode)]
    return [name for name, config in configs.items() if fix.applies(Plan(config, mode, sleep_mode, here=False)) is None]


def mode_cell(fix: Fix, mode: str, configs: dict[str, dict[str, object]]) -> str:
    """README's fix x mode cell: `acts`, for which model types if not all, whether only with sleep mode."""
    with_sleep = acting_families(fix, mode, True, configs)
    if not with_sleep:
        return "steps aside"
    cell = "acts"
    if len(with_sleep) < len(configs):
        cell += " (" + ", ".join(f"`{name}`" for name in with_sleep) + ")"
    if acting_families(fix, mode, False, configs) != with_sleep:
        cell += ", with sleep mode"
    return cell


def test_readme_fix_by_mode_table_is_the_declarations() -> None:
    """Each cell is what the fix's declared `applicability` says for the five families (its `applies` where it
    declares none): a declaration that changes fails here until README's table says the same."""
    configs = family_configs()
    expected = [
        f"| `{fix.name}` | "
        + " | ".join(mode_cell(fix, mode, configs) for mode in ("none", "colocate", "server"))
        + " |"
        for fix in ALL_FIXES
    ]
    lines = [line for _, line in prose_lines(ROOT / "README.md")]
    start = lines.index(MODE_TABLE_HEADER) + 2
    table = list(itertools.takewhile(lambda line: line.startswith("|"), lines[start:]))
    assert table == expected, "README's fix x mode table should read:\n" + "\n".join(expected)


def test_readme_model_table_is_the_declarations() -> None:
    """The model table's fixes that depend on the layers: those that act for that family (colocate, sleep mode)
    and not for every family, by each fix's declared `applicability` (its `applies` where it declares none)."""
    configs = family_configs()
    acting = {fix.name: acting_families(fix, "colocate", True, configs) for fix in ALL_FIXES}
    names = {fix.name for fix in ALL_FIXES}
    for row in section_rows(ROOT / "README.md", "Supported models"):
        if not row.startswith("| Qwen"):
            continue
        _, family, model_type, fixes, _ = row.split("|")
        model_type = model_type.strip().strip("`")
        listed = {name for name in re.findall(r"`(\w+)`", fixes) if name in names}
        expected = {
            name for name, families in acting.items() if model_type in families and len(families) < len(configs)
        }
        assert listed == expected, (
            f"README's model table, {family.strip()}: lists {listed}, the declarations {expected}"
        )
