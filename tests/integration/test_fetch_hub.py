"""`vllm-fleet fetch` for `source.hf`: the real huggingface_hub download path against a local Hub.

The hub (tests/local_hub.py) serves the tiny model at a pinned commit, tagged `v1.0`. The CLI runs as a
subprocess with HF_ENDPOINT pointing at it, as on a host: revision resolved to a commit and recorded,
checksums verified, a rerun downloads nothing, a broken transfer and a killed fetch both resume with a Range
request, and a wrong revision / repo / checksum fails naming the field.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from local_hub import LocalHub  # type: ignore[import-not-found]

from vllm_fleet.host.fetch import MANIFEST

BIN = Path(sys.executable).parent
REPO_ID = "fleet-tests/tiny-qwen3"
WEIGHTS = "model.safetensors"
# huggingface_hub writes downloads in 10 MiB chunks (constants.DOWNLOAD_CHUNK_SIZE) and resumes from what it
# wrote: a file of a few chunks shows a resume; the tiny model's weights are smaller than one
BIG = "extra-00001.bin"
CHUNK = 10 * 1024 * 1024


@pytest.fixture
def source(tiny_model: Path, tmp_path: Path) -> Path:
    src = tmp_path / "published"
    shutil.copytree(tiny_model, src)
    (src / BIG).write_bytes(os.urandom(3 * CHUNK - 12345))
    return src


@pytest.fixture
def hub(source: Path) -> Iterator[LocalHub]:
    h = LocalHub()
    h.add(REPO_ID, source, tags=("v1.0",))
    h.start()
    yield h
    h.stop()


def sha256s(folder: Path) -> dict[str, str]:
    return {
        p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def write_spec(tmp: Path, dest: Path, revision: str = "v1.0", repo: str = REPO_ID, **checksums: str) -> Path:
    spec = {
        "stack": {"profile": "cpu"},
        "paths": {"models_dir": str(dest)},
        "hosts": [{"name": "h1", "address": "127.0.0.1"}],
        "models": [
            {
                "name": "tiny",
                "host": "h1",
                "port": 8101,
                "source": {"hf": {"repo": repo, "revision": revision}, "checksums": checksums},
            }
        ],
    }
    path = tmp / "fleet.yml"
    path.write_text(yaml.safe_dump(spec))
    return path


def fetch_cmd(spec: Path) -> list[str]:
    return [str(BIN / "vllm-fleet"), "fetch", str(spec), "--json"]


def fetch_env(hub: LocalHub, tmp: Path) -> dict[str, str]:
    return dict(
        os.environ, HF_ENDPOINT=hub.url, HF_HOME=str(tmp / "hf-home"), HF_HUB_DISABLE_TELEMETRY="1",
        HF_HUB_OFFLINE="0", HF_HUB_DISABLE_XET="1", NO_PROXY="127.0.0.1", no_proxy="127.0.0.1",
    )  # fmt: skip


def fetch(spec: Path, hub: LocalHub, tmp: Path) -> tuple[int, dict[str, Any], str]:
    res = subprocess.run(
        fetch_cmd(spec), env=fetch_env(hub, tmp), capture_output=True, text=True, timeout=120
    )
    data = json.loads(res.stdout) if res.returncode == 0 else {}
    return res.returncode, data, res.stderr


def model_dir(tmp: Path) -> Path:
    return tmp / "models" / "tiny"


def test_download_pinned_tag_verify_and_rerun_offline(hub: LocalHub, source: Path, tmp_path: Path) -> None:
    expected = sha256s(source)
    spec = write_spec(tmp_path, tmp_path / "models", **{WEIGHTS: expected[WEIGHTS]})
    rc, out, err = fetch(spec, hub, tmp_path)
    assert rc == 0, err
    commit = hub.repos[REPO_ID].commit
    [m] = out["models"]
    assert out["changed"] and m["commit"] == commit and m["revision"] == "v1.0"
    assert m["files"] == expected  # every file, byte for byte
    manifest = json.loads((Path(m["path"]) / MANIFEST).read_text())
    assert manifest["commit"] == commit and manifest["source"]["kind"] == "hf"
    # the tag was resolved once, then every file was asked for at the commit, not at the (movable) tag
    resolves = [p for meth, p, _ in hub.log if "/resolve/" in p]
    assert resolves and all(f"/resolve/{commit}/" in p for p in resolves), resolves
    # a rerun: up to date from the checksum manifest, nothing asked of the hub
    before = len(hub.log)
    rc, again, err = fetch(spec, hub, tmp_path)
    assert rc == 0, err
    assert not again["changed"] and again["models"][0]["commit"] == commit
    assert len(hub.log) == before, hub.log[before:]
    # and a rerun with the hub gone still verifies what is on disk (engines run offline)
    hub.stop()
    res = subprocess.run(
        fetch_cmd(spec), env=fetch_env(hub, tmp_path), capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 0 and not json.loads(res.stdout)["changed"], res.stderr


def test_commit_hash_revision_skips_the_lookup(hub: LocalHub, tmp_path: Path) -> None:
    commit = hub.repos[REPO_ID].commit
    rc, out, err = fetch(write_spec(tmp_path, tmp_path / "models", revision=commit), hub, tmp_path)
    assert rc == 0, err
    assert out["models"][0]["commit"] == commit
    assert not [p for _, p, _ in hub.log if "/revision/" in p]  # a hash needs no resolving


def test_broken_transfer_resumes_with_a_range_request(hub: LocalHub, source: Path, tmp_path: Path) -> None:
    hub.cut[BIG] = CHUNK + 5000  # the first GET stops 5 kB into the second chunk
    rc, out, err = fetch(write_spec(tmp_path, tmp_path / "models"), hub, tmp_path)
    assert rc == 0, err
    assert hub.downloads(BIG) == ["", f"bytes={CHUNK}-"], hub.downloads(BIG)
    assert out["models"][0]["files"][BIG] == sha256s(source)[BIG]


def partial_sizes(folder: Path) -> list[int]:
    """Sizes of the partial files now in `folder`; one renamed into place between the listing and its stat
    (a small file finishing) is skipped, not an error."""
    sizes = []
    for p in folder.glob("*.incomplete"):
        try:
            sizes.append(p.stat().st_size)
        except FileNotFoundError:
            continue
    return sizes


def test_killed_fetch_keeps_finished_files(hub: LocalHub, source: Path, tmp_path: Path) -> None:
    """huggingface_hub 2.x does not reuse a killed process's partial file: the rerun keeps every finished
    file (no second GET), downloads the interrupted one again and leaves no partial file behind."""
    hub.slow[BIG] = 0.01  # 64 KiB every 10 ms: about 5 s for the file
    spec = write_spec(tmp_path, tmp_path / "models")
    proc = subprocess.Popen(fetch_cmd(spec), env=fetch_env(hub, tmp_path), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)  # fmt: skip
    partial = model_dir(tmp_path) / ".cache" / "huggingface" / "download"
    small = sorted(rel for rel in sha256s(source) if rel != BIG)
    deadline = time.monotonic() + 60
    got = 0
    while time.monotonic() < deadline and not (
        got >= CHUNK and all((model_dir(tmp_path) / rel).is_file() for rel in small)
    ):
        got = max(partial_sizes(partial), default=0)
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    assert got >= CHUNK, "the download never got going"
    assert not (model_dir(tmp_path) / BIG).exists() and list(partial.glob("*.incomplete"))
    gets = {rel: len(hub.downloads(rel)) for rel in sha256s(source)}
    hub.slow.clear()
    rc, out, err = fetch(spec, hub, tmp_path)
    assert rc == 0, err
    assert "removed 1 partial file(s) of an interrupted fetch" in err
    assert {rel: len(hub.downloads(rel)) - n for rel, n in gets.items()} == {
        rel: int(rel == BIG) for rel in gets
    }
    assert not list(partial.glob("*.incomplete"))
    assert out["models"][0]["files"] == sha256s(source)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"revision": "v9.9"}, "models[tiny].source.hf.revision 'v9.9': no such revision"),
        (
            {"repo": "fleet-tests/nope"},
            "models[tiny].source.hf.repo 'fleet-tests/nope': repository not found",
        ),
        ({"config.json": "0" * 64}, "config.json: sha256 "),
    ],
)
def test_bad_source_fails_naming_the_field(
    hub: LocalHub, tmp_path: Path, change: dict[str, str], message: str
) -> None:
    args = {k: v for k, v in change.items() if k in ("revision", "repo")}
    sums = {k: v for k, v in change.items() if k not in args}
    rc, _, err = fetch(write_spec(tmp_path, tmp_path / "models", **args, **sums), hub, tmp_path)
    assert rc == 1
    assert message in err, err
    assert not (model_dir(tmp_path) / MANIFEST).exists()  # nothing recorded as verified
