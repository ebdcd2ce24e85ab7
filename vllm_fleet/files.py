"""Small file helpers every room uses (controller, hosts, harness): a sha256, a JSON object read or replaced
atomically, the weight bytes of safetensors files. Standard library only."""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path
from typing import Any


def sha256_file(path: Path) -> str:
    """The hex SHA-256 of the file's bytes, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def read_json_object(path: Path) -> dict[str, Any] | None:
    """The JSON object in ``path``; None when the file is missing or unreadable, not JSON, or not an object."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def write_json_atomic(path: Path, data: Any, mode: int = 0o644, owner: tuple[int, int] | None = None) -> None:
    """Replace ``path`` with ``data`` (JSON, sorted keys, one line and a newline) atomically, as the hosts' state
    files are written: a temp file in the same folder (``.NAME.PID.tmp``), given ``mode`` whatever the umask
    (the units' UMask=0077; the exporter, another user, reads it) and ``owner`` (uid, gid) when set, then
    renamed over ``path``; readers see the old file or the new one, never half of one. The folder must exist.
    ``OSError`` when it cannot be written (the temp file is removed)."""
    tmp = path.parent / f".{path.name}.{os.getpid()}.tmp"
    try:
        tmp.write_text(json.dumps(data, sort_keys=True) + "\n")
        tmp.chmod(mode)
        if owner is not None:
            os.chown(tmp, *owner)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def safetensors_bytes(model_dir: Path) -> int | None:
    """The weights' bytes: the index's ``metadata.total_size``, else the tensors of every ``*.safetensors``."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        try:
            total = json.loads(index.read_text()).get("metadata", {}).get("total_size")
            return int(total) if total else None
        except (OSError, ValueError):
            return None
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        return None
    total = 0
    for f in files:
        with f.open("rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for k, v in header.items():
            if k != "__metadata__":
                start, end = v["data_offsets"]
                total += end - start
    return total
