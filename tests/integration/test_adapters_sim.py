"""LoRA adapters on the host, with the sim engine (vLLM's LoRA API without vLLM; its LoRA is checked against a real
engine by test_engine_contract): the launcher loads the carried adapters before READY=1 and writes the adapter
state file; ``vllm-fleet adapters sync`` loads, unloads and reloads by the adapters file; a refused adapter fails
the start as a configuration error with the engine's message; a listed adapter that is not carried is served
through the resolver. Seconds, no vLLM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from vllm_fleet.devtools.gateway_testing import wait_for
from vllm_fleet.devtools.launched import LaunchedInstance, start, write_config
from vllm_fleet.devtools.testing import SIM_LAUNCHER_SERVICE, free_port, http_json, sim_engine_argv
from vllm_fleet.host.launcher import EXIT_CONFIG

LORA_FLAGS = ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "8"]


def adapter(folder: Path, rank: int = 8) -> Path:
    """A peft adapter folder as the sim reads it (its config; the sim loads no weights)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": rank, "base_model_name_or_path": "sim-served"})
    )
    return folder


class Instance:
    """An instance config ``sim`` of a LoRA model (its adapters file beside it), run by the launcher."""

    def __init__(self, workdir: Path, model: Path, carried: dict[str, int], listed: dict[str, int]) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.adapters_dir = workdir / "adapters"
        self.file = workdir / "instances" / "sim.adapters.json"
        cfg = {
            "name": "sim", "served_model_name": "sim-served", "model_path": str(model),
            "listen_address": "127.0.0.1", "port": self.port,
            "command": sim_engine_argv(model, self.port, "sim-served", LORA_FLAGS, shutdown_timeout=5),
            "environment": {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1", "VLLM_FLEET_ADAPTERS_FILE": str(self.file)},
            "shutdown_timeout": 5, "state_dir": str(workdir / "state"), "service": SIM_LAUNCHER_SERVICE,
        }  # fmt: skip
        write_config(workdir, "sim", cfg)
        self.write_adapters(carried, listed)
        self.run: LaunchedInstance | None = None

    def write_adapters(self, carried: dict[str, int], listed: dict[str, int] | None = None) -> None:
        """The adapters file as the render writes it: ``carried`` and ``listed`` (not carried) name → rank."""
        rows = [
            {"name": n, "path": str(adapter(self.adapters_dir / n, r)), "rank": r, "carry": n in carried}
            for n, r in {**carried, **(listed or {})}.items()
        ]
        doc = {"schema": 1, "instance": "sim", "model": "sim-served", "adapters": rows}
        self.file.write_text(json.dumps(doc))

    def launch(self) -> LaunchedInstance:
        """The launcher on the config (its own session: ``stop`` kills its process group)."""
        self.run = start(self.workdir, "sim", new_session=True)
        return self.run

    def loaded(self) -> list[str]:
        st, doc = http_json("GET", self.url + "/v1/models")
        assert st == 200
        return sorted(m["id"] for m in doc["data"] if m["parent"] == "sim-served")

    def cli(self, *args: str) -> tuple[int, str, str]:
        r = subprocess.run(
            [sys.executable, "-m", "vllm_fleet.cli", "adapters", *args, "--config-dir", str(self.workdir)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        return r.returncode, r.stdout, r.stderr

    def sync(self, *args: str) -> tuple[int, dict[str, Any]]:
        rc, out, err = self.cli("sync", "sim", "--json", *args)
        assert out, err
        return rc, json.loads(out)

    def stop(self) -> None:
        if self.run is not None:
            self.run.kill()


@pytest.fixture
def lora(sim_model_dir: Path, tmp_path: Path) -> Iterator[Instance]:
    inst = Instance(tmp_path, sim_model_dir, carried={"ad-a": 8}, listed={"ad-c": 8})
    try:
        yield inst
    finally:
        inst.stop()


def test_ready_after_the_carried_adapters_then_sync_loads_unloads_and_reloads(lora: Instance) -> None:
    run = lora.launch()
    i_ready = run.notify.wait_for("READY", "1", timeout=60)
    # READY=1 came after the carried adapter was loaded: the state file written before it says so
    ready_status = run.notify.messages[i_ready][1]["STATUS"]
    assert ready_status.startswith(f"Serving sim-served on 127.0.0.1:{lora.port}, adapter ad-a (ready in"), (
        ready_status
    )
    statuses = run.notify.values("STATUS")
    assert any("loading adapters" in s for s in statuses), statuses
    st = run.adapter_state()
    assert (st["instance"], st["model"], st["loaded"]) == ("sim", "sim-served", ["ad-a"])
    assert time.time() - st["updated_at"] < 60
    assert lora.loaded() == ["ad-a"]
    assert "adapter ad-a loaded" in run.output()
    # a request for the carried adapter: served, the answer names the adapter
    st_, doc = http_json(
        "POST", lora.url + "/v1/completions", {"model": "ad-a", "prompt": "x", "max_tokens": 2}
    )
    assert st_ == 200 and doc["model"] == "ad-a", doc
    # a listed adapter this instance does not carry: loaded by the resolver on its first request (the spill path)
    st_, doc = http_json(
        "POST", lora.url + "/v1/completions", {"model": "ad-c", "prompt": "x", "max_tokens": 2}
    )
    assert st_ == 200 and doc["model"] == "ad-c", doc
    # an adapter the file does not list: vLLM's 404
    st_, doc = http_json(
        "POST", lora.url + "/v1/completions", {"model": "ad-z", "prompt": "x", "max_tokens": 2}
    )
    assert st_ == 404 and "does not exist" in doc["error"]["message"], doc
    # nothing to do: the carried one is loaded, the spilled one stays
    rc, res = lora.sync()
    assert rc == 0 and res == {"instance": "sim", "loaded": [], "unloaded": [], "reloaded": [], "changed": False,
                               "skipped": None, "error": None, "adapters": ["ad-a", "ad-c"]}  # fmt: skip
    # ad-b carried now: loaded without a restart
    pid = run.state()["engine_pid"]
    lora.write_adapters({"ad-a": 8, "ad-b": 8}, {"ad-c": 8})
    rc, res = lora.sync()
    assert (
        rc == 0
        and res["loaded"] == ["ad-b"]
        and res["changed"]
        and res["adapters"] == ["ad-a", "ad-b", "ad-c"]
    )
    assert run.adapter_state()["loaded"] == ["ad-a", "ad-b", "ad-c"]
    # ad-a and ad-c out of the file: unloaded; ad-b's files changed: loaded again
    lora.write_adapters({"ad-b": 8})
    rc, res = lora.sync("--reload", "ad-b", "ad-x")
    assert rc == 0, res
    assert (res["unloaded"], res["loaded"], res["reloaded"]) == (["ad-a", "ad-c"], [], ["ad-b"])
    assert lora.loaded() == ["ad-b"] and run.adapter_state()["loaded"] == ["ad-b"]
    assert run.state()["engine_pid"] == pid and run.state()["state"] == "ready"  # never restarted
    # show: what the file lists and what the engine has loaded
    rc, out, err = lora.cli("show", "--json")
    assert rc == 0, err
    (doc,) = json.loads(out)
    assert [(r["name"], r["carry"], r["loaded"]) for r in doc["adapters"]] == [("ad-b", True, True)]
    rc, out, _ = lora.cli("show")
    assert rc == 0 and out.splitlines()[1].split() == ["sim", "sim-served", "ad-b", "yes", "yes"], out
    # an adapter the engine refuses (rank above --max-lora-rank): exit 1, the engine's message
    lora.write_adapters({"ad-b": 8, "big": 16})
    rc, res = lora.sync()
    assert rc == 1 and "LoRA rank 16 is greater than max_lora_rank 8" in res["error"], res
    assert res["adapters"] == ["ad-b"] and res["loaded"] == []
    rc, out, err = lora.cli("sync", "sim")
    assert rc == 1 and "FAILED" in out and "max_lora_rank 8" in err, (out, err)
    # stopped: skipped, nothing done
    run.proc.send_signal(signal.SIGTERM)
    assert run.proc.wait(30) == 0
    assert run.adapter_state()["loaded"] == []  # the engine is gone: nothing loaded
    rc, res = lora.sync()
    assert rc == 0 and res["skipped"] and res["skipped"].startswith("not running"), res
    assert not res["changed"]


def test_a_refused_carried_adapter_fails_the_start_with_the_engines_message(lora: Instance) -> None:
    lora.write_adapters({"ad-a": 8, "big": 16})
    run = lora.launch()
    assert run.proc.wait(60) == EXIT_CONFIG, run.output()[-2000:]
    st = run.state()
    assert st["state"] == "failed" and st["phase"] == "configuration error", st
    why = st["failure_reason"]
    assert why.startswith("LoRA adapter big could not be loaded: ") and "HTTP 500" in why, why
    assert "LoRA rank 16 is greater than max_lora_rank 8." in why, why
    assert why in run.output()  # the journal
    assert any(s.startswith("Failed: LoRA adapter big") for s in run.notify.values("STATUS"))
    assert "READY" not in {k for _, f in run.notify.messages for k in f}
    assert wait_for(
        lambda: not run.state()["engine_pid"] or not os.path.exists(f"/proc/{st['engine_pid']}"), 10
    )


def test_lora_off_sync_is_skipped(sim_model_dir: Path, tmp_path: Path) -> None:
    inst = Instance(tmp_path, sim_model_dir, carried={}, listed={})
    cfg_path = tmp_path / "instances" / "sim.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["environment"] = {}
    cfg_path.write_text(json.dumps(cfg))
    rc, res = inst.sync()
    assert rc == 0 and res["skipped"].startswith("LoRA is off"), res
    rc, _, err = inst.cli("sync", "nope")
    assert rc == 2 and "nope" in err
