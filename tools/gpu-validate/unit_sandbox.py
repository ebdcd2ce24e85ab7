"""Run a command under the gpu unit's sandbox on a machine without systemd (the H200 machine).

    python unit_sandbox.py --rules rules.json --user vllm --rw DIR ... [--allow SYSCALL ...]
                           [--denied-log FILE] -- COMMAND ...

Must start as root. ``rules.json`` comes from unit_rules.py (the rendered unit's directives). What it does,
in the order systemd's exec step does it (src/core/execute.c), each the way systemd implements it:

- a private mount namespace: ProtectSystem=strict (every mount read-only except /dev, /proc, /sys and the
  ``--rw`` paths, which stand for ReadWritePaths=/StateDirectory=/RuntimeDirectory=), ProtectHome=yes (/home,
  /root, /run/user inaccessible), PrivateTmp=yes (fresh /tmp and /var/tmp), ProtectProc=invisible (a new proc
  instance with hidepid=invisible), ProtectKernelTunables/ProtectControlGroups (/proc/sys, /sys read-only);
- DevicePolicy=closed + DeviceAllow= the way systemd does it on cgroup v2 (bpf-devices.c): a
  BPF_PROG_TYPE_CGROUP_DEVICE program attached to a cgroup of the command's own, allowing the closed
  policy's nodes (/dev/null, zero, full, random, urandom, tty, ptmx, char-pts) and each DeviceAllow= entry (a
  path: its major:minor; char-GROUP: the majors /proc/devices lists for it) with its access bits; any other
  device open or mknod gets EPERM. With no cgroup2 mount (or --private-dev): a private /dev holding only
  the allowed nodes instead (a denied node is then absent, ENOENT, rather than refused);
- UMask=, LimitNOFILE=, LimitMEMLOCK=, User= (no supplementary groups), CapabilityBoundingSet= (empty: all
  dropped, ambient cleared), NoNewPrivileges=yes;
- seccomp through libseccomp (what systemd links): the deny filters of ProtectKernelModules/ProtectClock/
  ProtectKernelLogs/ProtectHostname (EPERM), RestrictAddressFamilies= (socket() of another family:
  EAFNOSUPPORT), RestrictNamespaces=yes (setns, and clone/unshare with a CLONE_NEW* flag: EPERM; clone3:
  ENOSYS, so glibc falls back to clone), LockPersonality=yes, RestrictRealtime=yes, RestrictSUIDSGID=yes,
  and last the SystemCallFilter= allow-list with SystemCallErrorNumber= for everything else.

The allow-list's refusals go through a seccomp user-notification listener in this (unfiltered) parent,
which answers each with the same errno (-EPERM) and records the syscall, its arguments and the process:
the engine sees exactly what the unit's filter returns, and the log says which rule it hit.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import errno
import glob
import json
import os
import resource
import signal
import socket
import stat
import sys
import threading
import time
from pathlib import Path
from typing import Any

# ---------------------------------------------------------------- libseccomp (ctypes; no Python bindings needed)
SCMP_ACT_KILL_PROCESS = 0x80000000
SCMP_ACT_NOTIFY = 0x7FC00000
SCMP_ACT_ALLOW = 0x7FFF0000


def SCMP_ACT_ERRNO(e: int) -> int:
    return 0x00050000 | (e & 0xFFFF)


SCMP_CMP_NE, SCMP_CMP_EQ, SCMP_CMP_MASKED_EQ = 1, 4, 7


class ArgCmp(ctypes.Structure):
    _fields_ = [
        ("arg", ctypes.c_uint),
        ("op", ctypes.c_int),
        ("datum_a", ctypes.c_uint64),
        ("datum_b", ctypes.c_uint64),
    ]


class SeccompData(ctypes.Structure):
    _fields_ = [
        ("nr", ctypes.c_int),
        ("arch", ctypes.c_uint32),
        ("ip", ctypes.c_uint64),
        ("args", ctypes.c_uint64 * 6),
    ]


class Notif(ctypes.Structure):
    _fields_ = [
        ("id", ctypes.c_uint64),
        ("pid", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("data", SeccompData),
    ]


class NotifResp(ctypes.Structure):
    _fields_ = [
        ("id", ctypes.c_uint64),
        ("val", ctypes.c_int64),
        ("error", ctypes.c_int32),
        ("flags", ctypes.c_uint32),
    ]


def load_libseccomp() -> ctypes.CDLL:
    for cand in [
        ctypes.util.find_library("seccomp"),
        "libseccomp.so.2",
        *glob.glob("/opt/vllm-fleet/libseccomp/usr/lib/*/libseccomp.so.2*"),
    ]:
        if not cand:
            continue
        try:
            lib = ctypes.CDLL(cand, use_errno=True)
            break
        except OSError:
            continue
    else:
        raise SystemExit("libseccomp.so.2 not found")
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_rule_add_array.argtypes = [
        ctypes.c_void_p,
        ctypes.c_uint32,
        ctypes.c_int,
        ctypes.c_uint,
        ctypes.POINTER(ArgCmp),
    ]
    lib.seccomp_load.argtypes = [ctypes.c_void_p]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    lib.seccomp_notify_fd.argtypes = [ctypes.c_void_p]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_syscall_resolve_num_arch.restype = ctypes.c_void_p
    lib.seccomp_syscall_resolve_num_arch.argtypes = [ctypes.c_uint32, ctypes.c_int]
    lib.seccomp_notify_receive.argtypes = [ctypes.c_int, ctypes.POINTER(Notif)]
    lib.seccomp_notify_respond.argtypes = [ctypes.c_int, ctypes.POINTER(NotifResp)]
    return lib


class Filter:
    def __init__(self, lib: ctypes.CDLL, default: int) -> None:
        self.lib = lib
        self.ctx = lib.seccomp_init(default)
        if not self.ctx:
            raise OSError("seccomp_init failed")

    def nr(self, name: str) -> int:
        return int(self.lib.seccomp_syscall_resolve_name(name.encode()))

    def add(self, action: int, name: str, *cmps: tuple[int, int, int, int]) -> bool:
        nr = self.nr(name)
        if nr < 0:
            return False  # not a syscall of this architecture
        arr = (ArgCmp * max(1, len(cmps)))(*[ArgCmp(*c) for c in cmps])
        r = self.lib.seccomp_rule_add_array(self.ctx, action, nr, len(cmps), arr)
        if r < 0 and r != -errno.EEXIST:
            raise OSError(-r, f"seccomp_rule_add {name} {cmps}: {os.strerror(-r)}")
        return True

    def load(self) -> None:
        r = self.lib.seccomp_load(self.ctx)
        if r < 0:
            raise OSError(-r, f"seccomp_load: {os.strerror(-r)}")


AF = {"AF_UNIX": 1, "AF_LOCAL": 1, "AF_INET": 2, "AF_INET6": 10, "AF_NETLINK": 16, "AF_PACKET": 17}
CLONE_NEW = {
    "cgroup": 0x02000000,
    "ipc": 0x08000000,
    "net": 0x40000000,
    "mnt": 0x00020000,
    "pid": 0x20000000,
    "user": 0x10000000,
    "uts": 0x04000000,
    "time": 0x00000080,
}


def seccomp_filters(
    lib: ctypes.CDLL, r: dict[str, Any], extra_allow: list[str], notify: bool
) -> Filter | None:
    """Load every filter of the unit; return the allow-list filter (its notify fd) when ``notify``."""
    eperm = SCMP_ACT_ERRNO(errno.EPERM)
    for names in r["extra_deny"].values():
        f = Filter(lib, SCMP_ACT_ALLOW)
        for n in names:
            if n not in extra_allow:
                f.add(eperm, n)
        f.load()
    fams = sorted({AF[a] for a in r["address_families"]})
    if fams:
        f = Filter(lib, SCMP_ACT_ALLOW)
        eaf = SCMP_ACT_ERRNO(errno.EAFNOSUPPORT)
        f.add(eaf, "socket", (0, 2, fams[0], 0))  # SCMP_CMP_LT
        f.add(eaf, "socket", (0, 6, fams[-1], 0))  # SCMP_CMP_GT
        for af in range(fams[0] + 1, fams[-1]):
            if af not in fams:
                f.add(eaf, "socket", (0, SCMP_CMP_EQ, af, 0))
        f.load()
    if r["restrict_namespaces"]:
        f = Filter(lib, SCMP_ACT_ALLOW)
        f.add(eperm, "setns")
        for flag in CLONE_NEW.values():
            f.add(eperm, "unshare", (0, SCMP_CMP_MASKED_EQ, flag, flag))
            f.add(eperm, "clone", (0, SCMP_CMP_MASKED_EQ, flag, flag))
        f.add(SCMP_ACT_ERRNO(errno.ENOSYS), "clone3")
        f.load()
    if r["lock_personality"]:
        f = Filter(lib, SCMP_ACT_ALLOW)
        f.add(eperm, "personality", (0, SCMP_CMP_NE, 0, 0))  # PER_LINUX
        f.load()
    if r["restrict_realtime"]:
        f = Filter(lib, SCMP_ACT_ALLOW)
        for pol in (1, 2, 6):  # SCHED_FIFO, SCHED_RR, SCHED_DEADLINE
            f.add(eperm, "sched_setscheduler", (1, SCMP_CMP_EQ, pol, 0))
        f.load()
    if r["restrict_suid_sgid"]:
        f = Filter(lib, SCMP_ACT_ALLOW)
        for bit in (0o4000, 0o2000):
            f.add(eperm, "chmod", (1, SCMP_CMP_MASKED_EQ, bit, bit))
            f.add(eperm, "fchmod", (1, SCMP_CMP_MASKED_EQ, bit, bit))
            f.add(eperm, "fchmodat", (2, SCMP_CMP_MASKED_EQ, bit, bit))
            f.add(eperm, "creat", (1, SCMP_CMP_MASKED_EQ, bit, bit))
            f.add(
                eperm,
                "open",
                (1, SCMP_CMP_MASKED_EQ, os.O_CREAT, os.O_CREAT),
                (2, SCMP_CMP_MASKED_EQ, bit, bit),
            )
            f.add(
                eperm,
                "openat",
                (2, SCMP_CMP_MASKED_EQ, os.O_CREAT, os.O_CREAT),
                (3, SCMP_CMP_MASKED_EQ, bit, bit),
            )
        f.load()
    if r["syscall_allow"] is None:
        return None
    err = getattr(errno, r["syscall_errno"])
    f = Filter(lib, SCMP_ACT_NOTIFY if notify else SCMP_ACT_ERRNO(err))
    for n in [*r["syscall_allow"], *extra_allow]:
        f.add(SCMP_ACT_ALLOW, n)
    f.load()
    return f


# ---------------------------------------------------------------- mounts
libc = ctypes.CDLL(None, use_errno=True)
libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
CLONE_NEWNS = 0x00020000


def mount(src: str | None, dst: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    b = lambda s: s.encode() if s is not None else None  # noqa: E731
    if libc.mount(b(src), b(dst), b(fstype), flags, b(data)) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"mount {src} {dst} {fstype} {flags:#x} {data}: {os.strerror(e)}")


def mountpoints() -> list[tuple[str, set[str]]]:
    out = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        f = line.split()
        out.append((f[4].replace("\\040", " "), set(f[5].split(","))))
    return out


def remount_ro(mp: str, opts: set[str]) -> None:
    flags = MS_BIND | MS_REMOUNT | MS_RDONLY
    flags |= (MS_NOSUID if "nosuid" in opts else 0) | (MS_NODEV if "nodev" in opts else 0)
    flags |= MS_NOEXEC if "noexec" in opts else 0
    try:
        mount(None, mp, None, flags)
    except OSError as e:
        print(f"unit_sandbox: cannot make {mp} read-only: {e}", file=sys.stderr)


def under(p: str, roots: tuple[str, ...]) -> bool:
    return any(p == r or p.startswith(r.rstrip("/") + "/") for r in roots)


def proc_devices() -> dict[str, set[int]]:
    out: dict[str, set[int]] = {}
    section = ""
    for line in Path("/proc/devices").read_text().splitlines():
        if line.endswith("devices:"):
            section = line.split()[0].lower()
        elif line.strip() and section == "character":
            major, name = line.split()
            out.setdefault(name, set()).add(int(major))
    return out


def private_dev(allow: list[str]) -> list[str]:
    """A /dev with the closed policy's nodes and the DeviceAllow= ones; returns what it created."""
    import fnmatch

    nodes: list[tuple[str, os.stat_result]] = []
    want = ["/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom", "/dev/tty", "/dev/ptmx"]
    groups = proc_devices()
    majors: set[int] = set()
    for entry in allow:
        a = entry.split()[0]
        if a.startswith("/dev/"):
            want.append(a)
        elif a.startswith("char-"):
            for name, ms in groups.items():
                if fnmatch.fnmatch(name, a[5:]):
                    majors |= ms
    for p in want:
        try:
            nodes.append((p, os.stat(p)))
        except FileNotFoundError:
            print(f"unit_sandbox: DeviceAllow {p}: no such node (skipped, as systemd does)", file=sys.stderr)
    for root, _dirs, files in os.walk("/dev"):
        if under(root, ("/dev/shm", "/dev/pts", "/dev/mqueue", "/dev/hugepages")):
            continue
        for fn in files:
            p = os.path.join(root, fn)
            try:
                st = os.lstat(p)
            except OSError:
                continue
            if stat.S_ISCHR(st.st_mode) and os.major(st.st_rdev) in majors:
                nodes.append((p, st))
    keep = [m for m in ("/dev/shm", "/dev/mqueue", "/dev/hugepages", "/dev/pts") if os.path.isdir(m)]
    stash = "/run/.unit_sandbox_dev"
    os.makedirs(stash, exist_ok=True)
    mount("tmpfs", stash, "tmpfs", MS_NOSUID, "mode=0755")
    for m in keep:
        os.makedirs(stash + m[4:], exist_ok=True)
        mount(m, stash + m[4:], None, MS_BIND | MS_REC)
    made = []
    for p, st in nodes:
        dst = stash + p[4:]
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        os.mknod(dst, st.st_mode, st.st_rdev)
        os.chmod(dst, stat.S_IMODE(st.st_mode))
        os.chown(dst, st.st_uid, st.st_gid)
        made.append(p)
    for name, target in (
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
    ):
        os.symlink(target, f"{stash}/{name}")
    os.symlink("/proc/self/fd/2", f"{stash}/stderr")
    mount(stash, "/dev", None, MS_BIND | MS_REC)
    return made


# ---------------------------------------------------------------- DevicePolicy= on cgroup v2, as systemd does it
# systemd (bpf-devices.c) attaches a BPF_PROG_TYPE_CGROUP_DEVICE program to the unit's cgroup: the closed
# policy's nodes plus each DeviceAllow= entry (a path: its type/major/minor; char-GROUP: every major of that
# /proc/devices group), with the access bits given; anything else -> EPERM from open()/mknod().
BPF_PROG_LOAD, BPF_PROG_ATTACH = 5, 8
BPF_PROG_TYPE_CGROUP_DEVICE, BPF_CGROUP_DEVICE = 15, 6
CLOSED_POLICY = [  # systemd's DevicePolicy=closed set: null zero full random urandom tty ptmx, char-pts
    ("c", 1, 3, "rwm"), ("c", 1, 5, "rwm"), ("c", 1, 7, "rwm"), ("c", 1, 8, "rwm"), ("c", 1, 9, "rwm"),
    ("c", 5, 0, "rwm"), ("c", 5, 2, "rwm"), ("c", 136, -1, "rw"),
]  # fmt: skip


def device_rules(allow: list[str]) -> list[tuple[str, int, int, str]]:
    import fnmatch

    rules = list(CLOSED_POLICY)
    groups = proc_devices()
    for entry in allow:
        spec, _, acc = entry.partition(" ")
        acc = acc or "rwm"
        if spec.startswith("/dev/"):
            try:
                st = os.stat(spec)
            except FileNotFoundError:
                print(
                    f"unit_sandbox: DeviceAllow {spec}: no such node (skipped, as systemd does)",
                    file=sys.stderr,
                )
                continue
            kind = "c" if stat.S_ISCHR(st.st_mode) else "b"
            rules.append((kind, os.major(st.st_rdev), os.minor(st.st_rdev), acc))
        elif spec.startswith("char-"):
            for name, majors in groups.items():
                if fnmatch.fnmatch(name, spec[5:]):
                    rules += [("c", m, -1, acc) for m in sorted(majors)]
    return rules


def _insn(code: int, dst: int = 0, src: int = 0, off: int = 0, imm: int = 0) -> bytes:
    import struct

    return struct.pack("<BBhi", code, (src << 4) | dst, off, imm)


def device_program(rules: list[tuple[str, int, int, str]]) -> bytes:
    ldxw, and_k, rsh_k, jne_k, mov_k, mov_x, exit_ = 0x61, 0x57, 0x77, 0x55, 0xB7, 0xBF, 0x95
    prog = [
        _insn(ldxw, 2, 1, 0),  # r2 = ctx->access_type
        _insn(mov_x, 3, 2),  # r3 = r2
        _insn(and_k, 2, imm=0xFFFF),  # r2 = type (1 block, 2 char)
        _insn(rsh_k, 3, imm=16),  # r3 = access (1 mknod, 2 read, 4 write)
        _insn(ldxw, 4, 1, 4),  # r4 = major
        _insn(ldxw, 5, 1, 8),  # r5 = minor
    ]
    for kind, major, minor, acc in rules:
        bits = (1 if "m" in acc else 0) | (2 if "r" in acc else 0) | (4 if "w" in acc else 0)
        body = [
            _insn(jne_k, 2, off=0, imm=2 if kind == "c" else 1),
            _insn(jne_k, 4, off=0, imm=major),
        ]
        if minor >= 0:
            body.append(_insn(jne_k, 5, off=0, imm=minor))
        body += [
            _insn(mov_x, 6, 3),  # r6 = access
            _insn(and_k, 6, imm=~bits & 0x7),  # bits not granted
            _insn(jne_k, 6, off=0, imm=0),
            _insn(mov_k, 0, imm=1),
            _insn(exit_),
        ]
        # every jne jumps to the next rule (past the rest of this block)
        n = len(body)
        fixed = []
        for i, ins in enumerate(body):
            if ins[0] == jne_k:
                ins = ins[:2] + (n - i - 1).to_bytes(2, "little", signed=True) + ins[4:]
            fixed.append(ins)
        prog += fixed
    prog += [_insn(mov_k, 0, imm=0), _insn(exit_)]
    return b"".join(prog)


def attach_device_program(cgroup: str, rules: list[tuple[str, int, int, str]]) -> None:
    import struct

    code = device_program(rules)
    insns = ctypes.create_string_buffer(code, len(code))
    lic = ctypes.create_string_buffer(b"GPL")
    logbuf = ctypes.create_string_buffer(65536)
    attr = struct.pack(
        "<IIQQIIQI",
        BPF_PROG_TYPE_CGROUP_DEVICE,
        len(code) // 8,
        ctypes.addressof(insns),
        ctypes.addressof(lic),
        1,
        len(logbuf),
        ctypes.addressof(logbuf),
        0,
    ).ljust(128, b"\0")
    buf = ctypes.create_string_buffer(attr, len(attr))
    libc.syscall.restype = ctypes.c_long
    fd = libc.syscall(321, BPF_PROG_LOAD, buf, len(attr))  # __NR_bpf on x86_64
    if fd < 0:
        e = ctypes.get_errno()
        raise OSError(e, f"BPF_PROG_LOAD: {os.strerror(e)}: {logbuf.value.decode(errors='replace')[-500:]}")
    cfd = os.open(cgroup, os.O_RDONLY | os.O_DIRECTORY)
    att = struct.pack("<IIII", cfd, fd, BPF_CGROUP_DEVICE, 0).ljust(64, b"\0")
    abuf = ctypes.create_string_buffer(att, len(att))
    if libc.syscall(321, BPF_PROG_ATTACH, abuf, len(att)) < 0:
        e = ctypes.get_errno()
        raise OSError(e, f"BPF_PROG_ATTACH {cgroup}: {os.strerror(e)}")
    os.close(cfd)


def unified_root() -> str | None:
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        f = line.split()
        if f[f.index("-") + 1] == "cgroup2":
            return f[4]
    return None


def mounts(r: dict[str, Any], rw: list[str]) -> dict[str, Any]:
    done: dict[str, Any] = {}
    if libc.unshare(CLONE_NEWNS) != 0:
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNS)")
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    if r["device_policy"] == "closed" and not r.get("_device_cgroup"):
        done["dev_nodes"] = private_dev(r["device_allow"])
    if r["protect_proc"] in ("invisible", "noaccess", "ptraceable"):
        mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, f"hidepid={r['protect_proc']}")
        done["proc"] = f"hidepid={r['protect_proc']}"
    api = ("/dev", "/proc", "/sys")
    if r["protect_system"] == "strict":
        for d in rw:
            mount(d, d, None, MS_BIND | MS_REC)
        for mp, opts in mountpoints():
            if not under(mp, api) and not under(mp, tuple(rw)) and "ro" not in opts:
                remount_ro(mp, opts)
        for d in rw:
            mount(None, d, None, MS_BIND | MS_REMOUNT)
        done["protect_system"] = "strict"
    if r["private_tmp"]:
        for d in ("/tmp", "/var/tmp"):
            mount("tmpfs", d, "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777")
        done["private_tmp"] = True
    if r["protect_home"] in ("yes", "true"):
        for d in ("/home", "/root", "/run/user"):
            if os.path.isdir(d):
                mount("tmpfs", d, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_RDONLY, "mode=000")
        done["protect_home"] = True
    if r["protect_kernel_tunables"] or r["protect_control_groups"]:
        for mp, opts in mountpoints():
            if under(mp, ("/sys",)) and "ro" not in opts:
                remount_ro(mp, opts)
        if r["protect_kernel_tunables"]:
            for p in ("/proc/sys", "/proc/sysrq-trigger"):
                if not os.path.exists(p):
                    continue
                mount(p, p, None, MS_BIND)
                remount_ro(p, {"nosuid", "nodev", "noexec"})
        done["ro_sys"] = True
    return done


# ---------------------------------------------------------------- the child: sandbox, then exec
def child(args: argparse.Namespace, r: dict[str, Any], sock: socket.socket) -> None:
    try:
        if r.get("_device_cgroup"):  # join the unit's cgroup (its device program) while still root
            Path(r["_device_cgroup"], "cgroup.procs").write_text(str(os.getpid()))
        info = mounts(r, args.rw)
        os.chdir("/")  # WorkingDirectory=/
        os.umask(int(r["umask"], 8))
        lims = []
        if r["limit_nofile"]:
            lims.append((resource.RLIMIT_NOFILE, int(r["limit_nofile"])))
        if r["limit_memlock"] == "infinity":
            lims.append((resource.RLIMIT_MEMLOCK, resource.RLIM_INFINITY))
        for res, n in lims:
            try:
                resource.setrlimit(res, (n, n))
            except (ValueError, OSError) as e:  # a container's hard limit below the unit's
                hard = resource.getrlimit(res)[1]
                resource.setrlimit(res, (hard, hard))
                info.setdefault("rlimit_capped", []).append(f"{res}: {e}, kept {hard}")
        import pwd

        pw = pwd.getpwnam(args.user)
        prctl = libc.prctl
        prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
        if r["capability_bounding_set"] == []:
            for cap in range(64):
                prctl(24, cap, 0, 0, 0)  # PR_CAPBSET_DROP (EINVAL past the last cap)
        os.setgroups([])
        os.setgid(pw.pw_gid)
        os.setuid(pw.pw_uid)  # no SECBIT_KEEP_CAPS: permitted and effective sets are cleared
        prctl(47, 4, 0, 0, 0)  # PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL
        if r["no_new_privileges"] and prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
            raise OSError(ctypes.get_errno(), "PR_SET_NO_NEW_PRIVS")
        env = dict(os.environ)
        for kv in r["environment"]:
            k, v = kv.split("=", 1)
            env[k] = v
        env.update(dict(kv.split("=", 1) for kv in args.env))
        lib = load_libseccomp()
        info["uid"] = pw.pw_uid
        sock.sendall(json.dumps(info).encode() + b"\n")
        f = seccomp_filters(lib, r, args.allow, notify=not args.no_notify)
        if f is not None and not args.no_notify:
            fd = lib.seccomp_notify_fd(f.ctx)
            socket.send_fds(sock, [b"F"], [fd])
            os.close(fd)
        sock.close()
        os.execve(args.command[0], args.command, env)
    except BaseException as e:  # report, then exit like a failed ExecStart
        print(f"unit_sandbox: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        os._exit(226)  # systemd's EXIT_NAMESPACE-style failure before exec


def supervise(lib: ctypes.CDLL, fd: int, log: Path, counts: dict[str, int], errno_value: int) -> None:
    # seccomp_notify_alloc sizes the structs from the kernel and sets libseccomp's notify support state
    lib.seccomp_notify_alloc.argtypes = [
        ctypes.POINTER(ctypes.POINTER(Notif)),
        ctypes.POINTER(ctypes.POINTER(NotifResp)),
    ]
    preq, presp = ctypes.POINTER(Notif)(), ctypes.POINTER(NotifResp)()
    rc = lib.seccomp_notify_alloc(ctypes.byref(preq), ctypes.byref(presp))
    if rc < 0:
        print(f"unit_sandbox: seccomp_notify_alloc: {os.strerror(-rc)}", file=sys.stderr, flush=True)
        return
    req, resp = preq.contents, presp.contents
    failures = 0
    with log.open("a") as out:
        while True:
            ctypes.memset(preq, 0, ctypes.sizeof(Notif))
            rc = lib.seccomp_notify_receive(fd, preq)
            if rc < 0:
                failures += 1
                if failures in (1, 100):
                    print(f"unit_sandbox: notify receive: {os.strerror(-rc)}", file=sys.stderr, flush=True)
                time.sleep(0.05)
                continue
            namep = lib.seccomp_syscall_resolve_num_arch(req.data.arch, req.data.nr)
            name = ctypes.string_at(namep).decode() if namep else str(req.data.nr)
            counts[name] = counts.get(name, 0) + 1
            if counts[name] <= 20:
                try:
                    comm = Path(f"/proc/{req.pid}/comm").read_text().strip()
                except OSError:
                    comm = "?"
                rec = {"t": round(time.time(), 3), "pid": req.pid, "comm": comm, "syscall": name}
                rec["args"] = [hex(a) for a in req.data.args[:4]]
                out.write(json.dumps(rec) + "\n")
                out.flush()
            ctypes.memset(presp, 0, ctypes.sizeof(NotifResp))
            resp.id, resp.val, resp.error, resp.flags = req.id, 0, -errno_value, 0
            lib.seccomp_notify_respond(fd, presp)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rules", required=True)
    ap.add_argument("--user", required=True)
    ap.add_argument("--rw", action="append", default=[])
    ap.add_argument(
        "--allow", action="append", default=[], help="syscall to add to the allow-list (a loosening)"
    )
    ap.add_argument("--env", action="append", default=[])
    ap.add_argument("--denied-log", default="/run/unit_sandbox-denied.jsonl")
    ap.add_argument("--counts", default="", help="write the refused-syscall counts here (JSON) at exit")
    ap.add_argument("--no-notify", action="store_true", help="plain SCMP_ACT_ERRNO, no listener")
    ap.add_argument(
        "--private-dev", action="store_true", help="DevicePolicy as a private /dev, not cgroup v2 BPF"
    )
    ap.add_argument("command", nargs="+")
    args = ap.parse_args()
    r = json.loads(Path(args.rules).read_text())
    root = unified_root()
    if r["device_policy"] == "closed" and root and not args.private_dev:
        cg = os.path.join(root, f"unit-sandbox-{os.getpid()}")
        os.makedirs(cg, exist_ok=True)
        rules = device_rules(r["device_allow"])
        attach_device_program(cg, rules)
        r["_device_cgroup"] = cg
        print(f"unit_sandbox: cgroup {cg}: device program of {len(rules)} rules: {rules}", file=sys.stderr)
    parent_sock, child_sock = socket.socketpair()
    pid = os.fork()
    if pid == 0:
        parent_sock.close()
        child(args, r, child_sock)
    child_sock.close()
    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGABRT):
        signal.signal(s, lambda sig, _f: os.kill(pid, sig))
    fh = parent_sock.makefile("rb")
    line = fh.readline()
    if line:
        print(f"unit_sandbox: pid {pid} {line.decode().strip()}", file=sys.stderr, flush=True)
    counts: dict[str, int] = {}
    if not args.no_notify and line:
        _msg, fds, _flags, _addr = socket.recv_fds(parent_sock, 16, 1)
        if fds:
            lib = load_libseccomp()
            err = getattr(errno, r["syscall_errno"])
            threading.Thread(
                target=supervise, args=(lib, fds[0], Path(args.denied_log), counts, err), daemon=True
            ).start()
    while True:
        try:
            _p, status = os.waitpid(pid, 0)
            break
        except ChildProcessError:
            status = 0
            break
        except InterruptedError:
            continue
    rc = os.waitstatus_to_exitcode(status)
    if r.get("_device_cgroup"):
        with __import__("contextlib").suppress(OSError):
            os.rmdir(r["_device_cgroup"])  # empty once every process of the command is gone
    if args.counts:
        Path(args.counts).write_text(json.dumps({"rc": rc, "refused": counts}))
    print(f"unit_sandbox: exit {rc}; refused by the allow-list: {counts}", file=sys.stderr, flush=True)
    return rc if rc >= 0 else 128 - rc


if __name__ == "__main__":
    sys.exit(main())
