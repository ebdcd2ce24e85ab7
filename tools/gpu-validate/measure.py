"""Device side of the GPU validation (run by run-device.sh on the H200 machine; see docs/gpu-validation.md).

  measure.py start-bare   start a bare ``vllm serve`` (same argv as the rendered instance, port 8001) in its
                          own session, so it outlives this call; wait until /health is 200
  measure.py measure OUT  the launcher instance (port 8002) under a NOTIFY_SOCKET we own, nginx gateway
                          (port 8000) in front, nvidia-smi, bench compare (bare vs launcher + gateway) at
                          load and at batch 1, KV lines from both engines' logs, clean stop; results to OUT

Everything lives under /root/vf (the spec tools/gpu-validate/h200.yml points there).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

VF = Path("/root/vf")
SPEC = REPO / "tools/gpu-validate/h200.yml"
NAME = "qwen3-8b"
BARE_PORT, INST_PORT, GW_PORT = 8001, 8002, 8000
LOG = VF / "log"
PY = sys.executable
KV_RE = re.compile(
    r"GPU KV cache size|Available KV cache memory|Maximum concurrency|Model loading took|"
    r"init engine|torch\.compile takes|Graph capturing finished|Memory profiling|KV cache|"
    r"Using .*(backend|Backend)|FLASH_ATTN|flash.?attn|Loading weights took|CUDA graph|"
    r"non-default args|Starting vLLM|Application startup complete|ERROR|Error|Traceback"
)


# The carried vLLM 0.21.0 is installed by hand (run-device.sh install), not from a lock, and the repository
# captures no 0.21.0 argument list (only its pinned releases'): plan and render skip both checks here
LAB = ("--lock-dir", "", "--allow-unchecked-flags")


def vf_cli(*args: str, **kw: Any) -> subprocess.CompletedProcess[str]:
    # the console entry point
    code = "import sys; from vllm_fleet.cli import main; sys.exit(main())"
    return subprocess.run([PY, "-c", code, *args], text=True, capture_output=True, cwd=REPO, **kw)


def stop_launcher(lp: subprocess.Popen[bytes], timeout: float) -> tuple[int, float]:
    """SIGTERM to the launcher (what systemctl stop sends), SIGKILL to its session after ``timeout``: its exit
    code and the seconds it took."""
    ts = time.monotonic()
    lp.send_signal(signal.SIGTERM)
    try:
        rc = lp.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(lp.pid, signal.SIGKILL)
        rc = lp.wait(10)
    return rc, round(time.monotonic() - ts, 2)


def get(url: str, timeout: float = 2.0) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return int(r.status)
    except OSError:
        return 0


def render() -> dict[str, Any]:
    out = VF / "render"
    shutil.rmtree(out, ignore_errors=True)
    r = vf_cli("render", str(SPEC), "--out", str(out), *LAB)
    if r.returncode:
        raise SystemExit(f"render failed: {r.stdout}{r.stderr}")
    inst = out / "h200" / str(VF).lstrip("/") / "etc/instances" / f"{NAME}.json"
    (VF / "etc/instances").mkdir(parents=True, exist_ok=True)
    shutil.copy(inst, VF / "etc/instances" / f"{NAME}.json")
    return dict(json.loads(inst.read_text()))


def start_bare(wait: float) -> int:
    LOG.mkdir(parents=True, exist_ok=True)
    cfg = render()
    argv = list(cfg["command"])
    argv[argv.index("--port") + 1] = str(BARE_PORT)
    env = {**os.environ, **cfg["environment"], "VLLM_LOGGING_PREFIX": "[bare] "}
    log = (LOG / "bare.log").open("wb")
    t0 = time.time()
    p = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    (VF / "bare.json").write_text(json.dumps({"pid": p.pid, "argv": argv, "started_at": t0}))
    print(f"bare engine pid {p.pid}: {' '.join(argv)}", flush=True)
    while time.time() - t0 < wait:
        if p.poll() is not None:
            print(f"bare engine exited with {p.returncode}", flush=True)
            os.system(f"tail -60 {LOG}/bare.log")
            return 1
        if get(f"http://127.0.0.1:{BARE_PORT}/health") == 200:
            dt = time.time() - t0
            print(f"bare engine healthy after {dt:.1f}s", flush=True)
            (VF / "bare.json").write_text(
                json.dumps({"pid": p.pid, "argv": argv, "started_at": t0, "healthy_after_s": round(dt, 1)})
            )
            for line in (LOG / "bare.log").read_text(errors="replace").splitlines():
                if KV_RE.search(line):
                    print(line[:300])
            return 0
        time.sleep(1)
    print("bare engine not healthy in time", flush=True)
    os.system(f"tail -40 {LOG}/bare.log")
    return 1


def proc_env(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(x.split("=", 1) for x in raw.decode(errors="replace").split("\0") if "=" in x)


def proc_name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:160]
    except OSError:
        return "?"


def session_pids(sid: int) -> list[int]:
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if os.getsid(int(d.name)) == sid:
                    pids.append(int(d.name))
            except OSError:
                pass
    return sorted(pids)


def gpu_processes() -> list[dict[str, Any]]:
    r = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid,process_name,used_memory,gpu_uuid", "--format=csv,noheader"],
        text=True,
        capture_output=True,
    )
    rows = []
    for line in r.stdout.strip().splitlines():
        f = [x.strip() for x in line.split(",")]
        if len(f) >= 3 and f[0].isdigit():
            pid = int(f[0])
            env = proc_env(pid)
            rows.append(
                {
                    "pid": pid,
                    "name": f[1],
                    "used_memory": f[2],
                    "gpu_uuid": f[3] if len(f) > 3 else "",
                    "session": os.getsid(pid) if Path(f"/proc/{pid}").exists() else None,
                    "cmdline": proc_name(pid),
                    "CUDA_VISIBLE_DEVICES": env.get("CUDA_VISIBLE_DEVICES"),
                }
            )
    return rows


def kv_lines(path: Path) -> list[str]:
    if not path.exists():
        return []
    return [ln[:300] for ln in path.read_text(errors="replace").splitlines() if KV_RE.search(ln)][:80]


def kv_tokens(lines: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for ln in lines:
        m = re.search(r"GPU KV cache size: ([\d,]+) tokens", ln)
        if m:
            out["gpu_kv_cache_tokens"] = int(m.group(1).replace(",", ""))
        m = re.search(r"Available KV cache memory: ([\d.]+) GiB", ln)
        if m:
            out["available_kv_cache_gib"] = float(m.group(1))
        m = re.search(r"Maximum concurrency for ([\d,]+) tokens per request: ([\d.]+)x", ln)
        if m:
            out["max_concurrency_at_len"] = [int(m.group(1).replace(",", "")), float(m.group(2))]
        m = re.search(r"Model loading took ([\d.]+) GiB", ln)
        if m:
            out["model_loading_gib"] = float(m.group(1))
    return out


def bench(out: Path, name: str, profile: str, *extra: str, timeout: float = 400) -> dict[str, Any]:
    args = [
        "bench",
        "--profile",
        str(REPO / "tools/gpu-validate" / profile),
        "--out",
        str(out),
        "--name",
        name,
    ]
    args += [
        "--no-plot",
        "--quiet",
        "--no-metrics",
        "--tokenize-url",
        f"http://127.0.0.1:{BARE_PORT}/tokenize",
    ]
    t = time.time()
    r = vf_cli(*args, *extra, timeout=timeout)
    print(r.stdout[-3000:], r.stderr[-1500:], flush=True)
    files = sorted(out.glob(f"{name}*.json"))
    rep = json.loads(files[-1].read_text()) if files else {}
    return {
        "rc": r.returncode,
        "seconds": round(time.time() - t, 1),
        "files": [f.name for f in files],
        "report": rep,
    }


def measure(out: Path) -> int:
    from vllm_fleet.devtools import gateway_nginx
    from vllm_fleet.host.notify import NotifyListener

    out.mkdir(parents=True, exist_ok=True)
    LOG.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    bare = json.loads((VF / "bare.json").read_text())
    res["bare"] = {"pid": bare["pid"], "healthy_after_s": bare.get("healthy_after_s"), "argv": bare["argv"]}
    if get(f"http://127.0.0.1:{BARE_PORT}/health") != 200:
        print("bare engine is not up", flush=True)
        return 1
    cfg = render()
    res["instance_config"] = {k: cfg[k] for k in ("command", "environment", "gpus", "service")}
    plan = vf_cli("plan", str(SPEC), "--json", *LAB)
    res["plan"] = json.loads(plan.stdout) if plan.stdout.strip().startswith("{") else plan.stdout
    res["plan_text"] = vf_cli("plan", str(SPEC), *LAB).stdout

    # --- the launcher, with a NOTIFY_SOCKET we own (what systemd would give it)
    sock = str(VF / "notify.sock")
    with __import__("contextlib").suppress(OSError):
        os.unlink(sock)
    lis = NotifyListener(sock)
    env = dict(os.environ, NOTIFY_SOCKET=sock, WATCHDOG_USEC="60000000")
    t0 = time.monotonic()
    llog = (LOG / "launcher.log").open("wb")
    lp = subprocess.Popen(
        [PY, "-m", "vllm_fleet.host.launcher", NAME, "--config-dir", str(VF / "etc")],
        env=env,
        cwd=REPO,
        stdout=llog,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    ready_s = None
    try:
        lis.wait_for("READY", "1", timeout=420)
        ready_s = round(lis.messages[lis.wait_for("READY", "1", timeout=1)][0] - t0, 2)
        print(f"launcher READY=1 after {ready_s}s", flush=True)
    except TimeoutError:
        print("launcher: no READY=1", flush=True)
    res["ready_seconds"] = ready_s
    res["launcher_rc_before_bench"] = lp.poll()
    state = VF / "run" / f"{NAME}.json"
    res["state_file"] = None
    for _ in range(20):  # the launcher writes the state file just after READY=1
        res["state_file"] = json.loads(state.read_text()) if state.exists() else None
        if (res["state_file"] or {}).get("state") != "loading":
            break
        time.sleep(0.25)

    # --- pinning and per-process GPU memory (both engines on the one GPU)
    res["nvidia_smi_apps"] = gpu_processes()
    res["nvidia_smi"] = subprocess.run(["nvidia-smi"], text=True, capture_output=True).stdout
    eng = (res["state_file"] or {}).get("engine_pid")
    if eng:
        res["launcher_engine_session"] = [
            {"pid": p, "cmd": proc_name(p), "CUDA_VISIBLE_DEVICES": proc_env(p).get("CUDA_VISIBLE_DEVICES")}
            for p in session_pids(os.getsid(eng))
        ]

    gw = None
    if ready_s is not None:
        # --- the gateway: Debian's nginx + njs unpacked under /root/vf/nginx
        gateway_nginx.NGINX = str(VF / "nginx/usr/sbin/nginx")
        gateway_nginx.JS_MODULE = str(VF / "nginx/usr/lib/nginx/modules/ngx_http_js_module.so")
        gw = gateway_nginx.NginxGateway(VF / "render/h200/etc/nginx", VF / "nginx-prefix", workers=4)
        chk = gw.check()
        res["nginx_check"] = {"rc": chk.returncode, "stderr": chk.stderr[-800:]}
        try:
            gw.start(health_url=f"http://127.0.0.1:{GW_PORT}/v1/models", timeout=15)
            res["gateway"] = "up"
        except (RuntimeError, TimeoutError) as exc:
            res["gateway"] = f"failed: {exc}"
            gw = None
        b_url = f"http://127.0.0.1:{GW_PORT}" if gw else f"http://127.0.0.1:{INST_PORT}"
        res["compare_b"] = "launcher + gateway" if gw else "launcher only (gateway failed)"
        a_url = f"http://127.0.0.1:{BARE_PORT}"
        rounds = os.environ.get("VF_ROUNDS", "3")
        rdur = os.environ.get("VF_ROUND_S", "20")
        res["compare"] = bench(
            out,
            "compare",
            "bench-gpu.yml",
            "--compare",
            a_url,
            b_url,
            "--rounds",
            rounds,
            "--round-duration",
            rdur,
        )
        res["batch1"] = bench(
            out, "batch1", "batch1.yml", "--compare", a_url, b_url, "--rounds", "2", "--round-duration", "10"
        )
        res["nvidia_smi_after"] = subprocess.run(["nvidia-smi"], text=True, capture_output=True).stdout

    # --- stop: SIGTERM to the launcher (what systemctl stop does), record STOPPING and exit code
    n_before = len(lis.messages)
    rc, took = stop_launcher(lp, 60)
    res["stop"] = {"rc": rc, "seconds": took, "messages": len(lis.messages) - n_before}
    if gw:
        gw.stop()
    with __import__("contextlib").suppress(ProcessLookupError):
        os.killpg(bare["pid"], signal.SIGTERM)
    res["notify"] = [{"t": round(t - t0, 3), **f} for t, f in lis.messages]
    lis.close()
    res["phases_seen"] = []
    for m in res["notify"]:
        st = m.get("STATUS", "")
        mm = re.match(r"Loading \S+: (.+) \(\d+s elapsed\)", st)
        if mm and (not res["phases_seen"] or res["phases_seen"][-1]["phase"] != mm.group(1)):
            res["phases_seen"].append({"t": m["t"], "phase": mm.group(1)})
    res["kv_launcher"] = kv_lines(LOG / "launcher.log")
    res["kv_bare"] = kv_lines(LOG / "bare.log")
    res["kv_launcher_parsed"] = kv_tokens(res["kv_launcher"])
    res["kv_bare_parsed"] = kv_tokens(res["kv_bare"])
    (out / "results.json").write_text(json.dumps(res, indent=2, default=str))
    for f in ("launcher.log", "bare.log"):
        p = LOG / f
        if p.exists():
            lines = p.read_text(errors="replace").splitlines()
            (out / f).write_text("\n".join([*lines[:400], "...", *lines[-200:]]) + "\n")
    summary(res)
    return 0


def summary(res: dict[str, Any]) -> None:
    print("=== summary")
    print(
        "READY after",
        res.get("ready_seconds"),
        "s; phases:",
        [p["phase"] for p in res.get("phases_seen", [])],
    )
    print("KV launcher:", res.get("kv_launcher_parsed"), "bare:", res.get("kv_bare_parsed"))
    for k in ("compare", "batch1"):
        rep = (res.get(k) or {}).get("report") or {}
        rat = rep.get("ratio_b_over_a", {})
        print(k, {n: (v.get("median"), v.get("min"), v.get("max")) for n, v in rat.items()})
        for r in rep.get("rounds", []):
            f = r["figures"]
            print(
                f"  round {r['round']} {r['label']}: out tok/s {f['output_tokens_per_s']:.0f} "
                f"ttft p50 {f['ttft_p50_ms']} itl p50 {f['itl_p50_ms']} failed {f['failed']}"
            )
    print("stop", res.get("stop"))
    print(
        "gpu apps",
        [(a["pid"], a["used_memory"], a["CUDA_VISIBLE_DEVICES"]) for a in res.get("nvidia_smi_apps", [])],
    )


if __name__ == "__main__":
    if sys.argv[1] == "start-bare":
        sys.exit(start_bare(float(sys.argv[2]) if len(sys.argv) > 2 else 500))
    sys.exit(measure(Path(sys.argv[2])))
