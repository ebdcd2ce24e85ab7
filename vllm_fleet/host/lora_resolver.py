"""The engine's LoRA resolver for vllm-fleet instances: the spill path.

vLLM loads the ``vllm.general_plugins`` entry points in each of its processes; vllm-fleet's is
``vllm_fleet_adapters = vllm_fleet.host.lora_resolver:register``. With ``VLLM_FLEET_ADAPTERS_FILE`` in the
engine's environment (the launcher passes the instance config's: LoRA on), ``register`` adds a resolver to
vLLM's ``LoRAResolverRegistry``. vLLM asks it (with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``) when a request
names a model that is neither the base nor a loaded adapter: it answers with a ``LoRARequest`` for any adapter
the instance's adapters file lists (``vllm_fleet.contracts.AdaptersFile``, carried or not: the gateway sends
an adapter's requests to the instance that carries it first, to the base's other instances when those are
busy or down), and vLLM loads it and serves the request. The file is read on every call: an adapter added
to it is found without a restart. A name the file does not list gets None (vLLM's 404).

Importing this module imports nothing of vLLM and nothing heavy (it runs in every vLLM process, and in
vllm-fleet's own tools); without ``VLLM_FLEET_ADAPTERS_FILE`` ``register`` does nothing.
"""

from __future__ import annotations

import os
from typing import Any

from vllm_fleet.contracts import ADAPTERS_FILE_ENV, AdapterEntry, AdaptersFile, ContractError

RESOLVER_NAME = "vllm-fleet adapters"


def lookup(file: str, name: str) -> AdapterEntry | None:
    """The adapter ``name`` of the adapters file ``file``; None when it does not list it, or the file cannot
    be read (no adapter is the safe answer: the request gets vLLM's 404)."""
    try:
        return AdaptersFile.load(file).adapter(name)
    except (OSError, ContractError, KeyError):
        return None


def make_resolver(file: str) -> Any:
    """A ``vllm.lora.resolver.LoRAResolver`` answering from the adapters file ``file`` (imports vLLM)."""
    from vllm.lora.request import LoRARequest
    from vllm.lora.resolver import LoRAResolver

    class FleetAdaptersResolver(LoRAResolver):
        """Any adapter of the instance's adapters file, from its path on this host."""

        def __init__(self, path: str) -> None:
            self.file = path

        async def resolve_lora(self, base_model_name: str, lora_name: str) -> Any:
            # base_model_name is vLLM's model path or name: the file is this instance's, so its base is the one
            a = lookup(self.file, lora_name)
            if a is None:
                return None
            # lora_int_id: vLLM sets its own id on the request it loads
            return LoRARequest(lora_name=a.name, lora_int_id=1, lora_path=a.path)

    return FleetAdaptersResolver(file)


def register() -> None:
    """vLLM's general plugin entry point: register the resolver when the engine has an adapters file."""
    file = os.environ.get(ADAPTERS_FILE_ENV, "")
    if not file:
        return
    from vllm.lora.resolver import LoRAResolverRegistry

    LoRAResolverRegistry.register_resolver(RESOLVER_NAME, make_resolver(file))
