"""docs/architecture.md stays true to the code: its module table lists exactly the modules beside it, and the
porter's path names line ranges that start where it says, within the issue's bounds (a scorer <= 500 lines, a
selector <= 800, each in <= 3 files counting the page itself)."""
import re

from conftest import REPO

DOC = (REPO / "docs" / "architecture.md").read_text()


def test_module_table_is_the_modules_on_disk():
    table = DOC[DOC.index("| module | holds |"):DOC.index("No module imports")]
    listed = set(re.findall(r"`(\w+\.py)`", "".join(line.split("|")[1] for line in table.splitlines()[2:] if line)))
    assert listed == {p.name for p in REPO.glob("*.py")}


def porter_path(title: str) -> list[tuple[str, int, int, str]]:
    part = DOC[DOC.index(title):]
    part = part[:part.index("\n### ", 1) if "\n### " in part[1:] else part.index("\n## ")]
    return [(f, int(a), int(b), start) for f, a, b, start in
            re.findall(r"^\| `(\w+\.py):(\d+)-(\d+)` \| `([^`]+)` \|", part, re.M)]


def test_porters_path_ranges_start_where_they_say_and_fit():
    for title, bound in (("### A scorer: KeyDiff", 500), ("### A selector: RocketKV", 800)):
        ranges = porter_path(title)
        assert ranges, title
        for f, a, b, start in ranges:
            lines = (REPO / f).read_text().splitlines()
            assert a <= b <= len(lines) and lines[a - 1].lstrip().startswith(start), (f, a, lines[a - 1])
        total = sum(b - a + 1 for _, a, b, _ in ranges)
        assert total <= bound and len({f for f, *_ in ranges}) + 1 <= 3, (title, total)
        stated = int(re.search(r"\((\d+) lines in", DOC[DOC.index(title):]).group(1))
        assert stated == total, (title, stated, total)
