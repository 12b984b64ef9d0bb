"""The measured claims of the docs (tests/unit/test_docs_claims.py states the rules): the rows of
docs/benchmarks/results.md, the pages' links to them, and the numbers of the README's prose."""

from __future__ import annotations

import re
from dataclasses import dataclass

RESULTS = "docs/benchmarks/results.md"
README_LIMIT = 8000
ROW_ID = re.compile(r'^\|\s*<a id="(?P<id>[a-z0-9-]+)"></a>')
# [text](any/path/results.md#id): a page citing the row `id` with the numbers of `text`
CLAIM_LINK = re.compile(r"\[(?P<text>[^\]]*)\]\((?:[\w./-]*/)?results\.md#(?P<id>[a-z0-9-]+)\)")
# a number and the unit right after it; not inside a word (H100, LLaMA-3, int8_b256, 0.19.2 parts)
NUMBER = re.compile(r"(?<![\w.\-−])(?P<sign>[−-])?(?P<num>\d+(?:,\d{3})*(?:\.\d+)?)(?![\w.]*\d)\s?"
                    r"(?P<unit>×|x(?![a-z])|%|GiB|MiB|GB|B(?![a-z])|tokens/s|ms|s(?![a-z]))?")
FENCE = re.compile(r"^```.*?^```[ \t]*$", re.M | re.S)
CODE_SPAN = re.compile(r"`[^`\n]*`")
COMMENT = re.compile(r"<!--.*?-->", re.S)
LINK_TARGET = re.compile(r"\]\([^)]*\)")


@dataclass(frozen=True)
class Row:
    id: str
    cells: list[str]

    @property
    def value(self) -> str:
        return self.cells[2]


def numbers(text: str) -> list[tuple[str, str]]:
    """(number, unit) pairs of ``text``: ``−69.9 %`` -> ('-69.9', '%'); thousands separators dropped, minus signs
    unified, a unit glued to the number (``80GB``) or one space after it counted alike."""
    out = []
    for m in NUMBER.finditer(text):
        sign = "-" if m["sign"] else ""
        unit = "×" if m["unit"] == "x" else m["unit"] or ""
        out.append((sign + m["num"].replace(",", ""), unit))
    return out


def results_rows(text: str) -> dict[str, Row]:
    rows = {}
    for line in text.splitlines():
        m = ROW_ID.match(line)
        if m:
            rows[m["id"]] = Row(m["id"], [c.strip() for c in line.strip().strip("|").split("|")])
    return rows


def prose(text: str) -> str:
    """A page without its code (fenced and inline), comments and link targets: the words a reader reads."""
    for pattern, repl in ((FENCE, ""), (COMMENT, ""), (CODE_SPAN, ""), (LINK_TARGET, "]")):
        text = pattern.sub(repl, text)
    return text


def link_problems(page: str, text: str, rows: dict[str, Row]) -> list[str]:
    """Every link to a results row names an existing row, and every number of its text is in that row's value (with
    the same unit where the text gives one; ``3.95x`` reads as ``3.95×``)."""
    problems = []
    for m in CLAIM_LINK.finditer(text):
        line = text[:m.start()].count("\n") + 1
        row = rows.get(m["id"])
        if row is None:
            problems.append(f"{page}:{line}: [{m['text']}] cites {m['id']!r}, which is not a row of {RESULTS}")
            continue
        value = set(numbers(row.value))
        bare = {n for n, _ in value}  # a number quoted without its unit (a table cell under a "GiB" header)
        missing = [f"{n}{u}" for n, u in numbers(m["text"]) if ((n, u) not in value if u else n not in bare)]
        if missing:
            problems.append(f"{page}:{line}: [{m['text']}] cites {m['id']!r} with {missing}, not in its value "
                            f"({row.value})")
    return problems


def readme_problems(readme: str, results: str) -> list[str]:
    """README.md is under README_LIMIT characters and every number of its prose is in the results table."""
    problems = []
    if len(readme) >= README_LIMIT:
        problems.append(f"README.md: {len(readme)} characters, the limit is {README_LIMIT}")
    table = set(numbers(prose(results)))
    for n, u in numbers(prose(readme)):
        if (n, u) not in table:
            problems.append(f"README.md: {n}{(' ' + u) if u else ''} is not in {RESULTS} (cite its row, or add one)")
    return problems


def row_problems(rows: dict[str, Row]) -> list[str]:
    """Each row has the table's eight cells and a value with a number in it."""
    problems = [f"{RESULTS}: row {r.id!r} has {len(r.cells)} cells, not 8" for r in rows.values() if len(r.cells) != 8]
    problems += [f"{RESULTS}: row {r.id!r}: its value has no number" for r in rows.values()
                 if len(r.cells) == 8 and not numbers(r.value)]
    return problems


HEADING = re.compile(r"^(#{1,6}) (.+)$")
ANCHOR_LINK = re.compile(r"\]\((?P<path>[^)\s#]*)#(?P<anchor>[^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """The anchors of a page: its headings (outside code; a repeated heading gets -1, -2, ...) and its <a id>s."""
    found, seen, in_code = set(), {}, False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            in_code = not in_code
        m = None if in_code else HEADING.match(line)
        if m:
            s = slug(m[2])
            found.add(s if s not in seen else f"{s}-{seen[s]}")
            seen[s] = seen.get(s, 0) + 1
    return found | set(re.findall(r'<a id="([^"]+)"', text))


def anchor_problems(pages: dict[str, str]) -> list[str]:
    """Every ``page.md#anchor`` link between the given pages (repository paths -> text) names a heading there."""
    import posixpath

    problems = []
    for page, text in pages.items():
        for m in ANCHOR_LINK.finditer(text):
            target = posixpath.normpath(posixpath.join(posixpath.dirname(page), m["path"])) if m["path"] else page
            if target in pages and m["anchor"] not in anchors(pages[target]):
                line = text[:m.start()].count("\n") + 1
                problems.append(f"{page}:{line}: {target}#{m['anchor']}: no such heading")
    return problems
