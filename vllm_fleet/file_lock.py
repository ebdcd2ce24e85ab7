"""An exclusive ``flock`` on a file, for the ``with`` block (sandbox caches, model folders)."""

from __future__ import annotations

import fcntl
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def file_lock(path: Path, wait: bool = True) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (created if missing). ``wait=False``: raise
    ``BlockingIOError`` at once when another process holds it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
