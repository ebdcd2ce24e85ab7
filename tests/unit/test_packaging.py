"""The wheel carries what ``validate``, ``plan`` and ``render`` read: every template folder (setup.py copies
them in as vllm_fleet/templates/), and the core dependencies cover the renderer's imports (grafanalib too)."""

from __future__ import annotations

import importlib.util
import tomllib
from pathlib import Path

from vllm_fleet.fleet.render import load_artifact_defs

REPO = Path(__file__).resolve().parents[2]


def _setup_module():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("vf_setup", REPO / "setup.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # defines template_files; setup() runs only as __main__
    return mod


def test_the_wheel_gets_every_template_and_artifact_list() -> None:
    shipped = {p.as_posix() for p in _setup_module().template_files(REPO)}
    defs = load_artifact_defs(REPO)
    assert defs
    for d in defs:
        if d.template:
            assert f"{d.folder}/{d.template}" in shipped, d.src
        assert f"{d.folder}/artifacts.yml" in shipped, d.folder
    assert not any("/tests/" in p or "__pycache__" in p for p in shipped)


def test_the_renderers_imports_are_core_dependencies() -> None:
    """grafanalib renders the dashboards: a core dependency, not an extra."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    core = {d.split("=")[0].split(">")[0].split("<")[0].strip().lower() for d in project["dependencies"]}
    assert {"pydantic", "pyyaml", "jinja2", "grafanalib"} <= core
    for extra in project.get("optional-dependencies", {}).values():
        assert not any(d.lower().startswith("grafanalib") for d in extra)


def test_the_wheel_gets_every_subpackage() -> None:
    """pyproject's package discovery (``[tool.setuptools.packages.find]``) finds every package folder under
    vllm_fleet/ (e.g. ``vllm_fleet.host.exporter``, a package of its own): a missed one installs a CLI whose
    command fails to import."""
    from setuptools import find_packages

    find = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    found = set(find_packages(str(REPO), include=find["include"], exclude=find.get("exclude", ())))
    folders = {
        ".".join(p.parent.relative_to(REPO).parts)
        for p in (REPO / "vllm_fleet").rglob("__init__.py")
        if "__pycache__" not in p.parts
    }
    assert "vllm_fleet.host.exporter" in folders
    assert folders <= found, sorted(folders - found)
