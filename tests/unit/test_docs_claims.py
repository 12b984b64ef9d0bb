"""The docs state each measured number once (issue 44): docs/benchmarks/results.md holds one row per claim, and a
page that quotes a claim's number links the row (``[0.47×](benchmarks/results.md#te-fp8-peak)``).

Rules (the extraction is in tests/unit/_docs_claims.py):

1. Every row of the results table has an id (``<a id="...">``), eight cells and a number in its value cell.
2. Every link to ``results.md#ID`` on README.md, docs/**/*.md and benchmarks/README.md names an existing row, and
   every number of the link's text, with its unit (``0.47×``, ``54.55 GiB``), is in that row's value: a page
   cannot quote a claim with a number that differs from the table (or from another page quoting it).
3. Every ``page.md#anchor`` link between these pages names a heading (or ``<a id>``) of the page (pages were
   merged; an anchor that moved must be re-pointed).
4. README.md is under 8,000 characters, and every number of its prose (code, comments and link targets aside) is
   in the results table, with the same unit.
"""

from __future__ import annotations

from agoq.testing.procs import REPO_ROOT
from tests.unit._docs_claims import (
    RESULTS,
    anchor_problems,
    link_problems,
    readme_problems,
    results_rows,
    row_problems,
)
from tests.unit._docs_commands import DOC_FILES


def _rows():
    return results_rows((REPO_ROOT / RESULTS).read_text())


def test_results_table_rows_are_complete():
    rows = _rows()
    assert len(rows) >= 10, sorted(rows)  # the extraction finds the table (an empty one would pass trivially)
    assert row_problems(rows) == []


def test_every_cited_claim_quotes_the_tables_value():
    rows, problems, cited = _rows(), [], 0
    for path in DOC_FILES:
        text = path.read_text()
        problems += link_problems(str(path.relative_to(REPO_ROOT)), text, rows)
        cited += text.count("results.md#")
    assert problems == [], "\n".join(problems)
    assert cited >= 5, cited  # README's TL;DR and feature matrix cite rows


def test_links_to_headings_resolve():
    pages = {str(p.relative_to(REPO_ROOT)): p.read_text() for p in DOC_FILES}
    assert anchor_problems(pages) == []
    broken = dict(pages, **{"docs/x.md": "[a](user-guide.md#no-such-heading) [b](benchmarks/results.md#fp8-step)"})
    assert anchor_problems(broken) == ["docs/x.md:1: docs/user-guide.md#no-such-heading: no such heading"]


def test_readme_is_short_and_its_numbers_are_in_the_results_table():
    problems = readme_problems((REPO_ROOT / "README.md").read_text(), (REPO_ROOT / RESULTS).read_text())
    assert problems == [], "\n".join(problems)


def test_the_checks_catch_a_differing_number():
    """Each rule fails on a page that breaks it (the checks above could otherwise pass on nothing)."""
    results = (REPO_ROOT / RESULTS).read_text()
    rows = results_rows(results)
    page = "peak [0.47×](benchmarks/results.md#te-fp8-peak), speed [0.93×](benchmarks/results.md#te-fp8-speed)"
    problems = link_problems("page.md", page, rows)
    assert len(problems) == 1 and "0.93×" in problems[0] and "te-fp8-speed" in problems[0], problems
    assert "not a row" in link_problems("p.md", "[1.2×](results.md#no-such-claim)", rows)[0]
    readme = (REPO_ROOT / "README.md").read_text()
    assert any("1.13 ×" in p for p in readme_problems(readme + "\nFP8 runs 1.13× bf16.\n", results))
    assert any("characters" in p for p in readme_problems("x" * 8000, results))
    # numbers in code blocks and inline code are commands and output, not claims
    assert readme_problems("```text\nloss 8.333598\n```\n`--lr 3e-4`\n", results) == []
    broken = results.replace('<a id="te-fp8-peak"></a>`te-fp8-peak` | peak memory', '<a id="te-fp8-peak"></a>x')
    assert any("te-fp8-peak" in p for p in row_problems(results_rows(broken)))
