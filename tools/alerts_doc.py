#!/usr/bin/env python3
"""Rewrite the alerts table of docs/observability.md from the alerts table
(vllm_fleet/fleet/observability/alerts.py): the lines between the two marker comments.
``--check``: exit 1 if the doc is behind (tests/unit/test_alerts.py checks the same)."""

from __future__ import annotations

import sys
from pathlib import Path

from vllm_fleet.fleet.observability.alerts import markdown_table

DOC = Path(__file__).resolve().parents[1] / "docs" / "observability.md"
BEGIN = (
    "<!-- alerts table: generated from vllm_fleet/fleet/observability/alerts.py by tools/alerts_doc.py -->\n"
)
END = "<!-- end of the alerts table -->\n"


def rewrite(text: str) -> str:
    head, begin, rest = text.partition(BEGIN)
    _, end, tail = rest.partition(END)
    if not begin or not end:
        raise SystemExit(f"{DOC}: the markers {BEGIN.strip()} / {END.strip()} are missing")
    return head + BEGIN + markdown_table() + END + tail


def main() -> int:
    text = DOC.read_text()
    new = rewrite(text)
    if "--check" in sys.argv[1:]:
        return 0 if new == text else 1
    if new != text:
        DOC.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
