"""Device side: the launcher + vLLM under the rendered gpu unit's sandbox (unit_sandbox.py), TP=1.

    python tools/gpu-validate/sandbox_run.py RENDERED RULES OUT [--allow SYSCALL ...] [--no-notify]

RENDERED is `vllm-fleet render tools/gpu-validate/h200-unit.yml --lock-dir "" --allow-unchecked-flags` (the lab
flags of measure.py; made where systemd-analyze is, with RULES from unit_rules.py). Lays out the production
paths (/opt/vllm-fleet, /etc/vllm-fleet, /var/lib/vllm-fleet,
/run/vllm-fleet, user vllm) from the carried bundle (run-device.sh install with SITE=/opt/vllm-fleet/site),
binds a NOTIFY_SOCKET the way systemd does, runs the unit's ExecStart under the sandbox, waits for READY=1,
serves requests (completion, chat stream, 64 concurrent), reads every engine process's
Uid/CapEff/CapBnd/NoNewPrivs/Seccomp from /proc, stops with SIGTERM; results to OUT.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO))
PREFIX = Path("/opt/vllm-fleet")
SITE = PREFIX / "site"
NAME, PORT = "qwen3-8b", 8002


def sh(*a: str) -> str:
    r = subprocess.run(list(a), text=True, capture_output=True)
    return (r.stdout + r.stderr).strip()


def layout(rendered: Path) -> None:
    import ctypes.util

    debs = sorted(rendered.parent.glob("libseccomp2_*.deb"))
    if not ctypes.util.find_library("seccomp") and debs:  # Debian 12's libseccomp2, carried
        subprocess.run(["dpkg", "-x", str(debs[-1]), str(PREFIX / "libseccomp")], check=True)
    if not any(p.pw_name == "vllm" for p in pwd.getpwall()):
        subprocess.run(["useradd", "--system", "--user-group", "--no-create-home", "vllm"], check=True)
    etc = rendered / "h200/etc"
    shutil.rmtree("/etc/vllm-fleet", ignore_errors=True)
    shutil.copytree(etc / "vllm-fleet", "/etc/vllm-fleet")
    src = PREFIX / "src"
    shutil.rmtree(src, ignore_errors=True)
    shutil.copytree(REPO / "vllm_fleet", src / "vllm_fleet", ignore=shutil.ignore_patterns("__pycache__"))
    (PREFIX / "venv/bin").mkdir(parents=True, exist_ok=True)
    py = sys.executable
    (PREFIX / "venv/bin/python").write_text(f'#!/bin/sh\nexec {py} "$@"\n')
    (PREFIX / "venv/bin/vllm").write_text(
        f"#!{py}\nimport sys\nif __name__ == '__main__':\n    from vllm.entrypoints.cli.main import main\n"
        "    sys.argv[0] = 'vllm'\n    sys.exit(main())\n"
    )
    for f in ("python", "vllm"):
        (PREFIX / "venv/bin" / f).chmod(0o755)
    # the carried vLLM and vllm_fleet on the image python's path (a .pth: the unit sets no PYTHONPATH)
    sp = subprocess.run(
        [py, "-c", "import site; print(site.getsitepackages()[0])"], text=True, capture_output=True
    )
    Path(sp.stdout.strip(), "zz-vllm-fleet.pth").write_text(f"{SITE}\n{src}\n")
    models = Path("/var/lib/vllm-fleet/models")
    if not (models / NAME / "config.json").exists():
        models.mkdir(parents=True, exist_ok=True)
        shutil.copytree("/root/vf/b/model", models / NAME)
    subprocess.run(
        ["chmod", "-R", "a+rX", str(PREFIX), "/var/lib/vllm-fleet/models", "/etc/vllm-fleet"], check=True
    )
    for d in ("/var/lib/vllm-fleet/cache", "/run/vllm-fleet"):  # StateDirectory= / RuntimeDirectory=
        Path(d).mkdir(parents=True, exist_ok=True)
        shutil.chown(d, "vllm", "vllm")
    os.chmod("/var/lib/vllm-fleet/cache", 0o750)


def post(path: str, body: dict[str, Any], timeout: float = 60) -> tuple[int, str]:
    req = urllib.request.Request(
        f"http://127.0.0.1:{PORT}{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return int(r.status), r.read().decode(errors="replace")
    except OSError as e:
        return 0, str(e)


def proc_facts() -> list[dict[str, Any]]:
    uid = pwd.getpwnam("vllm").pw_uid
    rows = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            st = (d / "status").read_text()
        except OSError:
            continue
        f = dict(line.split(":\t", 1) for line in st.splitlines() if ":\t" in line)
        if int(f.get("Uid", "0").split()[0]) != uid:
            continue
        rows.append(
            {
                "pid": int(d.name),
                "cmd": (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:120],
                **{
                    k: f.get(k, "").strip()
                    for k in ("Uid", "CapEff", "CapBnd", "CapAmb", "NoNewPrivs", "Seccomp")
                },
                "Seccomp_filters": f.get("Seccomp_filters", "").strip(),
            }
        )
    return rows


def run(
    rendered: Path, rules: Path, out: Path, allow: list[str], no_notify: bool, tag: str
) -> dict[str, Any]:
    from vllm_fleet.host.notify import NotifyListener

    res: dict[str, Any] = {"tag": tag, "allow": allow}
    ndir = Path("/run/vf-notify")
    ndir.mkdir(exist_ok=True)
    ndir.chmod(0o755)
    sock = ndir / "notify.sock"
    if sock.exists():
        sock.unlink()
    lis = NotifyListener(str(sock))
    sock.chmod(0o666)
    r = json.loads(rules.read_text())
    cmd = [
        sys.executable,
        str(HERE / "unit_sandbox.py"),
        "--rules",
        str(rules),
        "--user",
        r["user"],
        "--denied-log",
        str(out / f"denied-{tag}.jsonl"),
        "--counts",
        str(out / f"counts-{tag}.json"),
        "--env",
        f"NOTIFY_SOCKET={sock}",
        "--env",
        "WATCHDOG_USEC=60000000",
    ]
    for p in r["read_write_paths"]:
        cmd += ["--rw", p]
    for a in allow:
        cmd += ["--allow", a]
    if no_notify:
        cmd.append("--no-notify")
    cmd += ["--", *r["exec_start"].replace("%i", NAME).split()]
    res["cmd"] = cmd
    env = {
        k: v
        for k, v in os.environ.items()
        if k in ("PATH", "LANG", "NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST")
    }
    env.update(NVSHMEM_DISABLE_NVLS="1", NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1")
    logf = (out / f"launcher-{tag}.log").open("w")
    t0 = time.time()
    p = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    m0 = time.monotonic()
    ready = None
    while time.time() - t0 < 330 and p.poll() is None:
        if lis.values("READY"):
            ready = round(time.time() - t0, 1)
            break
        time.sleep(0.5)
    res["ready_after_s"] = ready
    if ready:
        res["completion"] = post("/v1/completions", {"model": NAME, "prompt": "Hello", "max_tokens": 16})
        res["chat_stream"] = post(
            "/v1/chat/completions",
            {
                "model": NAME,
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 32,
                "stream": True,
            },
        )
        res["chat_stream"] = (res["chat_stream"][0], res["chat_stream"][1][-300:])
        t = time.time()
        with concurrent.futures.ThreadPoolExecutor(64) as ex:
            codes = list(
                ex.map(
                    lambda i: post("/v1/completions", {"model": NAME, "prompt": f"n{i}", "max_tokens": 64})[
                        0
                    ],
                    range(128),
                )
            )
        res["load_128x64"] = {"ok": codes.count(200), "seconds": round(time.time() - t, 2)}
        res["procs"] = proc_facts()
        res["nvidia_smi_apps"] = sh(
            "nvidia-smi", "--query-compute-apps=pid,process_name,used_memory", "--format=csv,noheader"
        )
        time.sleep(12)  # a few liveness probes + WATCHDOG=1 under the filter
    if p.poll() is None:
        os.kill(p.pid, signal.SIGTERM)  # what systemctl stop sends (KillMode=mixed: the main process)
    try:
        res["exit"] = p.wait(timeout=90)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        res["exit"] = f"killed, {p.wait()}"
    time.sleep(0.5)
    msgs = [(round(t - m0, 1), f) for t, f in lis.messages]
    res["notify"] = [(t, {k: v[:150] for k, v in f.items()}) for t, f in msgs if "WATCHDOG" not in f][:40]
    res["watchdog_pings"] = sum("WATCHDOG" in f for _t, f in msgs)
    res["seconds"] = round(time.time() - t0, 1)
    cf = out / f"counts-{tag}.json"
    res["refused"] = json.loads(cf.read_text()).get("refused") if cf.exists() else None
    lis.close()
    return res


PROBE = """import errno, json, os, subprocess
r = {}
for p in ["/dev/nvidia0", "/dev/nvidia1", "/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools",
          "/dev/nvidia-caps/nvidia-cap1", "/dev/nvidia-caps/nvidia-cap2"]:
    try:
        os.close(os.open(p, os.O_RDONLY if "cap" in p else os.O_RDWR)); r[p] = "opened"
    except OSError as e:
        r[p] = errno.errorcode[e.errno]
import torch
a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
r["cuda_matmul"] = float((a @ a).float().abs().mean())
r["cuda_device"] = torch.cuda.get_device_name(0)
n = subprocess.run(["nvidia-smi", "--query-gpu=index,name,memory.used", "--format=csv,noheader"],
                   capture_output=True, text=True)
r["nvidia_smi"] = (n.returncode, n.stdout.strip(), n.stderr.strip()[-300:])
r["cgroup"] = open("/proc/self/cgroup").read().strip()
print("PROBE " + json.dumps(r))
"""


def probe(rules: Path, out: Path) -> dict[str, Any]:
    """Open each node and run CUDA + NVML under the unit's sandbox (its device program among the rest)."""
    (PREFIX / "probe.py").write_text(PROBE)
    r = json.loads(rules.read_text())
    cmd = [sys.executable, str(HERE / "unit_sandbox.py"), "--rules", str(rules), "--user", r["user"]]
    cmd += ["--denied-log", str(out / "denied-probe.jsonl"), "--", str(PREFIX / "venv/bin/python")]
    cmd.append(str(PREFIX / "probe.py"))
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    (out / "probe.log").write_text(p.stdout + p.stderr)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("PROBE ")]
    return json.loads(lines[-1][6:]) if lines else {"rc": p.returncode, "tail": (p.stdout + p.stderr)[-1500:]}


def main() -> int:
    rendered, rules, out = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    allow = [a for i, a in enumerate(sys.argv) if i > 0 and sys.argv[i - 1] == "--allow"]
    out.mkdir(parents=True, exist_ok=True)
    facts: dict[str, Any] = {
        "proc_devices": Path("/proc/devices").read_text(),
        "dev_nvidia": sh("sh", "-c", "ls -l /dev/nvidia* /dev/nvidia-caps 2>&1"),
        "kernel": os.uname().release,
        "nvidia_smi": sh(
            "nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"
        ),
        "minor": sh("sh", "-c", "grep -H 'Device Minor' /proc/driver/nvidia/gpus/*/information"),
    }
    layout(rendered)
    if not Path("/dev/nvidia1").exists():  # another instance's GPU: a node with no GPU behind it (minor 1)
        os.mknod("/dev/nvidia1", 0o666 | 0o020000, os.makedev(195, 1))
        os.chmod("/dev/nvidia1", 0o666)
    facts["probe"] = probe(rules, out)
    print("probe", json.dumps(facts["probe"])[:1500], flush=True)
    results = [run(rendered, rules, out, allow, "--no-notify" in sys.argv, "full")]
    if not results[0]["ready_after_s"] and results[0]["refused"]:
        # find out whether a refused syscall is the cause: allow exactly those, once
        results.append(run(rendered, rules, out, [*allow, *results[0]["refused"]], False, "loosened"))
    (out / "results.json").write_text(json.dumps({"facts": facts, "runs": results}, indent=1, default=str))
    for r in results:
        print(
            r["tag"], "ready", r["ready_after_s"], "exit", r["exit"], "refused", r["refused"],
            "completion", r.get("completion", ("-",))[0], "load", r.get("load_128x64"), flush=True,
        )  # fmt: skip
    return 0 if results[0]["ready_after_s"] else 1


if __name__ == "__main__":
    sys.exit(main())
