"""Device side of the GPU validation (run by run-device.sh on the H200 machine; see docs/gpu-validation.md).

  measure.py start-bare   start a bare ``vllm serve`` (same argv as the rendered instance, port 8001) in its
                          own session, so it outlives this call; wait until /health is 200
  measure.py measure OUT  the launcher instance (port 8002) under a NOTIFY_SOCKET we own, nginx gateway
                          (port 8000) in front, nvidia-smi, bench compare (bare vs launcher + gateway) at
                          load and at batch 1, KV lines from both engines' logs, clean stop; results to OUT

Everything lives under /root/vf (the spec tools/gpu-validate/h200.yml points there).
"""

from __future__ import annotations

import contextlib
import grp
import json
import os
import re
import resource
import secrets
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


def render_instance(spec: Path, out: Path, install: bool = True) -> dict[str, Any]:
    """``vllm-fleet render SPEC --out OUT`` (the lab's flags, OUT emptied first); with ``install`` the instance
    file the launcher reads goes to VF/etc/instances. The rendered instance config (command, environment …)."""
    shutil.rmtree(out, ignore_errors=True)
    r = vf_cli("render", str(spec), "--out", str(out), *LAB)
    if r.returncode:
        raise SystemExit(f"render failed: {r.stdout}{r.stderr}")
    inst = out / "h200" / str(VF).lstrip("/") / "etc/instances" / f"{NAME}.json"
    if install:
        (VF / "etc/instances").mkdir(parents=True, exist_ok=True)
        shutil.copy(inst, VF / "etc/instances" / f"{NAME}.json")
    return dict(json.loads(inst.read_text()))


def render() -> dict[str, Any]:
    return render_instance(SPEC, VF / "render")


def start_launcher(tag: str, watchdog_s: float) -> tuple[subprocess.Popen[bytes], Any, float]:
    """The launcher of the installed instance as systemd starts it: a NOTIFY_SOCKET we own
    (``vllm_fleet.host.notify.NotifyListener`` on VF/notify-TAG.sock) and WATCHDOG_USEC, in its own session,
    its output in LOG/launcher-TAG.log. (the process, the listener, its start on the monotonic clock)"""
    from vllm_fleet.host.notify import NotifyListener

    LOG.mkdir(parents=True, exist_ok=True)
    sock = str(VF / f"notify-{tag}.sock")
    with contextlib.suppress(OSError):
        os.unlink(sock)
    lis = NotifyListener(sock)
    env = dict(os.environ, NOTIFY_SOCKET=sock, WATCHDOG_USEC=str(int(watchdog_s * 1e6)))
    t0 = time.monotonic()
    lp = subprocess.Popen(
        [PY, "-m", "vllm_fleet.host.launcher", NAME, "--config-dir", str(VF / "etc")],
        env=env, cwd=REPO, stdout=(LOG / f"launcher-{tag}.log").open("wb"), stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip
    return lp, lis, t0


def wait_ready(lis: Any, t0: float, tag: str) -> float | None:
    """Seconds from the launcher's start to its READY=1 (VF_READY_TIMEOUT, 420 s by default), or None after
    printing the tail of LOG/launcher-TAG.log when it did not come."""
    try:
        i = lis.wait_for("READY", "1", timeout=float(os.environ.get("VF_READY_TIMEOUT", "420")))
    except TimeoutError:
        print("no READY=1", flush=True)
        os.system(f"tail -60 {LOG}/launcher-{tag}.log")
        return None
    return round(lis.messages[i][0] - t0, 2)


def keep_logs(names: tuple[str, ...], out: Path, head: int = 150, tail: int = 250) -> None:
    """Copy each of LOG/NAME that exists to OUT/NAME, its first ``head`` and last ``tail`` lines."""
    for f in names:
        p = LOG / f
        if p.exists():
            lines = p.read_text(errors="replace").splitlines()
            (out / f).write_text("\n".join([*lines[:head], "...", *lines[-tail:]]) + "\n")


# The gateway under 2,000 lanes: each request holds a client connection, an upstream one and (while it is
# admitted) one to the admission service, spread over GW_WORKERS workers; the workers' open-file limit covers them
GW_WORKERS = 4
GW_WORKER_CONNECTIONS = 16384
GW_NOFILE = 65536
LAB_CLIENT = "lab"


def raise_nofile() -> tuple[int, int]:
    """RLIMIT_NOFILE to its hard limit (inherited by what we start: the admission service, the clients' side);
    the limits before."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return soft, hard


def key_file_includes(conf: Path) -> list[str]:
    """The absolute paths the rendered gateway config includes outside its own folder (the API key file)."""
    return re.findall(r"^\s*include\s+(/\S+);", conf.read_text(), re.M)


class LabGateway:
    """The rendered gateway as the gateway host runs it: the API key file it includes (one generated key, client
    ``lab``), the admission service on the rendered admission.json (``vllm-fleet admission``; its sockets under
    the spec's gateway.limits.runtime_dir), then nginx (Debian's, unpacked under /root/vf/nginx) on the rendered
    conf. ``key`` is sent with every request through it. ``host_root``: the render's host folder (OUT/h200);
    ``vf``: the lab's root (the live admission.json goes to VF/etc/gateway); ``nginx_root``: where nginx's
    Debian files are (usr/sbin/nginx, usr/lib/nginx/modules; None: VF/nginx, the unpacked packages; ``/``: the
    machine's own nginx, for lora_fleet.py --local)."""

    def __init__(
        self, host_root: Path, prefix: Path, log: Path, vf: Path = VF, nginx_root: Path | None = None
    ) -> None:
        from vllm_fleet.devtools import gateway_nginx

        self.host_root, self.prefix, self.log = host_root, prefix, log
        conf = host_root / "etc/nginx/conf.d/vllm-fleet.conf"
        self.info: dict[str, Any] = {"includes": key_file_includes(conf)}
        self.key = "sk-lab-" + secrets.token_hex(24)
        for path in self.info["includes"]:  # the key file: an nginx map fragment `"KEY" CLIENT;`
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(f'"{self.key}" {LAB_CLIENT};\n')
            os.chmod(path, 0o600)  # nginx's workers run as root here (NginxGateway: `user root`)
        rendered = next(host_root.glob("**/etc/gateway/admission.json"), None)
        self.admission_cfg: dict[str, Any] = json.loads(rendered.read_text()) if rendered else {}
        self.admission: subprocess.Popen[bytes] | None = None
        if rendered:
            cfg = dict(self.admission_cfg)
            try:
                grp.getgrnam(cfg.get("socket_group") or "root")
            except KeyError:  # no www-data group on this machine: the sockets keep root's group
                self.info["socket_group_missing"] = cfg["socket_group"]
                cfg["socket_group"] = ""
            live = vf / "etc/gateway/admission.json"
            live.parent.mkdir(parents=True, exist_ok=True)
            live.write_text(json.dumps(cfg, indent=2))
            self.admission_path = live
            for s in (cfg["socket"], cfg["log_socket"]):
                Path(s).parent.mkdir(parents=True, exist_ok=True)
        nginx_root = vf / "nginx" if nginx_root is None else nginx_root
        gateway_nginx.NGINX = str(nginx_root / "usr/sbin/nginx")
        gateway_nginx.JS_MODULE = str(nginx_root / "usr/lib/nginx/modules/ngx_http_js_module.so")
        self.nginx = gateway_nginx.NginxGateway(
            host_root / "etc/nginx",
            prefix,
            workers=GW_WORKERS,
            worker_connections=GW_WORKER_CONNECTIONS,
            rlimit_nofile=GW_NOFILE,
        )
        self.info.update(
            nginx=gateway_nginx.NGINX,
            workers=GW_WORKERS,
            worker_connections=GW_WORKER_CONNECTIONS,
            worker_rlimit_nofile=GW_NOFILE,
            admission_socket=self.admission_cfg.get("socket"),
        )

    @property
    def admission_metrics_url(self) -> str:
        return f"http://{self.admission_cfg.get('metrics_address', '127.0.0.1:9402')}/metrics"

    def start(self, port: int, timeout: float = 15) -> None:
        """Admission service (until its metrics answer), ``nginx -t``, nginx (until /health answers)."""
        if self.admission_cfg:
            code = "import sys; from vllm_fleet.cli import main; sys.exit(main())"
            self.admission = subprocess.Popen(
                [PY, "-c", code, "admission", "--config", str(self.admission_path)],
                cwd=REPO,
                stdout=self.log.open("ab"),
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            deadline = time.monotonic() + timeout
            while get(self.admission_metrics_url) != 200:
                if self.admission.poll() is not None or time.monotonic() > deadline:
                    tail = self.log.read_text(errors="replace")[-1500:]
                    raise RuntimeError(f"admission service not up (rc {self.admission.poll()}): {tail}")
                time.sleep(0.1)
            self.info["admission"] = "up"
        chk = self.nginx.check()
        self.info["nginx_check"] = {"rc": chk.returncode, "stderr": chk.stderr[-800:]}
        self.nginx.start(health_url=f"http://127.0.0.1:{port}/health", timeout=timeout)
        self.info["gateway"] = "up"

    def admission_metrics(self) -> str:
        try:
            with urllib.request.urlopen(self.admission_metrics_url, timeout=5) as r:
                return str(r.read().decode())
        except OSError as exc:
            return f"unreachable: {exc}"

    def stop(self) -> None:
        self.nginx.stop()
        if self.admission is not None and self.admission.poll() is None:
            self.admission.terminate()
            try:
                self.admission.wait(10)
            except subprocess.TimeoutExpired:
                self.admission.kill()
                self.admission.wait(5)


def admission_connect_failures(error_log: Path, since: int = 0) -> tuple[int, int]:
    """Failed connects to the admission socket in the gateway's error log after byte ``since`` (each one a
    request admitted by on_failure: open); and the log's size now."""
    if not error_log.exists():
        return 0, 0
    with error_log.open("rb") as f:
        f.seek(since)
        data = f.read().decode(errors="replace")
    n = sum(1 for ln in data.splitlines() if "admit.sock" in ln and "connect()" in ln)
    return n, since + len(data.encode())


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
    from vllm_fleet.host.notify import NotifyListener

    res_nofile = raise_nofile()
    out.mkdir(parents=True, exist_ok=True)
    LOG.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "nofile": res_nofile,
    }
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
    with contextlib.suppress(OSError):
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

    gw: LabGateway | None = None
    if ready_s is not None:
        # --- the gateway: its key file, the admission service, Debian's nginx + njs under /root/vf/nginx
        gw = LabGateway(VF / "render/h200", VF / "nginx-prefix", LOG / "admission.log")
        try:
            gw.start(GW_PORT)
            res["gateway"] = "up"
        except (RuntimeError, TimeoutError) as exc:
            res["gateway"] = f"failed: {exc}"
            gw.stop()
            gw = None
        res["gateway_setup"] = gw.info if gw else None
        b_url = f"http://127.0.0.1:{GW_PORT}" if gw else f"http://127.0.0.1:{INST_PORT}"
        res["compare_b"] = "launcher + gateway" if gw else "launcher only (gateway failed)"
        a_url = f"http://127.0.0.1:{BARE_PORT}"
        rounds = os.environ.get("VF_ROUNDS", "3")
        rdur = os.environ.get("VF_ROUND_S", "20")
        key = ("--api-key", gw.key) if gw else ()
        res["compare"] = bench(
            out,
            "compare",
            "bench-gpu.yml",
            *key,
            "--compare",
            a_url,
            b_url,
            "--rounds",
            rounds,
            "--round-duration",
            rdur,
        )
        res["batch1"] = bench(
            out,
            "batch1",
            "batch1.yml",
            *key,
            "--compare",
            a_url,
            b_url,
            "--rounds",
            "2",
            "--round-duration",
            "10",
        )
        res["nvidia_smi_after"] = subprocess.run(["nvidia-smi"], text=True, capture_output=True).stdout

    # --- stop: SIGTERM to the launcher (what systemctl stop does), record STOPPING and exit code
    n_before = len(lis.messages)
    rc, took = stop_launcher(lp, 60)
    res["stop"] = {"rc": rc, "seconds": took, "messages": len(lis.messages) - n_before}
    if gw:
        gw.stop()
    with contextlib.suppress(ProcessLookupError):
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
    keep_logs(("launcher.log", "bare.log"), out, head=400, tail=200)
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
