#!/usr/bin/python
"""Ansible module: the layers of `vllm-fleet doctor` that need no engine stack, on a host without vllm-fleet."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: vllm_fleet_doctor
short_description: Run vllm-fleet doctor's stack-free layers (cpu-isa, driver, gpus) on a host
description:
  - Runs the checkout's own doctor code (C(vllm_fleet/host/doctor.py) and the modules it imports, shipped as
    module_utils) with the host's python3, before anything of vllm-fleet is installed there. Reads only, so it
    runs the same in check mode.
  - Returns every layer's verdict; the preflight role then stops the host at the first failed layer with its
    fix. A failed layer does not fail this task.
options:
  profile:
    description: C(gpu), C(cpu) or C(gpu+cpu) (CPU instruction sets for the cpu profile, driver and GPUs for gpu).
    type: str
    required: true
    choices: [gpu, cpu, gpu+cpu]
  layers:
    description: The layers to run, bottom up.
    type: list
    elements: str
    default: [cpu-isa, driver, gpus]
  min_driver: {description: The lowest NVIDIA driver the stacks need., type: int, default: 0}
  expect_gpus: {description: How many GPUs the host's gpu-profile instances use., type: int, default: 0}
  host_gpus:
    description: The spec's C(hosts[].gpus) of the host, with C(field) (the path errors name).
    type: dict
author: vllm-fleet
"""

EXAMPLES = r"""
- name: Run the doctor's stack-free layers
  vllm_fleet_doctor:
    profile: gpu
    min_driver: 580
    expect_gpus: 2
    host_gpus: {count: 2, field: "hosts[0].gpus"}
  register: doctor
"""

RETURN = r"""
layers:
  description: Each layer's verdict, bottom up ({name, status ok/warn/fail/skip/blocked, detail, fix, facts}).
  returned: always
  type: list
  elements: dict
"""

from dataclasses import asdict
from typing import Any

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.vllm_fleet.host import doctor

ARGUMENT_SPEC: dict[str, Any] = {
    "profile": {"type": "str", "required": True, "choices": ["gpu", "cpu", "gpu+cpu"]},
    "layers": {"type": "list", "elements": "str", "default": ["cpu-isa", "driver", "gpus"]},
    "min_driver": {"type": "int", "default": 0},
    "expect_gpus": {"type": "int", "default": 0},
    "host_gpus": {"type": "dict"},
}


def main() -> None:
    module = AnsibleModule(argument_spec=ARGUMENT_SPEC, supports_check_mode=True)
    p = module.params
    unknown = [n for n in p["layers"] if n not in doctor.STACK_FREE_LAYERS]
    if unknown:
        module.fail_json(msg=f"layers {unknown} need an engine stack: run `vllm-fleet doctor` in its venv")
    layers = doctor.check(
        p["profile"], min_driver=p["min_driver"], expect_gpus=p["expect_gpus"], layers=p["layers"],
        host_gpus=p["host_gpus"],
    )  # fmt: skip
    module.exit_json(changed=False, layers=[asdict(x) for x in layers])


if __name__ == "__main__":
    main()
