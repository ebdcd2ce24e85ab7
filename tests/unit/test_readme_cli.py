"""The README's CLI table names every sub-command ``vllm-fleet`` has: a new command is a row there."""

from __future__ import annotations

import re
from pathlib import Path

from vllm_fleet.cli import BUILTINS, PLUGINS

README = Path(__file__).resolve().parents[2] / "README.md"


def _cli_rows() -> list[str]:
    text = README.read_text()
    section = text.split("\n## CLI\n", 1)[1].split("\n## ", 1)[0]
    return [line.split("|")[1] for line in section.splitlines() if line.startswith("| `")]


def test_every_command_has_a_row_in_the_readme_s_cli_table() -> None:
    named = set()
    for cell in _cli_rows():
        words = re.findall(r"`(?:vllm-fleet )?([a-z][a-z-]*)", cell)
        named.update(words)
    missing = sorted((set(BUILTINS) | set(PLUGINS)) - named)
    assert not missing, f"README.md's CLI table has no row for: {missing}"
