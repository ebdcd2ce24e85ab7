"""The lock's entries of the packages vllm-fleet itself needs (ansible/roles/engine: the fleet's own venv).

argv: LOCK OUT NAME...; writes OUT with the ``name==version`` lines and their ``--hash`` lines of the named
packages (names normalised), so pip still installs with ``--require-hashes``. Standard library only.
"""

import re
import sys


def norm(name):
    return re.sub(r"[-_.]+", "-", name).lower()


lock, out, names = sys.argv[1], sys.argv[2], {norm(n) for n in sys.argv[3:]}
with open(lock) as f:
    entries = f.read().replace("\\\n", " ").splitlines()
keep = [e for e in entries if "==" in e and not e.startswith("#") and norm(e.split("==")[0].strip()) in names]
missing = names - {norm(e.split("==")[0].strip()) for e in keep}
if missing:
    sys.exit(f"{lock}: no pin for {', '.join(sorted(missing))} (vllm-fleet needs them in its own venv)")
with open(out, "w") as f:
    f.write("".join(e.strip() + "\n" for e in keep))
print(len(keep))
