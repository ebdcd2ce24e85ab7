"""Small file helpers every room uses (controller, hosts, harness): a sha256, a JSON object, the weight bytes of
safetensors files. Standard library only."""

from __future__ import annotations

import hashlib
import json
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
