"""The bundle's Ansible modules (ansible/plugins/modules): their logic as Python, then each run by Ansible
itself (AnsiballZ, the way a play runs it on a host; here on localhost, in check mode)."""

from __future__ import annotations

import grp
import hashlib
import json
import os
import pwd
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
MODULES = REPO / "ansible" / "plugins" / "modules"
ANSIBLE = Path(sys.executable).parent / "ansible"


def load(name: str) -> ModuleType:
    from ansible_module_loader import load as load_module  # tests/ansible_module_loader.py: no ansible import

    return load_module(name)  # type: ignore[no-any-return]


def me() -> tuple[str, str]:
    return pwd.getpwuid(os.getuid()).pw_name, grp.getgrgid(os.getgid()).gr_name


def sha1(data: bytes) -> str:
    return hashlib.sha1(data).hexdigest()  # what Ansible's copy compares


def run_module_checked(module: str, args: dict[str, object], cwd: Path) -> subprocess.CompletedProcess[str]:
    """``ansible localhost -m MODULE -a ARGS --check`` through the real ansible-core (its JSON result on stdout)."""
    env = dict(os.environ, ANSIBLE_CONFIG=str(REPO / "ansible.cfg"), ANSIBLE_STDOUT_CALLBACK="ansible.builtin.minimal",
               ANSIBLE_CALLBACK_RESULT_FORMAT="json", ANSIBLE_NOCOLOR="1")  # fmt: skip
    return subprocess.run(
        [str(ANSIBLE), "localhost", "-i", "localhost,", "-c", "local", "--check",
         "-e", f"ansible_python_interpreter={HOST_PYTHON}", "-m", module, "-a", json.dumps(args)],
        capture_output=True, text=True, cwd=cwd, env=env, timeout=120,
    )  # fmt: skip


def test_host_state_reports_what_differs_and_nothing_else(tmp_path: Path) -> None:
    hs = load("vllm_fleet_host_state")
    owner, group = me()
    same, other, gone = tmp_path / "d" / "same", tmp_path / "d" / "other", tmp_path / "e" / "gone"
    same.parent.mkdir()
    same.write_bytes(b"a\n")
    other.write_bytes(b"b\n")
    same.chmod(0o644)
    other.chmod(0o644)
    (tmp_path / "d").chmod(0o755)
    f = {"mode": "0644", "owner": owner, "group": group}
    want: dict[str, Any] = {
        "files": [
            {**f, "path": str(same), "checksum": sha1(b"a\n")},
            {**f, "path": str(other), "checksum": sha1(b"a\n")},  # another content
            {**f, "path": str(gone), "checksum": sha1(b"a\n")},
        ],
        "file_dirs": {"mode": "0755", "owner": owner, "group": group},
        "groups": [group, "no-such-group-vf"],
        "users": [{"name": "no-such-user-vf", "group": group, "home": "/", "shell": "/bin/sh"}],
        "read": [str(same), str(gone)],
        "exists": [str(same), str(gone)],
        "globs": {"d": str(tmp_path / "d" / "*")},
    }
    out = hs.host_state(want)
    assert out["files"] == [str(other), str(gone)]
    assert out["missing"] == [str(gone)]
    assert out["dirs"] == [str(tmp_path / "e")]  # the parent of the missing file; d/ is as wanted
    assert out["groups"] == ["no-such-group-vf"] and out["users"] == ["no-such-user-vf"]
    assert out["read"] == {str(same): "a\n", str(gone): None}
    assert out["exists"] == [str(same)]
    assert out["globs"] == {"d": [str(other), str(same)]}
    assert out["tree"] == [] and out["tree_dirs"] == [] and out["units"] == {}
    # the mode alone differs: reported
    same.chmod(0o600)
    assert hs.host_state({"files": want["files"][:1]})["files"] == [str(same)]


def test_host_state_tree_of_pushed_folders(tmp_path: Path) -> None:
    hs = load("vllm_fleet_host_state")
    owner, group = me()
    src, dest = tmp_path / "src" / "m", tmp_path / "dest" / "m"
    (dest / "sub").mkdir(parents=True)
    (dest / "a").write_bytes(b"1")
    (dest / "a").chmod(0o644)
    for d in (dest, dest / "sub"):
        d.chmod(0o755)
    tree = {
        "roots": {str(src): str(dest)},
        "files": [
            {"path": f"{src}/a", "checksum": sha1(b"1")},
            {"path": f"{src}/sub/b", "checksum": sha1(b"2")},  # not pushed yet
            {"path": f"{src}/new/c", "checksum": sha1(b"3")},  # nor its folder
        ],
        "mode": "0644",
        "dir_mode": "0755",
        "owner": owner,
        "group": group,
    }
    out = hs.host_state({"tree": tree})
    assert out["tree"] == [f"{src}/sub/b", f"{src}/new/c"]
    assert out["tree_dirs"] == [f"{dest}/new"]


HOST_PYTHON = Path("/usr/bin/python3")  # what a Debian host runs modules with


@pytest.mark.skipif(
    not ANSIBLE.exists() or not HOST_PYTHON.exists(), reason="needs ansible-core and /usr/bin/python3"
)
def test_host_state_runs_as_an_ansible_module_in_check_mode(tmp_path: Path) -> None:
    """Through Ansible (AnsiballZ, the system's python3 as on a host; the module found through ansible.cfg's
    library): the arguments as a task passes them, the result as a task registers it, check mode, no change."""
    there = tmp_path / "there"
    there.write_text("x\n")
    args = {"exists": [str(there), str(tmp_path / "nope")], "read": [str(there)], "units": []}
    r = run_module_checked("vllm_fleet_host_state", args, tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "localhost | SUCCESS => " in r.stdout, r.stdout
    res = json.loads(r.stdout.split("localhost | SUCCESS => ", 1)[1])
    assert res["changed"] is False and "failed" not in res, res
    assert res["exists"] == [str(there)] and res["read"] == {str(there): "x\n"}
    assert res["files"] == [] and res["units"] == {}


def test_ports_in_use_names_the_listener_and_not_a_free_port() -> None:
    import socket

    pim = load("vllm_fleet_ports_in_use")
    with socket.socket() as s, socket.socket() as free:
        s.bind(("127.0.0.1", 0))
        s.listen()
        free.bind(("127.0.0.1", 0))  # bound, not listening
        port, other = s.getsockname()[1], free.getsockname()[1]
        got = pim.listeners({port, other})
    assert set(got) == {port}
    assert got[port]["pid"] == os.getpid() and got[port]["comm"]


@pytest.mark.skipif(not ANSIBLE.exists(), reason="needs ansible-core")
def test_every_module_documents_exactly_its_options() -> None:
    """ansible-doc reads every module's DOCUMENTATION; its options are the module's argument_spec."""
    import ast

    names = sorted(p.stem for p in MODULES.glob("vllm_fleet_*.py"))
    assert len(names) >= 6, names
    r = subprocess.run([str(ANSIBLE) + "-doc", "-t", "module", "-M", str(MODULES), "--json", *names],
                       capture_output=True, text=True, timeout=120, cwd=REPO)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    docs = json.loads(r.stdout)
    for name in names:
        documented = set(docs[name]["doc"].get("options") or {})
        tree = ast.parse((MODULES / f"{name}.py").read_text())
        spec_keys: set[str] = set()
        for node in ast.walk(tree):  # the argument_spec dict literal (ARGUMENT_SPEC, or inline)
            if isinstance(node, ast.Dict) and all(isinstance(v, ast.Dict) for v in node.values) and node.keys:
                keys = {k.value for k in node.keys if isinstance(k, ast.Constant)}
                if any(isinstance(v, ast.Dict) and any(isinstance(k, ast.Constant) and k.value == "type"
                                                       for k in v.keys) for v in node.values):  # fmt: skip
                    spec_keys |= keys
        assert documented == spec_keys, (name, documented ^ spec_keys)
        assert docs[name]["doc"]["short_description"] and docs[name]["examples"], name


def test_venv_sync_removes_what_the_lock_does_not_pin_and_what_must_be_absent() -> None:
    vs = load("vllm_fleet_venv_sync")
    lock = "numpy==2.1.0 \\\n    --hash=sha256:aa\nTorch_Vision==0.20 \\\n    --hash=sha256:bb\n# pip==1\n"
    assert vs.locked(lock) == {"numpy", "torch-vision"}
    installed = {"numpy", "torch-vision", "left-over", "pip", "vllm-fleet"}
    keep = ["pip", "setuptools", "wheel", "vllm-fleet"]
    assert vs.to_remove(installed, lock, True, keep, []) == ["left-over"]
    assert vs.to_remove(installed, lock, True, keep, ["torch_vision", "triton"]) == [
        "left-over",
        "torch-vision",
    ]
    assert vs.to_remove(installed, lock, False, keep, ["torch_vision"]) == ["torch-vision"]


@pytest.mark.skipif(not ANSIBLE.exists(), reason="needs ansible-core")
def test_venv_sync_runs_with_the_venvs_own_interpreter(tmp_path: Path) -> None:
    """Through Ansible with the venv's python as the interpreter: check mode reports, a real run uninstalls."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    site = next((venv / "lib").glob("python3*/site-packages"))
    for name in ("left_over", "kept"):  # two installed distributions, by their dist-info alone
        d = site / f"{name}-1.0.dist-info"
        d.mkdir()
        (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name.replace('_', '-')}\nVersion: 1.0\n")
        (d / "RECORD").write_text(f"{name}-1.0.dist-info/METADATA,,\n{name}-1.0.dist-info/RECORD,,\n")
    lock = tmp_path / "lock.txt"
    lock.write_text("kept==1.0 \\\n    --hash=sha256:aa\n")
    env = dict(os.environ, ANSIBLE_CONFIG=str(REPO / "ansible.cfg"), ANSIBLE_STDOUT_CALLBACK="ansible.builtin.minimal",
               ANSIBLE_CALLBACK_RESULT_FORMAT="json", ANSIBLE_NOCOLOR="1")  # fmt: skip

    def run(*extra: str) -> dict[str, object]:
        r = subprocess.run(
            [str(ANSIBLE), "localhost", "-i", "localhost,", "-c", "local", *extra,
             "-e", f"ansible_python_interpreter={venv}/bin/python",
             "-m", "vllm_fleet_venv_sync", "-a", json.dumps({"lock": str(lock)})],
            capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120,
        )  # fmt: skip
        assert "localhost | CHANGED => " in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
        return json.loads(r.stdout.split(" => ", 1)[1])  # type: ignore[no-any-return]

    checked = run("--check")
    assert checked["changed"] is True and checked["removed"] == ["left-over"]
    assert (site / "left_over-1.0.dist-info").exists()  # check mode removes nothing
    done = run()
    assert done["removed"] == ["left-over"]
    assert not (site / "left_over-1.0.dist-info").exists() and (site / "kept-1.0.dist-info").exists()


def _fake_proc(tmp_path: Path, **values: int) -> Path:
    proc = tmp_path / "proc"
    for name, value in values.items():
        f = proc.joinpath(*name.split("__"))
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(f"{value}\n")
    return proc


def test_sysctl_writes_the_drop_in_and_raises_only_what_is_below(tmp_path: Path) -> None:
    sc = load("vllm_fleet_sysctl")
    proc = _fake_proc(tmp_path, net__core__somaxconn=4096, net__unix__max_dgram_qlen=10)
    drop_in = tmp_path / "sysctl.d" / "60-vf.conf"
    want = {"net.core.somaxconn": 2048, "net.unix.max_dgram_qlen": 5000}
    # check mode: says what it would do, touches nothing
    out = sc.ensure(str(drop_in), want, "the gateway\nsecond line", True, str(proc))
    assert out["changed"] and out["file_changed"] and out["raised"] == {"net.unix.max_dgram_qlen": [10, 5000]}
    assert not drop_in.exists() and (proc / "net" / "unix" / "max_dgram_qlen").read_text() == "10\n"
    out = sc.ensure(str(drop_in), want, "the gateway\nsecond line", False, str(proc))
    assert out["changed"] and out["not_raised"] == {} and out["msg"] == "net.unix.max_dgram_qlen 10 -> 5000"
    assert drop_in.read_text() == (
        "# the gateway\n# second line\nnet.core.somaxconn = 2048\nnet.unix.max_dgram_qlen = 5000\n"
    )
    assert drop_in.stat().st_mode & 0o777 == 0o644
    assert (proc / "net" / "unix" / "max_dgram_qlen").read_text() == "5000\n"
    # a minimum: the higher somaxconn stays
    assert (proc / "net" / "core" / "somaxconn").read_text() == "4096\n"
    again = sc.ensure(str(drop_in), want, "the gateway\nsecond line", False, str(proc))
    assert not again["changed"] and again["raised"] == {} and "already at least" in again["msg"]


def test_sysctl_skips_what_cannot_be_written_here_and_says_why(tmp_path: Path) -> None:
    """A container's /proc/sys may be read-only: the task must not fail, the drop-in is still written and the
    reason is in the result (and a warning). Here the kernel's own refusal: fs.file-nr is read-only (0444,
    root too) and no.such.setting does not exist."""
    sc = load("vllm_fleet_sysctl")
    drop_in = tmp_path / "60-vf.conf"
    out = sc.ensure(str(drop_in), {"fs.file-nr": 1 << 40, "no.such.setting": 1}, "", False)
    assert out["raised"] == {} and out["file_changed"] and drop_in.exists()
    assert out["not_raised"] == {
        "fs.file-nr": "no permission to write /proc/sys here (a container?)",
        "no.such.setting": "no such setting here (this kernel, or this network namespace)",
    }
    assert (
        "fs.file-nr not raised now: no permission" in out["msg"]
        and f"{drop_in} applies at the next boot" in out["msg"]
    )
    import errno

    assert "read-only" in sc._why(OSError(errno.EROFS, "Read-only file system"), "/proc/sys")


@pytest.mark.skipif(
    not ANSIBLE.exists() or not HOST_PYTHON.exists(), reason="needs ansible-core and /usr/bin/python3"
)
def test_sysctl_runs_as_an_ansible_module_in_check_mode(tmp_path: Path) -> None:
    drop_in = tmp_path / "60-vf.conf"
    args = {"path": str(drop_in), "settings": {"net.core.somaxconn": 1}, "comment": "test"}
    r = run_module_checked("vllm_fleet_sysctl", args, tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(r.stdout.split("localhost | CHANGED => ", 1)[1])
    assert res["file_changed"] is True and res["raised"] == {} and res["not_raised"] == {}, res
    assert not drop_in.exists()
