"""Run one of vllm-fleet's own modules on a host that has no vllm-fleet yet (the preflight, before the install).

The preflight role runs it with the host's python3 (``python3 -c "$(this file)"``) and writes one JSON object
to its stdin: {"modules": {dotted name: source}, "main": dotted name, "args": [...]}. The sources are the
checkout's own files (``vllm_fleet/host/doctor.py`` and the two modules it imports), read on the controller:
each is executed as the module of that name (its parent packages made empty), dependencies first, then
``main(args)`` of the "main" module runs and its return value is the exit status. So the doctor's layers that
need no engine stack have one implementation, whether ``vllm-fleet doctor`` or the play runs them.
Standard library only; reads and runs, writes nothing.
"""

import json
import sys
import types

job = json.load(sys.stdin)
for name, source in job["modules"].items():
    parts = name.split(".")
    for i in range(1, len(parts)):
        pkg = ".".join(parts[:i])
        if pkg not in sys.modules:
            sys.modules[pkg] = types.ModuleType(pkg)
            sys.modules[pkg].__path__ = []
    mod = types.ModuleType(name)
    mod.__file__ = "<vllm-fleet " + name + ">"
    sys.modules[name] = mod
    setattr(sys.modules[".".join(parts[:-1])], parts[-1], mod)
    exec(compile(source, mod.__file__, "exec"), mod.__dict__)
sys.exit(sys.modules[job["main"]].main(job["args"]))
