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
                    r"(?P<unit>×|%|GiB|MiB|GB|B(?![a-z])|tokens/s|ms|s(?![a-z]))?")
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
        out.append((sign + m["num"].replace(",", ""), m["unit"] or ""))
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
    """Every link to a results row names an existing row, and every number of its text is in that row's value."""
    problems = []
    for m in CLAIM_LINK.finditer(text):
        line = text[:m.start()].count("\n") + 1
        row = rows.get(m["id"])
        if row is None:
            problems.append(f"{page}:{line}: [{m['text']}] cites {m['id']!r}, which is not a row of {RESULTS}")
            continue
        value = set(numbers(row.value))
        missing = [f"{n}{u}" for n, u in numbers(m["text"]) if (n, u) not in value]
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
