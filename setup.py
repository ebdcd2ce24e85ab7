"""Build hook (the metadata is in pyproject.toml): the template folders ship inside the wheel.

In the checkout the templates sit in top-level folders, one per kind of artifact (units/, nginx/,
monitoring/, alerts/, dashboards/: every folder with an ``artifacts.yml``), beside the Ansible roles that
render them. The wheel carries a copy of each as ``vllm_fleet/templates/FOLDER/``, so an installed
``vllm-fleet`` can ``render`` without the checkout (``vllm_fleet.fleet.context.repo_root`` finds either).
"""

from __future__ import annotations

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
SKIP = {"tests", "__pycache__"}  # alerts/tests: the promtool tests of the checkout, not templates


def template_files(root: Path = ROOT) -> list[Path]:
    """Every file of the template folders, relative to ``root``."""
    out: list[Path] = []
    for manifest in sorted(root.glob("*/artifacts.yml")):
        for p in sorted(manifest.parent.rglob("*")):
            rel = p.relative_to(root)
            if p.is_file() and not SKIP & set(rel.parts):
                out.append(rel)
    return out


class BuildPy(build_py):
    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return  # an editable install reads the checkout's folders
        dest = Path(self.build_lib) / "vllm_fleet" / "templates"
        for rel in template_files():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            self.copy_file(str(ROOT / rel), str(dest / rel))


if __name__ == "__main__":  # how setuptools runs it; tests import template_files()
    setup(cmdclass={"build_py": BuildPy})
