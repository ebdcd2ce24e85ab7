#!/usr/bin/env python3
"""Assemble docs/performance.md: the headline summary (docs/perf/SUMMARY.md) followed by every area's
measured figures (docs/perf/<area>.md), headings shifted one level down. Run after updating a perf file."""

from __future__ import annotations

from pathlib import Path

ORDER = [
    "fresh-machine",
    "gpu",
    "gateway",
    "gateway-scale",
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


def main() -> None:
    perf = Path(__file__).resolve().parent.parent / "docs" / "perf"
    parts = [(perf / "SUMMARY.md").read_text().rstrip() + "\n"]
    names = [n for n in ORDER if (perf / f"{n}.md").exists()]
    names += sorted(p.stem for p in perf.glob("*.md") if p.stem not in ORDER and p.stem != "SUMMARY")
    for name in names:
        text = (perf / f"{name}.md").read_text().rstrip()
        shifted = "\n".join(_shift(text.splitlines()))
        parts.append(f"\n<!-- from docs/perf/{name}.md -->\n{shifted}\n")
    out = perf.parent / "performance.md"
    out.write_text("\n".join(parts))
    print(out)


if __name__ == "__main__":
    main()
