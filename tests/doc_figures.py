"""Reading the figures a docs page quotes, for the tests that hold them to what their commands
print: a page's section, its tables' rows, the numbers in a cell, the report keys a passage
names."""

from __future__ import annotations

import re
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1] / "docs"
#: A number as the docs write it: thousands grouped with a space or a comma ("30 720", "3,072"),
#: or a decimal.
NUMBER = re.compile(r"\d{1,3}(?:[ ,]\d{3})+(?![\d.])|\d+(?:\.\d+)?")
#: A report key quoted in backticks: ``ratio``, ``ttft.restored_ms``.
KEY = re.compile(r"`([a-z][a-z0-9_]*(?:\.[a-z][a-z0-9_]*)*)`")


def page(name: str) -> str:
    return (DOCS / name).read_text(encoding="utf-8")


def section(text: str, title: str) -> str:
    """From the heading named ``title`` (any level) to the next heading of the same or a
    higher level."""
    found = re.search(rf"^(#+) {re.escape(title)}\n", text, re.MULTILINE)
    assert found, f"no section {title!r}"
    level = len(found.group(1))
    end = re.compile(rf"^#{{1,{level}}} ", re.MULTILINE).search(text, found.end())
    return text[found.start():end.start() if end else len(text)]


def table(text: str, header: str) -> list[list[str]]:
    """The body rows (cells stripped) of the first table in ``text`` whose header row starts
    with ``header``."""
    lines = text.splitlines()
    for at, line in enumerate(lines):
        if line.startswith(f"| {header}"):
            rows = []
            for body in lines[at + 2:]:
                if not body.startswith("|"):
                    break
                rows.append([cell.strip() for cell in body.strip().strip("|").split("|")])
            return rows
    raise AssertionError(f"no table headed {header!r}")


def numbers(text: str) -> list[float]:
    """Every number in ``text``, in order (``"3 120 (230) / 0"`` -> 3120, 230, 0)."""
    return [float(re.sub(r"[ ,]", "", found)) for found in NUMBER.findall(text)]


def integers(text: str) -> list[int]:
    values = numbers(text)
    assert all(value.is_integer() for value in values), text
    return [int(value) for value in values]


def keys(text: str) -> list[str]:
    """The report keys ``text`` quotes, in order, each once."""
    return list(dict.fromkeys(KEY.findall(text)))


def lookup(report: object, key: str) -> object:
    """``report``'s value at a dotted key (``ttft.restored_ms``)."""
    value = report
    for part in key.split("."):
        assert isinstance(value, dict) and part in value, f"the report has no {key!r}"
        value = value[part]
    return value
