"""What the play does on one host, decided here once, in Python, from the spec (and later the host's facts):
typed, so that the roles only print and copy its values (docs/architecture.md, "Decide in Python").

Today: the arguments of the doctor's stack-free layers that the preflight runs on a host (``DoctorChecks``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from vllm_fleet.fleet.spec import FleetSpec


@dataclass(frozen=True)
class DoctorChecks:
    """The arguments of ``vllm-fleet doctor``'s stack-free layers on one host (the preflight's
    vllm_fleet_doctor task): ``profile`` ``gpu``, ``cpu`` or ``gpu+cpu`` (a host whose instances run stacks of
    both profiles: its CPU checked for the cpu one, its driver and GPUs for the gpu one); ``min_driver`` the
    highest of its gpu stacks' ``min_driver``; ``expect_gpus`` how many GPUs its gpu-profile instances use
    (the highest index + 1); ``host_gpus`` its ``hosts[].gpus`` with the field path errors name."""

    profile: str
    min_driver: int
    expect_gpus: int
    host_gpus: dict[str, Any]

    def as_vars(self) -> dict[str, Any]:
        return asdict(self)


def doctor_checks(spec: FleetSpec, host: str) -> DoctorChecks:
    stacks = [spec.named_stack(n) for n in spec.stacks_on(host)] or [spec.stack]
    profiles = sorted({s.profile for s in stacks})
    gpu_stacks = [s for s in stacks if s.profile == "gpu"]
    used = [g for m in spec.models_on(host) if spec.stack_of(m).profile == "gpu" for g in m.gpus]
    index = [h.name for h in spec.hosts].index(host)
    return DoctorChecks(
        profile="gpu+cpu" if len(profiles) > 1 else profiles[0],
        min_driver=max((s.min_driver for s in gpu_stacks), default=spec.stack.min_driver),
        expect_gpus=max(used, default=-1) + 1,
        host_gpus={**spec.hosts[index].gpus.model_dump(mode="json"), "field": f"hosts[{index}].gpus"},
    )
