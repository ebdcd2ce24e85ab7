"""Engine stacks on a host (ansible/roles/engine, run by the host's python3; standard library only).

argv: JSON {"stacks_dir", "new", "keep", "config_dir", "state_dir", "rollback_dir", "legacy"}; "new": the
stack this host runs, or a list of them (a host whose instances run several stacks, models[].stack). Prints JSON:
  seeds:  per new stack, the venv to hard-link it from (the newest stack with an install record, one of its own
          profile first, else the legacy single venv when it has a python), "" when there is none or the new
          stack exists already
  seed:   the first new stack's seed
  in_use: stacks an instance config, a rollback copy or a running engine (state file) names
  prune:  stack folders to remove: not the new one, not in use, and beyond ``keep`` stacks with those counted
Reads only.
"""

import json
import os
import sys


def stack_of(command):
    parts = (command or [""])[0].rstrip("/").split("/")
    return parts[-3] if len(parts) >= 3 and parts[-2] == "bin" else ""


def named(folder, key):
    out = set()
    if not os.path.isdir(folder):
        return out
    for f in os.listdir(folder):
        if not f.endswith(".json"):
            continue
        try:
            with open(os.path.join(folder, f)) as fh:
                d = json.load(fh)
        except (OSError, ValueError):
            continue
        if isinstance(d, dict):
            out.add(str(d.get("stack") or "") if key == "stack" else stack_of(d.get("command")))
    out.discard("")
    return out


a = json.loads(sys.argv[1])
root = a["stacks_dir"]
news = [a["new"]] if isinstance(a["new"], str) else list(a["new"])
stacks = []
if os.path.isdir(root):
    for name in os.listdir(root):
        marker = os.path.join(root, name, ".vllm-fleet-installed.json")
        when = os.stat(marker).st_mtime if os.path.exists(marker) else 0.0
        stacks.append((when, name))
stacks.sort(reverse=True)
in_use = (
    named(a["config_dir"], "command") | named(a["rollback_dir"], "command") | named(a["state_dir"], "stack")
)
keep = set(news) | in_use
# the stacks in use count toward ``keep`` (one more per further new stack): the other newest ones fill what is
# left (the previous one)
limit = int(a["keep"]) + len(news) - 1
kept = len(keep & {n for _, n in stacks} | set(news))
prune = []
for when, name in stacks:
    if name in keep:
        continue
    if when and kept < limit:
        kept += 1
        continue
    prune.append(os.path.join(root, name))
seeds = {}
for new in news:
    seed = ""
    if not os.path.exists(os.path.join(root, new, "bin", "python")):
        done = [n for w, n in stacks if w and n != new]
        # PROFILE-VERSION-HASH12: a stack of the same profile shares the most files
        done.sort(key=lambda n: n.split("-")[0] != new.split("-")[0])
        if done:
            seed = os.path.join(root, done[0])
        elif os.path.exists(os.path.join(a["legacy"], "bin", "python")):
            seed = a["legacy"]
    seeds[new] = seed
out = {
    "seed": seeds[news[0]] if news else "",
    "seeds": seeds,
    "in_use": sorted(in_use),
    "prune": sorted(prune),
}
print(json.dumps(out))
