"""LoRA adapters added to and removed from a running fleet under steady traffic, measured (docs/perf/lora.md).

    python -m vllm_fleet.devtools.lora_run DEPLOYED_SPEC ADDED_SPEC REMOVED_SPEC -i INVENTORY \\
        --gateway http://GW:8000 --api-key-file KEYFILE [--warmup 30] [--settle 30] \\
        [--ansible-arg=-e --ansible-arg=vllm_fleet_models_src=DIR ...] [--json OUT]

``DEPLOYED_SPEC`` is what runs; ``ADDED_SPEC`` the same fleet with one more adapter; ``REMOVED_SPEC`` that one
with another adapter gone. Client traffic (``failover.FailoverLoad``: per served name — the base and each
adapter — ``lanes`` lanes, plain and streamed, no client retries) runs for ``--warmup`` seconds, then
``ansible-playbook site.yml`` deploys ``ADDED_SPEC`` (the README's command with ``--ansible-arg``s), traffic for
the new adapter starts once the play ends, ``--settle`` seconds later the removed adapter's traffic stops and
the play deploys ``REMOVED_SPEC``; ``--settle`` seconds more, then everything stops. It prints, per served
name, the requests sent and failed (each failure with when and why), each play's time and its adapters-sync
report lines, the units' MainPID and NRestarts before and after (a restart would show), and what the gateway's
``GET /v1/models`` and each engine list after each step.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from vllm_fleet.devtools.failover import FailoverLoad
from vllm_fleet.fleet import engine
from vllm_fleet.fleet.remote import Remote, load_inventory
from vllm_fleet.fleet.spec import FleetSpec, load_spec


def served(spec: FleetSpec) -> list[str]:
    """The base models that have adapters, then every adapter."""
    bases = sorted({a.base for a in spec.adapters})
    return [*bases, *(a.name for a in spec.adapters)]


def units(remote: Remote, spec: FleetSpec) -> dict[str, str]:
    """Each LoRA instance's ``MainPID NRestarts`` (a restart changes them)."""
    out = {}
    bases = {a.base for a in spec.adapters}
    for m in spec.models:
        if m.served_model_name in bases and m.role != "canary":
            cp = remote.run(
                m.host, ["systemctl", "show", "-p", "MainPID", "-p", "NRestarts", f"vllm@{m.name}"]
            )
            out[m.name] = " ".join(cp.stdout.split())
    return out


def gateway_models(url: str, key: str | None) -> list[str]:
    req = urllib.request.Request(url.rstrip("/") + "/v1/models")
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    with urllib.request.urlopen(req, timeout=10) as r:
        data = json.load(r)["data"]
    return [f"{d['id']}<{d['parent']}" if d.get("parent") else d["id"] for d in data]


def engine_adapters(remote: Remote, spec: FleetSpec) -> dict[str, list[str]]:
    """What each LoRA instance's engine has loaded (its /v1/models, asked on its host)."""
    out = {}
    bases = {a.base for a in spec.adapters}
    for m in spec.models:
        if m.served_model_name in bases and m.role != "canary":
            address = engine.listen_address(spec, m)
            code = f"import urllib.request; print(urllib.request.urlopen('http://{address}:{m.port}/v1/models').read().decode())"
            cp = remote.run(m.host, ["python3", "-c", code])
            try:
                data = json.loads(cp.stdout or "{}").get("data", [])
            except ValueError:
                data = []
            out[m.name] = sorted(d["id"] for d in data if d.get("parent"))
    return out


def play(spec_file: str, inventory: str, extra: list[str]) -> dict[str, Any]:
    cmd = ["ansible-playbook", "-i", inventory, "site.yml", "-e", f"vllm_fleet_spec={spec_file}", *extra]
    t0 = time.time()
    cp = subprocess.run(cmd, capture_output=True, text=True)
    lines = cp.stdout.splitlines()
    sync = [ln.strip() for ln in lines if "adapters sync" in ln or '"loaded"' in ln or '"unloaded"' in ln]
    recap = [ln for ln in lines if "changed=" in ln and "failed=" in ln]
    if cp.returncode:
        sys.stderr.write(cp.stdout[-6000:] + cp.stderr[-2000:])
    return {"rc": cp.returncode, "seconds": round(time.time() - t0, 1), "sync": sync[-12:], "recap": recap}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("deployed")
    p.add_argument("added")
    p.add_argument("removed")
    p.add_argument("-i", "--inventory", required=True)
    p.add_argument("--gateway", required=True)
    p.add_argument("--api-key-file", default="")
    p.add_argument("--warmup", type=float, default=30.0)
    p.add_argument("--settle", type=float, default=30.0)
    p.add_argument("--lanes", type=int, default=2)
    p.add_argument("--pause", type=float, default=0.2)
    p.add_argument("--ansible-arg", action="append", default=[])
    p.add_argument("--json", default="")
    a = p.parse_args(argv)
    before, added, removed = load_spec(a.deployed), load_spec(a.added), load_spec(a.removed)
    new = [n for n in served(added) if n not in served(before)]
    gone = [n for n in served(added) if n not in served(removed)]
    if len(new) != 1 or len(gone) != 1:
        p.error(f"ADDED_SPEC must add one adapter ({new}) and REMOVED_SPEC remove one ({gone})")
    remote = Remote(load_inventory(a.inventory))
    key = Path(a.api_key_file).read_text().split()[0] if a.api_key_file else None

    def load(model: str, seed: int) -> FailoverLoad:
        return FailoverLoad(a.gateway, model, api_key=key, lanes=a.lanes, pause=a.pause, seed=seed,
                            read_timeout=30, timeout=60, connect_timeout=5)  # fmt: skip

    out: dict[str, Any] = {"added": new[0], "removed": gone[0], "lanes_per_name": a.lanes}
    out["units_before"] = units(remote, added)
    out["engines_before"] = engine_adapters(remote, before)
    out["gateway_before"] = gateway_models(a.gateway, key)
    loads = {m: load(m, k) for k, m in enumerate(served(before))}
    for ld in loads.values():
        ld.__enter__()
    time.sleep(a.warmup)
    out["play_add"] = play(a.added, a.inventory, a.ansible_arg)
    out["engines_after_add"] = engine_adapters(remote, added)
    out["gateway_after_add"] = gateway_models(a.gateway, key)
    loads[new[0]] = load(new[0], 99)
    loads[new[0]].__enter__()
    time.sleep(a.settle)
    loads[gone[0]].__exit__(None, None, None)  # its clients stop using it before it goes
    out["play_remove"] = play(a.removed, a.inventory, a.ansible_arg)
    out["engines_after_remove"] = engine_adapters(remote, removed)
    out["gateway_after_remove"] = gateway_models(a.gateway, key)
    time.sleep(a.settle)
    for m, ld in loads.items():
        if m != gone[0]:
            ld.__exit__(None, None, None)
    out["units_after"] = units(remote, added)
    per: dict[str, Any] = {}
    for m, ld in loads.items():
        failed = [r for r in ld.records if r.outcome != "ok"]
        per[m] = {
            "requests": len(ld.records),
            "failed": len(failed),
            "failures": [r.__dict__ for r in failed[:5]],
        }
    out["per_name"] = per
    out["requests"] = sum(v["requests"] for v in per.values())
    out["failed"] = sum(v["failed"] for v in per.values())
    out["restarted"] = out["units_before"] != out["units_after"]
    remote.close()
    print(json.dumps(out, indent=2, default=str))
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2, default=str) + "\n")
    return (
        0
        if out["failed"] == 0
        and not out["restarted"]
        and all(x["rc"] == 0 for x in (out["play_add"], out["play_remove"]))
        else 1
    )


if __name__ == "__main__":
    sys.exit(main())
