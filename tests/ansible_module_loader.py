"""Load one of the bundle's Ansible modules (ansible/plugins/modules) as a plain Python module, for unit tests.

ansible-core must not be imported into the test process: importing ``ansible.module_utils.basic`` patches
``sys.intern`` for the whole interpreter, and torch (the tiny model the engine tests build) refuses it later in
the same process. So the module is loaded with a stand-in ``ansible.module_utils.basic`` (the tests call the
module's functions, never ``main()``) and ``ansible.module_utils.vllm_fleet`` as the package itself (what
ansible/plugins/module_utils/vllm_fleet links to); the modules run through real Ansible in a subprocess
elsewhere (tests/unit/test_ansible_modules.py)."""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path
from typing import Any

MODULES = Path(__file__).resolve().parents[1] / "ansible" / "plugins" / "modules"


class _NoAnsibleModule:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("unit tests call the module's functions; main() runs under Ansible")


def load(name: str) -> Any:
    stand_ins = {
        "ansible": types.ModuleType("ansible"),
        "ansible.module_utils": types.ModuleType("ansible.module_utils"),
        "ansible.module_utils.basic": types.ModuleType("ansible.module_utils.basic"),
    }
    stand_ins["ansible.module_utils.basic"].AnsibleModule = _NoAnsibleModule  # type: ignore[attr-defined]
    import vllm_fleet
    import vllm_fleet.contracts

    stand_ins["ansible.module_utils.vllm_fleet"] = vllm_fleet
    stand_ins["ansible.module_utils.vllm_fleet.contracts"] = vllm_fleet.contracts
    saved = {k: sys.modules.get(k) for k in stand_ins}
    sys.modules.update(stand_ins)
    try:
        spec = importlib.util.spec_from_file_location(f"_vf_module_{name}", MODULES / f"{name}.py")
        assert spec and spec.loader
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
