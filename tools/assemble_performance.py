#!/usr/bin/env python3
"""Assemble docs/performance.md: the headline summary (docs/perf/SUMMARY.md) followed by every area's
measured figures (docs/perf/<area>.md), headings shifted one level down. Run after updating a perf file.

    tools/assemble_performance.py            write docs/performance.md
    tools/assemble_performance.py --check    exit 1 (writing nothing) when docs/performance.md is out of date
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ORDER = [
    "fresh-machine",
    "gpu",
    "gateway",
    "gateway-limits",
    "gateway-scale",
    "ha",
    "rollouts",
    "lora",
    "routing",
    "engine-service",
    "ansible",
    "render-scale",
    "observability",
    "bench",
    "sandbox",
]


def _shift(lines: list[str]) -> list[str]:
    """Headings one level down, leaving fenced code blocks alone."""
    out, fenced = [], False
    for ln in lines:
        if ln.lstrip().startswith("```"):
            fenced = not fenced
        out.append("#" + ln if ln.startswith("#") and not fenced else ln)
    return out


def assemble(perf: Path) -> str:
    """docs/performance.md's text from the files of ``perf`` (docs/perf)."""
    parts = [(perf / "SUMMARY.md").read_text().rstrip() + "\n"]
    names = [n for n in ORDER if (perf / f"{n}.md").exists()]
    names += sorted(p.stem for p in perf.glob("*.md") if p.stem not in ORDER and p.stem != "SUMMARY")
    for name in names:
        text = (perf / f"{name}.md").read_text().rstrip()
        shifted = "\n".join(_shift(text.splitlines()))
        parts.append(f"\n<!-- from docs/perf/{name}.md -->\n{shifted}\n")
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Assemble docs/performance.md from docs/perf/*.md.")
    ap.add_argument("--check", action="store_true", help="exit 1 when docs/performance.md is out of date")
    a = ap.parse_args(argv)
    perf = Path(__file__).resolve().parent.parent / "docs" / "perf"
    out = perf.parent / "performance.md"
    text = assemble(perf)
    if a.check:
        if out.read_text() != text:
            print(f"{out} is out of date: run tools/assemble_performance.py", file=sys.stderr)
            return 1
        return 0
    out.write_text(text)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
