"""The engine role's stack bookkeeping on a host (the vllm_fleet_stacks module, ansible/plugins/modules): which
venv a new stack is hard-linked from, which stacks are in use, which are pruned (never one an instance config, a
rollback copy or a running engine names; the newest ones kept)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from ansible_module_loader import load as load_module  # no ansible import in-process

STACKS = load_module("vllm_fleet_stacks")


def stack(root: Path, name: str, mtime: float, done: bool = True) -> Path:
    d = root / "stacks" / name
    (d / "bin").mkdir(parents=True)
    (d / "bin" / "python").write_text("")
    if done:
        marker = d / ".vllm-fleet-installed.json"
        marker.write_text("{}")
        os.utime(marker, (mtime, mtime))
    return d


def run(root: Path, new: str | list[str], keep: int = 2) -> dict[str, Any]:
    args = {"stacks_dir": str(root / "stacks"), "new": new, "keep": keep, "config_dir": str(root / "inst"),
            "state_dir": str(root / "run"), "rollback_dir": str(root / "rb"), "legacy": str(root / "venv")}  # fmt: skip
    return STACKS.stacks_state(args)  # type: ignore[no-any-return]


def config(folder: Path, name: str, venv: Path) -> None:
    folder.mkdir(exist_ok=True)
    (folder / f"{name}.json").write_text(
        json.dumps({"name": name, "command": [f"{venv}/bin/python", "-m", "x"]})
    )


def test_a_first_stack_is_copied_from_the_legacy_venv_then_from_the_newest_stack(tmp_path: Path) -> None:
    assert run(tmp_path, "cpu-0.32.0-aaaaaaaaaaaa")["seed"] == ""
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    (tmp_path / "venv" / "bin" / "python").write_text("")
    assert run(tmp_path, "cpu-0.32.0-aaaaaaaaaaaa")["seed"] == str(tmp_path / "venv")
    stack(tmp_path, "cpu-0.32.0-aaaaaaaaaaaa", 100)
    stack(tmp_path, "cpu-0.32.0-bbbbbbbbbbbb", 200)
    stack(tmp_path, "cpu-0.32.0-half", 0, done=False)  # an interrupted install: never a seed
    assert run(tmp_path, "cpu-0.33.0-cccccccccccc")["seed"] == str(
        tmp_path / "stacks" / "cpu-0.32.0-bbbbbbbbbbbb"
    )
    # the new stack exists: nothing to copy
    assert run(tmp_path, "cpu-0.32.0-aaaaaaaaaaaa")["seed"] == ""


def test_prune_keeps_the_new_the_previous_and_every_stack_in_use(tmp_path: Path) -> None:
    old = stack(tmp_path, "s1", 100)
    running = stack(tmp_path, "s2", 200)
    kept = stack(tmp_path, "s3", 300)
    previous = stack(tmp_path, "s4", 400)
    stack(tmp_path, "s5", 500)  # the new one
    half = stack(tmp_path, "s6", 0, done=False)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "a.json").write_text(json.dumps({"instance": "a", "stack": running.name}))
    config(tmp_path / "rb", "b", kept)
    config(tmp_path / "inst", "c", previous)
    got = run(tmp_path, "s5")
    assert got["in_use"] == ["s2", "s3", "s4"]
    # s4 is in use, so the one "previous" slot goes to the newest other: none left but s1, pruned with the half one
    assert got["prune"] == sorted([str(old), str(half)])
    # with nothing in use, the newest other (s4) is the previous one kept
    for p in (tmp_path / "run" / "a.json", tmp_path / "rb" / "b.json", tmp_path / "inst" / "c.json"):
        p.unlink()
    got = run(tmp_path, "s5")
    assert got["in_use"] == [] and got["prune"] == sorted(
        str(tmp_path / "stacks" / n) for n in ("s1", "s2", "s3", "s6")
    )


def test_the_fleet_venv_lock_is_the_named_pins_with_their_hashes(tmp_path: Path) -> None:
    """The vllm_fleet_tools_lock module's selection (the fleet's own venv's lock)."""
    tools = load_module("vllm_fleet_tools_lock")
    lock = (
        "# vllm-fleet lock\n"
        "pydantic==2.14.4 \\\n    --hash=sha256:aaaa\n"
        "pydantic-core==2.50.5 \\\n    --hash=sha256:bbbb\n"
        "sdnotify==0.3.2 \\\n    --hash=sha256:cccc \\\n    --hash=sha256:dddd\n"
        "torch==2.13.0+cpu \\\n    --hash=sha256:eeee\n"
    )
    lines = tools.pins(lock, ["pydantic", "pydantic_core", "SDNotify"])
    assert [ln.split()[0] for ln in lines] == ["pydantic==2.14.4", "pydantic-core==2.50.5", "sdnotify==0.3.2"]
    assert lines[2].split()[1:] == ["--hash=sha256:cccc", "--hash=sha256:dddd"]  # every hash of a pin kept
    with pytest.raises(ValueError, match="no pin for pyyaml"):
        tools.pins(lock, ["pyyaml"])


def test_a_host_with_two_stacks_seeds_each_from_its_own_profile_and_keeps_both(tmp_path: Path) -> None:
    """models[].stack: a gpu and a cpu stack on one host. Each new one is hard-linked from the newest complete
    stack of its own profile (else the newest), neither is pruned, and the previous one is still kept."""
    stack(tmp_path, "gpu-0.33.0-aaaaaaaaaaaa", 100)
    stack(tmp_path, "cpu-0.32.0-bbbbbbbbbbbb", 200)
    stack(tmp_path, "cpu-0.31.0-oooooooooooo", 50)
    out = run(tmp_path, ["gpu-0.33.0-cccccccccccc", "cpu-0.32.0-dddddddddddd"])
    assert out["seeds"] == {
        "gpu-0.33.0-cccccccccccc": str(tmp_path / "stacks" / "gpu-0.33.0-aaaaaaaaaaaa"),
        "cpu-0.32.0-dddddddddddd": str(tmp_path / "stacks" / "cpu-0.32.0-bbbbbbbbbbbb"),
    }
    assert out["seed"] == out["seeds"]["gpu-0.33.0-cccccccccccc"]
    # two new stacks + keep 2: one slot each for them, one for the newest previous (b); a's and o's go
    assert out["prune"] == sorted(
        str(tmp_path / "stacks" / n) for n in ("gpu-0.33.0-aaaaaaaaaaaa", "cpu-0.31.0-oooooooooooo")
    )
    # both exist and are complete: nothing to copy, and neither is pruned when one of them is "older"
    stack(tmp_path, "gpu-0.33.0-cccccccccccc", 300)
    stack(tmp_path, "cpu-0.32.0-dddddddddddd", 10)
    out = run(tmp_path, ["gpu-0.33.0-cccccccccccc", "cpu-0.32.0-dddddddddddd"])
    assert set(out["seeds"].values()) == {""}
    assert not {
        str(tmp_path / "stacks" / n) for n in ("gpu-0.33.0-cccccccccccc", "cpu-0.32.0-dddddddddddd")
    } & set(out["prune"])


def test_the_module_reads_a_stack_from_a_command_as_the_contracts_do() -> None:
    from vllm_fleet.contracts import stack_of

    for command in (
        ["/opt/vllm-fleet/stacks/cpu-0.32.0-abc/bin/python", "-m", "x"],
        ["/usr/bin/python3"],
        [],
        None,
    ):
        assert STACKS.stack_of(command) == stack_of(command), command
