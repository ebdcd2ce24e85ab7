"""``vllm-fleet gateway-check URL``: keepalived's question to the gateway's nginx (docs/design/ha.md).

With two or more gateway hosts (``gateway.hosts``) keepalived runs this every few seconds on each of them, against
nginx's loopback status server: ``/vf/health`` (nginx answers) and ``/vf/upstreams`` (nginx reaches an engine that
answers its /health: nginx tries each engine in turn). Exit 0 when the URL answers 2xx within ``--timeout``
seconds, 1 otherwise, with one line that says why (keepalived only reads the exit status; a person running it by
hand reads the line). Standard library only: keepalived starts it as the tools venv's console script
``vllm-fleet-gateway-check`` (the CLI would load the spec model first: ≈ 0.8 s of CPU every few seconds; and
not as ``VENV/bin/python -m ...``: keepalived's script security runs a script by its real path, and the venv's
``python`` is a link to the system interpreter, which then runs outside the venv and cannot import this).
"""

from __future__ import annotations

import argparse
import http.client
import sys
import urllib.error
import urllib.request

DEFAULT_TIMEOUT = 2.0


def check(url: str, timeout: float = DEFAULT_TIMEOUT) -> tuple[bool, str]:
    """(answered 2xx, what happened) for one GET of ``url``; proxies are never used (loopback)."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=timeout) as r:
            status = r.status
    except urllib.error.HTTPError as exc:
        return False, f"{url}: HTTP {exc.code}"
    except (OSError, http.client.HTTPException) as exc:
        reason = getattr(exc, "reason", None) or exc
        return False, f"{url}: {reason}"
    if 200 <= status < 300:
        return True, f"{url}: HTTP {status}"
    return False, f"{url}: HTTP {status}"


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("url", help="what to ask, e.g. http://127.0.0.1:8081/vf/upstreams (nginx's status server)")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT, metavar="SECONDS")
    p.add_argument("--quiet", action="store_true", help="no line, only the exit status")
    p.set_defaults(handler=run)


def run(a: argparse.Namespace) -> int:
    ok, line = check(a.url, a.timeout)
    if not a.quiet:
        print(("ok " if ok else "FAIL ") + line, file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="vllm-fleet gateway-check", description=__doc__.splitlines()[0])
    add_args(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
