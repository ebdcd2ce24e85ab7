"""Model download and integrity: ``vllm-fleet fetch --contract CONFIG_DIR/host.json`` on a host (the models of
its contract, ``vllm_fleet.contracts.HostContract``); on the controller ``vllm-fleet fetch SPEC [--host H]``
builds them from the spec (``vllm_fleet.host_commands``) and runs the same code.

LoRA adapters (``adapters[].source``, a host contract's ``adapters``) are fetched and verified the same way
into their own folders, their ``adapter_config.json`` rank checked against the spec's, and reported apart
(``--json``: ``adapters``): a changed adapter is synced on its instances, never a restart.

Sources (``models[].source``): Hugging Face (``huggingface_hub.snapshot_download`` into the model folder at the
commit the pinned revision resolves to, recorded in the manifest; progress bars; a broken transfer resumes, a
rerun after a killed fetch keeps the finished files), ModelScope (its ``snapshot_download`` when the ``modelscope``
package is installed) or a local path (already on the host, or copied from ``--from DIR``). After a fetch every
file is hashed (sha256), checked against ``source.checksums`` and written to a checksum manifest
``.vllm-fleet-checksums.json`` in the model folder. Later runs re-hash only files whose size or mtime changed,
so a rerun is cheap and reports ``changed: false``. Engines then run offline (``HF_HUB_OFFLINE=1``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_fleet.contracts import COMMIT_RE, ContractError, HostAdapter, HostContract, HostModel
from vllm_fleet.file_lock import file_lock
from vllm_fleet.files import read_json_object, safetensors_bytes, sha256_file

MANIFEST = ".vllm-fleet-checksums.json"
SKIP_DIRS = {".cache", ".git", ".huggingface", "._____temp"}
LOCK = ".vllm-fleet-fetch.lock"


class FetchError(Exception):
    pass


@dataclass
class FetchResult:
    instance: str
    path: str
    source: str
    revision: str
    changed: bool
    files: dict[str, str] = field(default_factory=dict)
    # the commit a hub revision (tag or hash) resolved to when it was downloaded; "" for local paths
    commit: str = ""


def model_files(root: Path) -> list[Path]:
    out: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        for f in sorted(filenames):
            if f == MANIFEST or f.endswith(".incomplete") or f.endswith(".lock"):
                continue
            out.append(Path(dirpath) / f)
    return out


def source_identity(m: HostModel) -> dict[str, str]:
    return {"kind": m.source.kind, "repo": m.source.repo, "revision": m.source.revision}


def read_manifest(root: Path) -> dict[str, Any] | None:
    return read_json_object(root / MANIFEST)


def hash_tree(root: Path, previous: dict[str, Any] | None = None) -> dict[str, dict[str, Any]]:
    """{relative path: {sha256, size, mtime}}; reuses ``previous`` entries whose size and mtime match."""
    old = (previous or {}).get("files", {})
    out: dict[str, dict[str, Any]] = {}
    for p in model_files(root):
        rel = p.relative_to(root).as_posix()
        st = p.stat()
        prev = old.get(rel)
        if prev and prev.get("size") == st.st_size and prev.get("mtime") == st.st_mtime_ns:
            out[rel] = prev
        else:
            out[rel] = {"sha256": sha256_file(p), "size": st.st_size, "mtime": st.st_mtime_ns}
    return out


def verify(files: dict[str, dict[str, Any]], expected: dict[str, str]) -> list[str]:
    """Problems: files named in ``expected`` that are missing or hash differently."""
    problems = []
    for rel, sha in sorted(expected.items()):
        got = files.get(rel)
        if got is None:
            problems.append(f"{rel}: missing")
        elif got["sha256"].lower() != sha.lower():
            problems.append(f"{rel}: sha256 {got['sha256']} != expected {sha}")
    return problems


def _download_hf(m: HostModel, dest: Path) -> str:
    """snapshot_download at the commit the pinned revision resolves to (HF_ENDPOINT / HF_TOKEN apply);
    returns that commit. Files already in ``dest`` at that commit are kept; a broken transfer is resumed in
    place with a Range request (from the last 10 MiB written)."""
    from huggingface_hub import HfApi, snapshot_download
    from huggingface_hub.errors import (
        HfHubHTTPError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    src = m.source
    assert src.kind == "hf"
    field_ = f"{m.spec_field}.source.hf"
    try:
        commit = src.revision
        if not COMMIT_RE.fullmatch(commit):
            info = HfApi().repo_info(src.repo, revision=src.revision)
            commit = info.sha or src.revision
        # tqdm progress goes to stderr
        snapshot_download(repo_id=src.repo, revision=commit, local_dir=str(dest))
    except RevisionNotFoundError:
        raise FetchError(f"{field_}.revision {src.revision!r}: no such revision in {src.repo}") from None
    except RepositoryNotFoundError:
        raise FetchError(
            f"{field_}.repo {src.repo!r}: repository not found (a gated or private one needs HF_TOKEN)"
        ) from None
    except OfflineModeIsEnabled:
        raise FetchError(f"{field_}: HF_HUB_OFFLINE is set and {dest} does not hold the model") from None
    except (HfHubHTTPError, OSError) as exc:
        raise FetchError(f"{field_}: download of {src.repo}@{src.revision} failed: {exc}") from None
    except Exception as exc:  # httpx transport errors after huggingface_hub's own retries
        raise FetchError(f"{field_}: download of {src.repo}@{src.revision} failed: {exc!r}") from None
    return commit


@contextmanager
def _exclusive(root: Path) -> Iterator[None]:
    """One fetch at a time per model folder."""
    try:
        with file_lock(root / LOCK, wait=False):
            yield
    except BlockingIOError:
        raise FetchError(f"{root}: another fetch is writing this folder") from None


def drop_stale_partials(root: Path) -> list[Path]:
    """huggingface_hub 2.x downloads every file to a process-unique ``*.incomplete`` file and cannot reuse one a
    killed fetch left behind (files already complete are kept; the one in progress starts over): remove them
    rather than leave a partial copy of a large shard on the disk for good."""
    stale = sorted((root / ".cache" / "huggingface").rglob("*.incomplete"))
    for p in stale:
        p.unlink(missing_ok=True)
    return stale


def _download_modelscope(m: HostModel, dest: Path) -> None:
    try:
        from modelscope import snapshot_download
    except ImportError:
        raise FetchError(
            f"{m.spec_field}.source.modelscope needs the `modelscope` package on this host (pip install modelscope)"
        ) from None
    assert m.source.kind == "modelscope"
    snapshot_download(m.source.repo, revision=m.source.revision, local_dir=str(dest))


def _copy_tree(src: Path, dest: Path) -> None:
    for p in model_files(src):
        target = dest / p.relative_to(src)
        target.parent.mkdir(parents=True, exist_ok=True)
        if (
            target.exists()
            and target.stat().st_size == p.stat().st_size
            and sha256_file(target) == sha256_file(p)
        ):
            continue
        shutil.copy2(p, target)


def fetch_instance(
    m: HostModel,
    dest: Path | None = None,
    copy_from: Path | None = None,
    verify_all: bool = False,
) -> FetchResult:
    root = dest or Path(m.model_path)
    ident = source_identity(m)
    previous = read_manifest(root)
    up_to_date = previous is not None and previous.get("source") == ident and not verify_all
    changed = False
    commit = str((previous or {}).get("commit", "")) if up_to_date else ""
    if not up_to_date or not root.is_dir():
        if copy_from is not None:
            if not copy_from.is_dir():
                raise FetchError(f"--from {copy_from}: not a folder")
            root.mkdir(parents=True, exist_ok=True)
            _copy_tree(copy_from, root)
        elif m.source.kind == "hf":
            with _exclusive(root):
                if stale := drop_stale_partials(root):
                    print(
                        f"fetch: removed {len(stale)} partial file(s) of an interrupted fetch",
                        file=sys.stderr,
                    )
                commit = _download_hf(m, root)
        elif m.source.kind == "modelscope":
            with _exclusive(root):
                _download_modelscope(m, root)
        elif not root.is_dir():
            raise FetchError(
                f"{m.spec_field}.source.path {root} does not exist on this host (copy it there, or use --from DIR)"
            )
        previous = None if verify_all else previous
    files = hash_tree(root, previous if up_to_date else None)
    problems = verify(files, m.source.checksums)
    if problems:
        raise FetchError(f"{m.spec_field} at {root}: checksum mismatch:\n  " + "\n  ".join(problems))
    if not any(files):
        raise FetchError(f"{m.spec_field} at {root}: no files")
    if isinstance(m, HostAdapter):
        check_adapter(m, root)
    new: dict[str, Any] = {"source": ident, "files": files}
    if commit:
        new["commit"] = commit
    if (
        previous is None
        or previous.get("source") != ident
        or previous.get("files") != files
        or previous.get("commit", "") != commit
    ):
        new["verified_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        (root / MANIFEST).write_text(json.dumps(new, indent=2, sort_keys=True) + "\n")
        changed = True
    return FetchResult(
        m.name,
        str(root),
        m.source.kind,
        m.source.revision,
        changed,
        {k: v["sha256"] for k, v in files.items()},
        commit,
    )


ADAPTER_CONFIG = "adapter_config.json"


def check_adapter(a: HostAdapter, root: Path) -> None:
    """A fetched adapter folder is a PEFT LoRA adapter of the rank the spec gives: vLLM reads its
    adapter_config.json, and an adapter of a larger rank than the spec says would not fit the slots the engine
    was started with (--max-lora-rank is planned from the spec's ranks)."""
    try:
        cfg = json.loads((root / ADAPTER_CONFIG).read_text())
    except FileNotFoundError:
        raise FetchError(
            f"{a.spec_field} at {root}: no {ADAPTER_CONFIG} (not a PEFT LoRA adapter folder)"
        ) from None
    except (OSError, ValueError) as exc:
        raise FetchError(f"{a.spec_field} at {root}: {ADAPTER_CONFIG} cannot be read: {exc}") from None
    r = cfg.get("r") if isinstance(cfg, dict) else None
    if r != a.rank:
        raise FetchError(
            f"{a.spec_field}.rank {a.rank}: {root / ADAPTER_CONFIG} says r = {r!r}: give the adapter's real rank"
        )


def fetch_all(
    models: Iterable[HostModel],
    instance: str | None = None,
    dest_dir: Path | None = None,
    copy_from: Path | None = None,
    verify_all: bool = False,
    skip: Iterable[str] = (),
) -> list[FetchResult]:
    """Fetch each distinct model folder of ``models`` once (instances sharing a path share the download): a
    host's contract's ``models`` (those of its instances and of the multi-node ranks it runs: each loads its
    share), or on the controller the spec's. ``skip``: instances whose folder is left as it is (a running
    instance whose change is held for `vllm-fleet rollout`: its new revision goes to the canary's folder only)."""
    done: dict[str, FetchResult] = {}
    out: list[FetchResult] = []
    skipped = set(skip)
    for m in models:
        if (instance and m.name != instance) or m.name in skipped:
            continue
        dest = dest_dir / m.name if dest_dir else Path(m.model_path)
        key = str(dest)
        if key in done:
            r = done[key]
            out.append(FetchResult(m.name, r.path, r.source, r.revision, False, r.files, r.commit))
            continue
        src = None
        if copy_from is not None:
            src = copy_from / m.name if (copy_from / m.name).is_dir() else copy_from / dest.name
        r = fetch_instance(m, dest, src, verify_all)
        done[key] = r
        out.append(r)
    return out


def fetch_adapters(
    adapters: Iterable[HostAdapter],
    names: Iterable[str] = (),
    dest_dir: Path | None = None,
    copy_from: Path | None = None,
    verify_all: bool = False,
) -> list[FetchResult]:
    """Fetch and verify each adapter folder of ``adapters`` (``names``: only these) like a model's: into its
    folder on the host, or DEST/adapters/NAME; with ``copy_from``, copied from FROM/NAME (or FROM/<folder
    name>), the way the play pushes a path source from the controller's models folder."""
    wanted = set(names)
    out: list[FetchResult] = []
    for a in adapters:
        if wanted and a.name not in wanted:
            continue
        dest = dest_dir / "adapters" / a.name if dest_dir else Path(a.model_path)
        src = None
        if copy_from is not None:
            src = copy_from / a.name if (copy_from / a.name).is_dir() else copy_from / dest.name
        out.append(fetch_instance(a, dest, src, verify_all))
    return out


def model_size(root: Path) -> dict[str, Any]:
    """``config`` (the model's config.json, or None) and ``weight_bytes`` (safetensors) of a fetched folder."""
    try:
        config = json.loads((root / "config.json").read_text())
    except (OSError, ValueError):
        config = None
    try:
        size = safetensors_bytes(root)
    except (OSError, ValueError, KeyError):
        size = None
    return {"config": config if isinstance(config, dict) else None, "weight_bytes": size}


def add_args(p: argparse.ArgumentParser) -> None:
    """The host's command line: ``--contract`` (the play passes CONFIG_DIR/host.json); ``vllm-fleet fetch``
    adds a fleet spec as the other source (vllm_fleet.host_commands)."""
    p.add_argument(
        "--contract",
        metavar="PATH",
        help="this host's contract (CONFIG_DIR/host.json, written by the play): fetch its models",
    )
    p.add_argument("--instance", help="only this instance")
    p.add_argument(
        "--dest", help="download into DEST/INSTANCE instead of the host's model folders (controller)"
    )
    p.add_argument("--from", dest="copy_from", help="copy from FOLDER/INSTANCE (or FOLDER/<folder name>)")
    p.add_argument("--verify", action="store_true", help="re-hash every file even if unchanged")
    p.add_argument(
        "--skip",
        action="append",
        default=[],
        metavar="INSTANCE",
        help="leave this instance's model folder as it is (a change held for vllm-fleet rollout); repeatable",
    )
    p.add_argument(
        "--adapter",
        action="append",
        default=[],
        metavar="NAME",
        help="only this LoRA adapter (with --instance: and that instance's model); repeatable",
    )
    p.add_argument(
        "--json", action="store_true", help="one JSON object: {changed, models: [...], adapters: [...]}"
    )
    p.set_defaults(handler=_run)


def read_contract(path: str, command: str) -> HostContract | None:
    """The host contract at ``path``; None (the reason printed, naming the file and the field) when it cannot
    be read or is not one."""
    try:
        return HostContract.load(path)
    except OSError as exc:
        print(f"{command}: --contract {path}: cannot read it ({exc.strerror})", file=sys.stderr)
    except ContractError as exc:
        print(f"{command}: --contract: {exc}", file=sys.stderr)
    return None


def _run(a: argparse.Namespace) -> int:
    if not a.contract:
        print("fetch: give this host's contract: --contract CONFIG_DIR/host.json", file=sys.stderr)
        return 2
    contract = read_contract(a.contract, "fetch")
    return 2 if contract is None else run(a, contract.models, contract.adapters)


def _line(r: FetchResult, what: str = "") -> str:
    state = "fetched/verified" if r.changed else "unchanged"
    at = f"{r.revision} = {r.commit[:12]}" if r.commit and r.commit != r.revision else r.revision
    return f"{what}{r.instance}: {r.path} ({r.source} @ {at}, {len(r.files)} files) {state}"


def run(a: argparse.Namespace, models: list[HostModel], adapters: Iterable[HostAdapter] = ()) -> int:
    """Fetch ``models`` and ``adapters`` as the arguments say and print the results (one JSON object with
    ``--json``). ``--instance`` alone: its model only; ``--adapter`` alone: those adapters only."""
    names = list(getattr(a, "adapter", None) or [])
    dest = Path(a.dest) if a.dest else None
    copy_from = Path(a.copy_from) if a.copy_from else None
    by_base = {x.name: x.base for x in adapters}
    try:
        results = (
            fetch_all(models, a.instance, dest, copy_from, a.verify, getattr(a, "skip", []))
            if a.instance or not names
            else []
        )
        fetched_adapters = (
            fetch_adapters(adapters, names, dest, copy_from, a.verify) if names or not a.instance else []
        )
    except FetchError as exc:
        print(f"fetch: {exc}", file=sys.stderr)
        return 1
    changed = any(r.changed for r in [*results, *fetched_adapters])
    if a.json:
        # each model's config.json and weight bytes: the play plans again with them before any unit starts
        models_out = [{**r.__dict__, **model_size(Path(r.path))} for r in results]
        # an adapter whose files changed is synced on its running instances, never restarted (docs/lora.md)
        adapters_out = [
            {
                "adapter": r.instance,
                "base": by_base[r.instance],
                **{k: v for k, v in r.__dict__.items() if k != "instance"},
            }
            for r in fetched_adapters
        ]
        print(json.dumps({"changed": changed, "models": models_out, "adapters": adapters_out}))
    else:
        for r in results:
            print(_line(r))
        for r in fetched_adapters:
            print(_line(r, "adapter "))
    return 0
