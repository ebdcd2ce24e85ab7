"""The controller side, pure: the fleet spec and everything derived from it on the operator's machine.

``spec`` (the typed fleet spec; the leaf, it imports nothing of vllm_fleet), ``plan`` (GPUs, ports, memory),
``modelinfo`` and ``engine_flags`` (model and engine facts the plan reads), ``engine`` (each instance's
engine argv and environment), ``context`` (the template variables), ``render`` (the artifacts),
``routes`` (the gateway's routing table), ``lock`` (the pinned engine stack) and ``observability`` (alert
thresholds, dashboards, Grafana provisioning). Modules here may import each other (without a circle), the
shared top-level modules (``vllm_fleet.cli``, ``file_lock``, ``vllm_metrics``) and third-party libraries;
never ``vllm_fleet.host``, ``vllm_fleet.bench`` or ``vllm_fleet.devtools``.
"""
