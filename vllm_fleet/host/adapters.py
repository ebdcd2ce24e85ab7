"""An instance's LoRA adapters on its running engine: load, unload, read back; ``vllm-fleet adapters``.

The instance's adapters file (``vllm_fleet.contracts.AdaptersFile``, named by its config's environment
``VLLM_FLEET_ADAPTERS_FILE``) lists every adapter of its base model and which ones it carries. The engine runs
with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``, so its API loads and unloads adapters at runtime:
``POST /v1/load_lora_adapter {"lora_name", "lora_path"}`` (200 text; 400 "has already been loaded" when it
is), ``POST /v1/unload_lora_adapter {"lora_name"}`` (200 text; 404 when it is not loaded), and
``GET /v1/models`` lists the loaded ones with ``parent`` = the base model. Adding or removing an adapter never
changes the instance config, so it never restarts the engine.

- The launcher (``vllm_fleet.host.launcher``) loads the carried adapters after the engine answers and before
  READY=1 (``load_carried``), and keeps the adapter state file (``AdapterStateFile``:
  ``{state_dir}/adapters/NAME.json``) current for the exporter (``write_state``).
- ``vllm-fleet adapters sync INSTANCE`` (the play, after it rendered the adapters file): loads the carried
  adapters the engine lacks, unloads the loaded ones the file no longer lists, and with ``--reload NAME``
  loads an adapter again from its (changed) files; writes the state file; prints
  ``{"instance", "loaded", "unloaded", "reloaded", "changed", "skipped"}`` (``--json``) and exits 1 with the
  engine's message when the engine refuses one. An instance that is not running is skipped (exit 0).
- ``vllm-fleet adapters show [INSTANCE]``: what each LoRA instance carries and what its engine has loaded.

Adapters the file lists but the instance does not carry are loaded on demand by the engine's resolver
(``vllm_fleet.host.lora_resolver``: the spill path); sync leaves them loaded.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_fleet.contracts import (
    DEFAULT_CONFIG_DIR,
    AdapterEntry,
    AdaptersFile,
    AdapterStateFile,
    ContractError,
    InstanceConfig,
    adapter_state_path,
    adapters_file_of,
    is_adapters_file,
    read_state,
)
from vllm_fleet.files import write_json_atomic
from vllm_fleet.host.launcher_state import AdapterLoad

TIMEOUT = 30.0  # one engine call (a load reads the adapter's files and hands them to the engine core)
ALREADY_LOADED = "has already been loaded"  # vLLM's 400 for a load of a loaded name
RUNNING_STATES = ("loading", "ready")  # launcher states of an instance whose engine sync may change


class EngineError(Exception):
    """The engine refused a call (``status``: its HTTP status) or did not answer (``status`` None)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status

    @property
    def answered(self) -> bool:
        return self.status is not None


def _call(host: str, port: int, method: str, path: str, body: Any, timeout: float) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json", "User-Agent": "vllm-fleet-adapters"}
        conn.request(method, path, body=data, headers=headers)
        r = conn.getresponse()
        return r.status, r.read()
    except (OSError, http.client.HTTPException) as exc:
        raise EngineError(f"{method} {path}: no answer ({type(exc).__name__}: {exc})") from None
    finally:
        conn.close()


def engine_message(raw: bytes) -> str:
    """The message of a vLLM error body (``{"error": {"message"}}``, ``{"detail"}``), else the text."""
    text = raw.decode(errors="replace").strip()
    with contextlib.suppress(ValueError):
        doc = json.loads(text)
        if isinstance(doc, dict):
            err = doc.get("error")
            if isinstance(err, dict) and err.get("message"):
                return str(err["message"])
            if doc.get("detail"):
                return str(doc["detail"])
    return text[:500]


def loaded(host: str, port: int, model: str, timeout: float = TIMEOUT) -> dict[str, str]:
    """The adapters the engine has loaded for ``model``: name → path (``/v1/models`` entries whose parent is
    the base model)."""
    status, raw = _call(host, port, "GET", "/v1/models", None, timeout)
    if status != 200:
        raise EngineError(f"GET /v1/models: HTTP {status}: {engine_message(raw)}", status)
    try:
        data = json.loads(raw)["data"]
        return {str(m["id"]): str(m.get("root") or "") for m in data if m.get("parent") == model}
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise EngineError(f"GET /v1/models: not a model list ({exc})", status) from None


def load(host: str, port: int, adapter: AdapterEntry, timeout: float = TIMEOUT) -> bool:
    """Load ``adapter`` (True), or find it loaded already (False: vLLM's 400 "has already been loaded");
    ``EngineError`` with the engine's message otherwise."""
    body = {"lora_name": adapter.name, "lora_path": adapter.path}
    status, raw = _call(host, port, "POST", "/v1/load_lora_adapter", body, timeout)
    if status == 200:
        return True
    msg = engine_message(raw)
    if status == 400 and ALREADY_LOADED in msg:
        return False
    raise EngineError(f"HTTP {status}: {msg}", status)


def unload(host: str, port: int, name: str, timeout: float = TIMEOUT) -> bool:
    """Unload adapter ``name`` (True), or find it not loaded (False: vLLM's 404)."""
    status, raw = _call(host, port, "POST", "/v1/unload_lora_adapter", {"lora_name": name}, timeout)
    if status == 200:
        return True
    if status == 404:
        return False
    raise EngineError(f"HTTP {status}: {engine_message(raw)}", status)


# ---------------------------------------------------------------------------------------------- state file


def write_state(state_dir: str | Path, instance: str, model: str, names: list[str]) -> Path:
    """Atomically replace ``{state_dir}/adapters/{instance}.json`` (``AdapterStateFile``). Run as root (the
    play's ``adapters sync``), a folder or file it creates belongs to the state folder's owner, so the
    launcher (the instances' user) can replace the file afterwards. ``OSError`` when it cannot be written."""
    path = adapter_state_path(state_dir, instance)
    d = path.parent
    made = not d.is_dir()
    if made:
        d.mkdir(parents=True, exist_ok=True)
        d.chmod(0o755)  # the units' UMask=0077; the exporter (another user) lists it
    owner = Path(state_dir).stat() if os.geteuid() == 0 else None
    if owner is not None and made:
        os.chown(d, owner.st_uid, owner.st_gid)
    data: AdapterStateFile = {
        "instance": instance,
        "model": model,
        "loaded": sorted(names),
        "updated_at": time.time(),
    }
    write_json_atomic(path, data, owner=None if owner is None else (owner.st_uid, owner.st_gid))
    return path


# --------------------------------------------------------------------------------------- the launcher's load


def read_adapters_file(path: str) -> AdaptersFile | None:
    """The adapters file, or None when there is none (LoRA on, nothing rendered yet: nothing to carry).
    ``ContractError`` / ``OSError`` when it cannot be read."""
    try:
        return AdaptersFile.load(path)
    except FileNotFoundError:
        return None


def load_carried(host: str, port: int, model: str, file: str, timeout: float = TIMEOUT) -> AdapterLoad:
    """Load every adapter ``file`` says this instance carries (stop at the first the engine refuses), then
    read back what the engine has loaded: per adapter a line for the journal, the first failure (adapter, the
    engine's message, whether the engine answered) and the loaded set. For the launcher, before READY=1."""
    lines: list[str] = []
    try:
        doc = read_adapters_file(file)
    except (OSError, ContractError) as exc:
        return AdapterLoad(failed=("(adapters file)", f"cannot read {file}: {exc}", True))
    if doc is None:
        lines.append(f"no adapters file {file}: no adapter to carry")
    carried = doc.carried if doc is not None else []
    for a in carried:
        t0 = time.monotonic()
        try:
            fresh = load(host, port, a, timeout)
        except EngineError as exc:
            return AdapterLoad(tuple(lines), (a.name, f"{a.path}: {exc}", exc.answered))
        took = (time.monotonic() - t0) * 1000
        lines.append(f"adapter {a.name} {'loaded' if fresh else 'was loaded already'} ({took:.0f} ms)")
    try:
        now = tuple(sorted(loaded(host, port, model, timeout)))
    except EngineError as exc:
        return AdapterLoad(tuple(lines), ("(loaded adapters)", str(exc), exc.answered))
    if missing := sorted({a.name for a in carried} - set(now)):
        return AdapterLoad(tuple(lines), (missing[0], "loaded, but /v1/models does not list it", True), now)
    return AdapterLoad(tuple(lines), None, now)


# ---------------------------------------------------------------------------------------------------- sync


@dataclass
class SyncResult:
    """What ``sync`` did (``skipped``: why nothing was done; ``error``: the engine's refusal)."""

    instance: str
    loaded: list[str] = field(default_factory=list)
    unloaded: list[str] = field(default_factory=list)
    reloaded: list[str] = field(default_factory=list)
    skipped: str | None = None
    error: str | None = None
    adapters: list[str] = field(default_factory=list)  # what the engine has loaded afterwards

    @property
    def changed(self) -> bool:
        return bool(self.loaded or self.unloaded or self.reloaded)

    def to_dict(self) -> dict[str, Any]:
        return {
            "instance": self.instance,
            "loaded": self.loaded,
            "unloaded": self.unloaded,
            "reloaded": self.reloaded,
            "changed": self.changed,
            "skipped": self.skipped,
            "error": self.error,
            "adapters": self.adapters,
        }

    def text(self) -> str:
        if self.skipped:
            return f"{self.instance}: skipped ({self.skipped})"
        parts = [f"{k} {', '.join(v)}" for k, v in (("loaded", self.loaded), ("unloaded", self.unloaded),
                                                     ("reloaded", self.reloaded)) if v]  # fmt: skip
        done = "; ".join(parts) if parts else "nothing to change"
        out = f"{self.instance}: {done}; loaded now: {', '.join(self.adapters) or '(none)'}"
        return out + (f"\n{self.instance}: FAILED: {self.error}" if self.error else "")


def not_running(cfg: InstanceConfig) -> str:
    """Why ``cfg``'s instance is not running by its launcher's state file ("" when it may be: loading or
    ready, or no state file to say)."""
    try:
        st = read_state(Path(cfg.state_dir) / f"{cfg.name}.json")
    except FileNotFoundError:
        return ""
    except (OSError, ContractError) as exc:
        return f"its state file cannot be read: {exc}"
    state = st.get("state")
    return "" if state in RUNNING_STATES else f"its launcher reports {state}"


def sync(cfg: InstanceConfig, reload: list[str] | None = None, timeout: float = TIMEOUT) -> SyncResult:
    """Make the engine's loaded adapters what the adapters file says: unload what the file no longer lists,
    load what it carries, then load again the ``reload`` names that are loaded (from their changed files).
    Adapters the file lists without carrying them stay as they are (the resolver loads them on demand)."""
    res = SyncResult(cfg.name)
    file = adapters_file_of(cfg.environment)
    if not file:
        res.skipped = "LoRA is off for this instance (no VLLM_FLEET_ADAPTERS_FILE in its config)"
        return res
    if why := not_running(cfg):
        res.skipped = f"not running: {why}"
        return res
    try:
        doc = read_adapters_file(file)
    except (OSError, ContractError) as exc:
        res.error = f"cannot read {file}: {exc}"
        return res
    host, port, model = cfg.probe_host, cfg.port, cfg.served_model_name
    try:
        now = loaded(host, port, model, timeout)
    except EngineError as exc:
        if not exc.answered:
            res.skipped = f"not running: the engine does not answer ({exc})"
        else:
            res.error = str(exc)
        return res
    listed = {a.name: a for a in (doc.adapters if doc is not None else ())}
    step = ""
    try:
        for name in sorted(set(now) - set(listed)):
            step = f"unload {name}"
            if unload(host, port, name, timeout):
                res.unloaded.append(name)
        for a in doc.carried if doc is not None else []:
            if a.name not in now:
                step = f"load {a.name} ({a.path})"
                if load(host, port, a, timeout):
                    res.loaded.append(a.name)
        for name in dict.fromkeys(reload or []):
            again = listed.get(name)
            if again is None or name not in now:
                continue  # not this base's, or not loaded before (a load now read the new files already)
            step = f"reload {name} ({again.path})"
            unload(host, port, name, timeout)
            load(host, port, again, timeout)
            res.reloaded.append(name)
        step = "read back"
        res.adapters = sorted(loaded(host, port, model, timeout))
    except EngineError as exc:
        res.error = f"{step}: {exc}"
        with contextlib.suppress(EngineError):
            res.adapters = sorted(loaded(host, port, model, timeout))
    with contextlib.suppress(OSError):
        write_state(cfg.state_dir, cfg.name, model, res.adapters)
    return res


# ---------------------------------------------------------------------------------------------------- show


def instance_configs(config_dir: Path, name: str | None = None) -> list[InstanceConfig]:
    """The instance configs of ``config_dir/instances`` (one: ``name``), not the adapters files beside them."""
    folder = config_dir / "instances"
    paths = (
        [folder / f"{name}.json"]
        if name
        else sorted(p for p in folder.glob("*.json") if not is_adapters_file(p))
    )
    return [InstanceConfig.load(p) for p in paths]


def show(cfg: InstanceConfig, timeout: float = 5.0) -> dict[str, Any]:
    """One LoRA instance: the adapters its file lists (carried or not) and what its engine has loaded."""
    file = adapters_file_of(cfg.environment)
    out: dict[str, Any] = {"instance": cfg.name, "model": cfg.served_model_name, "adapters_file": file}
    try:
        doc = read_adapters_file(file)
    except (OSError, ContractError) as exc:
        doc, out["error"] = None, f"cannot read {file}: {exc}"
    try:
        now: dict[str, str] | None = loaded(cfg.probe_host, cfg.port, cfg.served_model_name, timeout)
    except EngineError as exc:
        now, out["engine"] = None, str(exc)
    listed = doc.adapters if doc is not None else []
    rows = [
        {"name": a.name, "carry": a.carry, "rank": a.rank, "path": a.path,
         "loaded": None if now is None else a.name in now}
        for a in listed
    ]  # fmt: skip
    names = {a.name for a in listed}
    rows += [  # loaded, and not (or no longer) in the file
        {"name": name, "carry": False, "rank": None, "path": path, "loaded": True}
        for name, path in sorted((now or {}).items())
        if name not in names
    ]
    out["adapters"] = rows
    return out


def show_text(docs: list[dict[str, Any]]) -> str:
    lines = [f"{'INSTANCE':<16} {'MODEL':<20} {'ADAPTER':<24} {'CARRY':<6} LOADED"]
    for d in docs:
        if d.get("engine"):
            lines.append(f"{d['instance']:<16} {d['model']:<20} (engine: {d['engine']})")
        for r in d["adapters"]:
            state = "?" if r["loaded"] is None else "yes" if r["loaded"] else "no"
            carry = "yes" if r["carry"] else "no"
            lines.append(f"{d['instance']:<16} {d['model']:<20} {r['name']:<24} {carry:<6} {state}")
        if not d["adapters"]:
            lines.append(f"{d['instance']:<16} {d['model']:<20} (no adapters)")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------- command


def _sync_cmd(a: argparse.Namespace) -> int:
    try:
        cfg = instance_configs(Path(a.config_dir), a.instance)[0]
    except (OSError, ContractError) as exc:
        print(f"adapters sync: {a.instance}: {exc}", file=sys.stderr)
        return 2
    res = sync(cfg, a.reload)
    print(json.dumps(res.to_dict(), sort_keys=True) if a.json else res.text())
    if res.error and not a.json:
        print(f"adapters sync: {cfg.name}: {res.error}", file=sys.stderr)
    return 1 if res.error else 0


def _show_cmd(a: argparse.Namespace) -> int:
    try:
        cfgs = instance_configs(Path(a.config_dir), a.instance)
    except (OSError, ContractError) as exc:
        print(f"adapters show: {exc}", file=sys.stderr)
        return 2
    docs = [show(c) for c in cfgs if adapters_file_of(c.environment)]
    if a.instance and not docs:
        print(f"adapters show: {a.instance}: LoRA is off for this instance", file=sys.stderr)
        return 2
    print(json.dumps(docs, indent=2) if a.json else show_text(docs))
    return 0


def add_args(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="adapters_cmd", required=True, metavar="ACTION")
    sp = sub.add_parser(
        "sync",
        help="make a running instance's loaded adapters what its adapters file says (load, unload, reload)",
        description="Load the carried adapters the engine lacks, unload the ones the adapters file no longer "
        "lists, load --reload NAMEs again from their files; write the adapter state file. Exit 0 (also when "
        "the instance is not running: skipped), 1 when the engine refused (its message), 2 no such instance.",
    )
    sp.add_argument("instance", help="instance name (reads CONFIG_DIR/instances/INSTANCE.json)")
    sp.add_argument(
        "--reload",
        nargs="+",
        action="extend",
        default=[],
        metavar="NAME",
        help="adapters whose files changed",
    )
    sp.set_defaults(handler=_sync_cmd)
    sh = sub.add_parser("show", help="the adapters each LoRA instance carries and what its engine has loaded")
    sh.add_argument("instance", nargs="?", help="one instance (default: every LoRA instance of this host)")
    sh.set_defaults(handler=_show_cmd)
    for x in (sp, sh):
        x.add_argument("--config-dir", default=DEFAULT_CONFIG_DIR, help=f"default {DEFAULT_CONFIG_DIR}")
        x.add_argument("--json", action="store_true", help="machine-readable output")
