"""`pip install .` without extras can validate, plan and render: the wheel carries the templates, and the
installed package reads them from itself, not from a checkout (no engines, no hosts). The wheel is built the way
a release is: an sdist first (what MANIFEST.in lets in), then the wheel from that sdist alone; a template folder
MANIFEST.in leaves out is missing from that wheel."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from vllm_fleet.fleet.render import load_artifact_defs

REPO = Path(__file__).resolve().parents[2]
CLI = "import sys; from vllm_fleet.cli import main; sys.exit(main(sys.argv[1:]))"


def _files(root: Path) -> dict[Path, bytes]:
    return {p.relative_to(root): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_the_wheel_carries_the_templates_and_renders_without_the_checkout(tmp_path: Path) -> None:
    # build from a copy: a build writes build/ and *.egg-info next to the sources
    src = tmp_path / "src"
    shutil.copytree(
        REPO, src, ignore=shutil.ignore_patterns(".git", ".venv", "build", "*.egg-info", "__pycache__", "out")
    )
    r = subprocess.run(
        [sys.executable, "setup.py", "-q", "sdist", "-d", str(tmp_path / "sdist")],
        capture_output=True, text=True, timeout=300, cwd=src,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    (sdist,) = (tmp_path / "sdist").glob("vllm_fleet-*.tar.gz")
    argv = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w"]
    r = subprocess.run(
        [*argv, str(tmp_path / "whl"), str(sdist)], capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stdout + r.stderr
    (wheel,) = (tmp_path / "whl").glob("vllm_fleet-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for d in load_artifact_defs(REPO):
        if d.template:
            assert f"vllm_fleet/templates/{d.folder}/{d.template}" in names, d.src
        assert f"vllm_fleet/templates/{d.folder}/artifacts.yml" in names

    # the package as installed (the unpacked wheel first on the path, no checkout around it)
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    env = {"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"}
    probe = "from vllm_fleet.fleet.context import repo_root; print(repo_root())"
    where = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, env=env, cwd=tmp_path
    )
    assert where.stdout.strip() == str(site / "vllm_fleet" / "templates"), where.stderr
    spec = str(REPO / "examples" / "tiny-cpu.yml")
    for args in (["validate", spec], ["plan", spec], ["render", spec, "--out", str(tmp_path / "installed")]):
        r = subprocess.run(
            [sys.executable, "-c", CLI, *args], capture_output=True, text=True, env=env, cwd=tmp_path
        )
        assert r.returncode == 0, (args, r.stderr)
    # it renders what the checkout renders
    r = subprocess.run(
        [sys.executable, "-c", CLI, "render", spec, "--out", str(tmp_path / "checkout")],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert r.returncode == 0, r.stderr
    installed, checkout = _files(tmp_path / "installed"), _files(tmp_path / "checkout")
    assert len(installed) > 10 and installed == checkout
