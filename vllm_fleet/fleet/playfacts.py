"""What the play decides from the hosts' answers, in Python: the roles call these through their ``vllm_fleet``
filters (ansible/plugins/filter/vllm_fleet_filters.py) and only print the results (docs/architecture.md, "Decide in
Python"). What follows from the spec alone is decided earlier, once per deploy: ``fleet/hostplan.py``.

Each function takes what a task registered (a module's or a command's result, as Ansible holds it) and returns
plain JSON values, so that the same function is unit-tested without Ansible (tests/unit/test_playfacts.py).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from vllm_fleet.contracts import is_adapters_file

# what the doctor's verdict of a layer is when the doctor gave none (it crashed, or printed no JSON)
_NO_ANSWER_FIX = "run vllm-fleet doctor on the host by hand to see why (docs/ansible.md)"
# units a listener on a planned port may belong to: vllm-fleet's own (a redeploy finds its services running)
OWN_UNITS = re.compile(r"^(vllm@.*|vllm-fleet.*|nginx|prometheus.*)\.service$")
# systemctl's UnitFileState values Ansible's systemd_service counts as enabled (`is-enabled` exits 0)
ENABLED_STATES = frozenset({"enabled", "enabled-runtime", "static", "generated", "transient"})
_INSTANCE_UNIT = re.compile(r"^vllm(-worker)?@.+[.]service$")


def _doctor_layers(run: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The layers of a doctor run: the vllm_fleet_doctor module's ``layers``, else the JSON list a
    ``vllm-fleet doctor --json`` command printed; [] when it printed none."""
    if isinstance(run.get("layers"), list):
        return list(run["layers"])
    out = str(run.get("stdout") or "")
    if out.lstrip().startswith("["):
        try:
            got = json.loads(out)
        except ValueError:
            return []
        return got if isinstance(got, list) else []
    return []


def layer_verdict(run: Mapping[str, Any], layer: str, host: str) -> dict[str, Any]:
    """The doctor's verdict of ``layer`` in ``run`` with the message its "Doctor layer: NAME" task shows:
    ``HOST LAYER: STATUS detail - fix: what to do``. A doctor that gave no verdict is a failure that says how it
    ended (its exit code and the last line of its error output)."""
    by_name = {v.get("name"): v for v in _doctor_layers(run)}
    v = by_name.get(layer)
    if v is None:
        err = str(run.get("stderr") or run.get("msg") or "").strip().splitlines()[-1:]
        v = {
            "status": "fail",
            "fix": _NO_ANSWER_FIX,
            "detail": f"the doctor did not answer (exit {run.get('rc', '?')}: {''.join(err)})",
        }
    status = str(v.get("status", "fail"))
    fix = str(v.get("fix") or "")
    msg = f"{host} {layer}: {status.upper()} {v.get('detail', '')}" + (f" - fix: {fix}" if fix else "")
    return {
        "status": status,
        "detail": v.get("detail", ""),
        "fix": fix,
        "failed": status == "fail",
        "msg": msg,
        "facts": v.get("facts") or {},
    }


def packages_for(by_key: Mapping[str, list[str]], keys: Iterable[str]) -> list[str]:
    """The Debian packages of ``keys``, each once, in order: an engine host's by the profiles it runs
    (``vf.profiles``), a host's monitoring packages by its monitoring roles (``vf.monitoring_roles``)."""
    return list(dict.fromkeys(p for key in keys for p in by_key.get(key, [])))


def _project(name: str) -> str:
    """A project name as the wheel index compares it (lower case, runs of ``-_.`` as one ``-``)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def tools_wheels(paths: Iterable[str], packages: Iterable[str]) -> list[str]:
    """The wheels among ``paths`` (a wheelhouse's files) of ``packages`` (by the project name a wheel's file
    name starts with): what a host without engines needs of the fleet's wheelhouse for vllm-fleet's own venv,
    instead of every engine wheel (torch and all)."""
    want = {_project(p) for p in packages}
    return sorted(p for p in paths if p.endswith(".whl") and _project(Path(p).name.split("-", 1)[0]) in want)


def missing_packages(wanted: Iterable[str], dpkg_lines: Iterable[str]) -> list[str]:
    """``wanted`` minus what ``dpkg-query --show --showformat='${Package} ${db:Status-Status}\\n'`` lists as
    installed (dpkg-query names an unknown package on stderr only)."""
    installed = {line.split(" ", 1)[0] for line in dpkg_lines if line.rstrip().endswith(" installed")}
    return [p for p in wanted if p not in installed]


def foreign_listeners(listeners: Mapping[str, Mapping[str, Any]], owners: Mapping[str, str]) -> list[str]:
    """The planned ports another program listens on (not a vllm-fleet unit), each as ``PORT (FIELD) by COMM
    pid PID unit UNIT``: the preflight refuses the host with these."""
    out = []
    for port, p in listeners.items():
        if OWN_UNITS.match(str(p.get("unit") or "")):
            continue
        owner = owners.get(str(port), "?")
        out.append(f"{port} ({owner}) by {p.get('comm')} pid {p.get('pid')} unit {p.get('unit') or '-'}")
    return out


def unit_actions(
    planned: list[str],
    units: Mapping[str, Mapping[str, str]],
    enabled_links: Iterable[str],
    new_files: Iterable[str] = (),
    check_mode: bool = False,
    autostart: Iterable[str] | None = None,
) -> dict[str, Any]:
    """What the engine role does with the host's units, from what systemd answered (the vllm_fleet_host_state
    module's ``units``, and the ``*.wants/`` links of enabled instances): ``running`` the planned units already
    running (those restart rolling, not start), ``enabled`` the units systemd counts as enabled (a link, or a
    state ``is-enabled`` accepts), ``to_enable`` the planned units not enabled yet, ``stale`` the instances and
    workers on the host that the spec no longer has (stopped and disabled), ``enable_target`` whether
    vllm-fleet.target is to be enabled, ``to_start`` the planned ``vllm@`` instance units to start (not running).
    Only the ``autostart`` units (default: every planned one) are enabled and started: a canary is planned (its
    unit is not stale) but runs only during `vllm-fleet rollout`. In check mode a unit whose template file this
    run would create (``new_files``, not on the host yet) cannot be enabled, so it is left out."""
    links = [str(x).rsplit("/", 1)[-1] for x in enabled_links]
    enabled = [u for u, s in units.items() if s.get("UnitFileState") in ENABLED_STATES]
    running = {u for u, s in units.items() if s.get("SubState") == "running"}
    known = list(dict.fromkeys([*units, *links]))
    new = [str(f).rsplit("/", 1)[-1] for f in new_files] if check_mode else []
    auto = set(planned if autostart is None else autostart)
    to_enable = [
        u for u in planned if u in auto and u not in enabled and f"{u.split('@', 1)[0]}@.service" not in new
    ]
    return {
        "running": [u for u in planned if u in running],
        "to_start": [u for u in planned if u in auto and u.startswith("vllm@") and u not in running],
        "enabled": enabled,
        "to_enable": to_enable,
        "enable_target": "vllm-fleet.target" not in enabled and "vllm-fleet.target" not in new,
        "stale": [u for u in known if _INSTANCE_UNIT.match(u) and u not in planned],
    }


def by_name(config: Mapping[str, Any]) -> dict[str, Any]:
    """An instance config read on a host as ``{its name: it}`` (the preflight merges them into the ``--deployed``
    map of `vllm-fleet plan` / `context`)."""
    return {str(config["name"]): dict(config)}


def held(
    held_models: Mapping[str, str], configs: Iterable[str], promote: str | Iterable[str] = ""
) -> list[str]:
    """The instances whose change the play holds for `vllm-fleet rollout` (docs/rollouts.md): those of a served
    model with a ``rollouts`` entry (``held_models``: instance -> served model, ``vf.held``) that already have a
    config on the host (``configs``: its instance config files; a first deploy just writes it), unless the run
    promotes their model (``promote``: ``-e vllm_fleet_rollout_promote=MODEL[,MODEL]``)."""
    names = {str(c).rsplit("/", 1)[-1].removesuffix(".json") for c in configs if not is_adapters_file(c)}
    if isinstance(promote, str):
        promote = [p for p in promote.split(",") if p.strip()]
    promoted = {str(p).strip() for p in promote}
    return [n for n, model in held_models.items() if n in names and model not in promoted]


def restarts(
    instances: list[Mapping[str, Any]],
    changed: list[Mapping[str, Any]],
    model_changed: Iterable[str],
    launcher_changed: bool,
    pending: Iterable[str] = (),
) -> list[str]:
    """The instances of a host to restart, by name: every one when the launcher (vllm-fleet in the fleet's own
    venv) or the shared unit ``vllm@.service`` changed; else those whose own artifacts changed (``changed``:
    the artifacts role's written items, ``instance_name`` set for per-instance files; not a file whose
    ``on_change`` is ``adapters_sync``, the adapters file: ``adapter_syncs``) or whose model folder changed;
    plus the restarts an earlier, failed run left ``pending``. Never a canary: `vllm-fleet rollout` starts and
    stops it (a running one keeps running what it started with)."""
    canaries = {str(i["name"]) for i in instances if i.get("role") == "canary"}
    names = [str(i["name"]) for i in instances if str(i["name"]) not in canaries]
    shared_unit = any(
        not a.get("instance_name") and str(a.get("dest", "")).endswith("vllm@.service") for a in changed
    )
    if launcher_changed or shared_unit:
        out = names
    else:
        models = set(model_changed)
        out = [str(a["instance_name"]) for a in changed if a.get("instance_name") and _restarts_it(a)]
        out += [str(i["name"]) for i in instances if i.get("model_path") in models]
    out = [n for n in out if n not in canaries]
    return list(dict.fromkeys([*out, *(str(p).rsplit("/", 1)[-1] for p in pending)]))


def _restarts_it(artifact: Mapping[str, Any]) -> bool:
    """Whether a changed per-instance artifact restarts its instance (``on_change``, default ``restart``)."""
    return str(artifact.get("on_change") or "restart") == "restart"


def adapter_syncs(
    instances: list[Mapping[str, Any]],
    changed: list[Mapping[str, Any]],
    adapters_changed: Iterable[str],
    running: Iterable[str],
    restart: Iterable[str] = (),
) -> list[dict[str, Any]]:
    """The running LoRA instances of a host whose adapters this run changed, each with what
    ``vllm-fleet adapters sync INSTANCE [--reload ADAPTER ...]`` is to do (docs/lora.md): ``instance``, and
    ``reload`` the adapters of its served model whose files changed (``adapters_changed``: ``fetched``'s). An
    instance is synced when its adapters file changed (``changed``: the artifacts role's written items, its
    ``on_change: adapters_sync`` file) or an adapter of its file did; only when its unit was running before this
    run (``running``: ``unit_actions``' running units) and it does not restart now (``restart``: it loads its
    adapters when it starts)."""
    up, restarting = set(running), set(restart)
    files = {str(a["instance_name"]) for a in changed if a.get("instance_name") and not _restarts_it(a)}
    new_files = set(adapters_changed)
    out: list[dict[str, Any]] = []
    for i in instances:
        name = str(i["name"])
        if not i.get("lora_on") or i.get("unit") not in up or name in restarting:
            continue
        reload = [str(a["name"]) for a in i.get("adapters") or [] if a["name"] in new_files]
        if name in files or reload:
            out.append({"instance": name, "reload": reload})
    return out


def rolling_restarts(
    instances: list[Mapping[str, Any]], restart: Iterable[str], running: Iterable[str]
) -> list[str]:
    """Of ``restart``, the instances whose unit was running before this run (in spec order): the others just
    started fresh with their new files."""
    wanted, up = set(restart), set(running)
    return [str(i["name"]) for i in instances if i["name"] in wanted and i["unit"] in up]


def artifact_items(
    artifacts: list[Mapping[str, Any]], component: str, which: str = "all", hold: Iterable[str] = ()
) -> list[dict[str, Any]]:
    """The artifacts of ``component`` (``vf.artifacts``) the artifacts role renders: ``instance`` the
    per-instance files, ``shared`` the others, ``all`` both; never the files of the instances in ``hold``
    (``held``) that would restart them."""
    held = set(hold)
    # a held instance keeps its files, but its adapters file (a change of it restarts nothing)
    mine = [
        dict(a)
        for a in artifacts
        if a.get("component") == component
        and not (a.get("instance_name") and a["instance_name"] in held and _restarts_it(a))
    ]
    if which == "instance":
        return [a for a in mine if a.get("instance_name")]
    if which == "shared":
        return [a for a in mine if not a.get("instance_name")]
    return mine


def host_files(
    wanted: list[Mapping[str, Any]], owner: str = "root", group: str = "root"
) -> list[dict[str, Any]]:
    """What the vllm_fleet_host_state module compares for rendered artifacts: path, checksum, mode, owner."""
    return [
        {"path": w["path"], "checksum": w["checksum"], "mode": w["mode"], "owner": owner, "group": group}
        for w in wanted
    ]


def artifacts_outcome(
    written: list[Mapping[str, Any]], wanted: list[Mapping[str, Any]], missing: Iterable[str]
) -> dict[str, Any]:
    """What the artifacts role reports from its copy results (``written``): ``changed`` the written items
    (without their content), ``missing`` the destinations that were not on the host (check mode: a unit this
    run would create cannot be enabled yet), ``units_changed`` whether a systemd unit changed (a daemon
    reload)."""
    changed = [
        {k: v for k, v in r["item"].items() if k not in ("content", "checksum", "path")}
        for r in written
        if r.get("changed")
    ]
    gone = set(missing)
    return {
        "changed": changed,
        "missing": [w["dest"] for w in wanted if w["path"] in gone],
        "units_changed": any(str(c.get("dest", "")).startswith("/etc/systemd/") for c in changed),
    }


def fetched(
    fetch: Mapping[str, Any], pushed: list[Mapping[str, Any]], adapter_paths: Iterable[str] = ()
) -> dict[str, Any]:
    """What the models step changed, from ``vllm-fleet fetch --json`` (``fetch``, skipped when the models
    were pushed from the controller) and the push's copy results (``pushed``): ``changed`` the model folders
    whose files changed (their instances restart), ``models`` each fetched instance's report (its config.json
    and weight bytes: the plan after the fetch reads them), ``adapters_changed`` the LoRA adapters whose files
    changed (fetched, or pushed into one of ``adapter_paths``, ``vf.adapter_paths``: ``adapter_syncs`` reloads
    them; never a restart) and ``adapters`` each fetched adapter's report."""
    report: dict[str, Any] = {}
    if not fetch.get("skipped") and str(fetch.get("stdout") or "").strip():
        report = json.loads(fetch["stdout"])
    models = list(report.get("models") or [])
    adapters = list(report.get("adapters") or [])
    folders = set(adapter_paths) | {str(a["path"]) for a in adapters}
    changed = [str(m["path"]) for m in models if m.get("changed")]
    changed += [str(r["item"]["model_path"]) for r in pushed if r.get("changed")]
    pushed_adapters = {p for p in changed if p in folders}
    adapters_changed = [
        str(a["adapter"]) for a in adapters if a.get("changed") or str(a["path"]) in pushed_adapters
    ]
    return {
        "changed": list(dict.fromkeys(p for p in changed if p not in folders)),
        "models": {m["instance"]: m for m in models},
        "adapters_changed": list(dict.fromkeys(adapters_changed)),
        "adapters": {a["adapter"]: a for a in adapters},
    }


def host_detected(
    fetched: Mapping[str, Any], memory_mib: Any, nvidia_smi: str, gpu_host: bool
) -> dict[str, Any]:
    """What one host tells the plan after the fetch (``vllm-fleet plan --detected``): its memory, the GPUs
    nvidia-smi listed (the preflight's driver layer; none on a host without a gpu stack) and the fetched
    models' reports (``fetched``'s ``models``)."""
    return {
        "memory_mib": int(memory_mib or 0),
        "nvidia_smi": nvidia_smi if gpu_host else "",
        "models": dict(fetched.get("models") or {}),
    }


def _local_files(local: list[Mapping[str, Any]]) -> list[tuple[str, Mapping[str, Any]]]:
    """(model_path, found file) of each file ``ansible.builtin.find`` listed under a model folder on the
    controller (its loop item: the model_path on the host)."""
    return [(str(r["item"]), f) for r in local if not r.get("skipped") for f in r.get("files") or []]


def model_tree(local: list[Mapping[str, Any]], models_src: str) -> dict[str, Any]:
    """The ``tree`` argument of the vllm_fleet_host_state module for model folders pushed from the controller
    (``-e vllm_fleet_models_src=DIR``: DIR/BASENAME -> the model_path on the host), from the find results
    (``local``, with checksums); {} when nothing is pushed."""
    if not local or all(r.get("skipped") for r in local):
        return {}
    roots = {f"{models_src}/{str(r['item']).rsplit('/', 1)[-1]}": str(r["item"]) for r in local}
    return {
        "roots": roots,
        "files": [{"path": f["path"], "checksum": f["checksum"]} for _, f in _local_files(local)],
        "mode": "0644",
        "dir_mode": "0755",
        "owner": "root",
        "group": "root",
    }


def model_pushes(local: list[Mapping[str, Any]], models_src: str) -> list[dict[str, str]]:
    """Each file to push from the controller: ``src`` (DIR/BASENAME/REL), ``dest`` (model_path/REL) and
    ``model_path`` (whose instances restart when it changed)."""
    out = []
    for model_path, f in _local_files(local):
        root = f"{models_src}/{model_path.rsplit('/', 1)[-1]}"
        out.append({"src": f["path"], "dest": model_path + f["path"][len(root) :], "model_path": model_path})
    return out


def found_in_stack(globs: Mapping[str, list[str]], stack: str) -> list[str]:
    """The packages whose dist-info the host's state read found in ``stack``'s venv (its ``STACK/PACKAGE``
    glob keys with a match)."""
    return [k.split("/", 1)[1] for k, hits in globs.items() if hits and k.startswith(f"{stack}/")]


def running_services(units: Mapping[str, Mapping[str, str]]) -> list[str]:
    """The services (names without ``.service``) systemd reports enabled and active or activating: starting
    and enabling them would change nothing."""
    return [
        u.removesuffix(".service")
        for u, st in units.items()
        if st.get("ActiveState") in ("active", "activating") and st.get("UnitFileState") in ENABLED_STATES
    ]


def lock_checks(
    host_stacks: list[Mapping[str, Any]],
    fleet_stack: Mapping[str, Any],
    lock_dir: str,
    host_python: str,
    host_machine: str,
    host: str,
) -> list[dict[str, str]]:
    """Each lock this host installs from (its stacks' and the fleet's own: that lock feeds the fleet's venv),
    on the controller (``lock_dir``/PROFILE-VERSION.txt), with what is wrong with it for this host ('' =
    nothing): missing, or resolved for another Python (major.minor) or platform (its wheels' tags and hashes
    fit no other: a Python 3.12 host would fail on the hashes halfway through the install)."""
    from vllm_fleet.fleet.lock import lock_python

    stacks = {"default": {**fleet_stack, "name": "default"}}
    for s in host_stacks:
        stacks.setdefault(str(s["name"]), dict(s))
    out = []
    for name, s in stacks.items():
        field = "stack" if name == "default" else f"stacks.{name}"
        profile, version = s["profile"], s["vllm_version"]
        path = f"{lock_dir}/{profile}-{version}.txt"
        try:
            text = Path(path).read_text()
        except OSError:
            problem = (
                f"No lock {path} for {field}.profile {profile} / {field}.vllm_version {version}: run "
                f"`vllm-fleet lock --profile {profile} --vllm-version {version}`"
            )
        else:
            got = lock_python(text)
            problem = (
                ""
                if got == (host_python, host_machine)
                else f"{host} has Python {host_python} on {host_machine}, the lock {Path(path).name} is for "
                f"Python {got[0] if got else '(not recorded)'} on {got[1] if got else '(not recorded)'}: resolve a "
                "lock with that Python (`vllm-fleet lock --python PYTHON3.X ...`) or deploy to hosts that match"
            )
        out.append({"name": name, "lock": path, "problem": problem})
    return out


def wheel_sources(lock_file: str, wheelhouse: str, wheelhouse_remote: str, prefix: str) -> dict[str, str]:
    """Where the fleet's own stack installs from: ``install_lock`` (the wheelhouse's own lock copy when the
    play pushes a wheelhouse: it adds the hashes of wheels built there from locked sources; else the lock of the
    stack's profile and release) and ``host_wheelhouse``, the wheel folder pip reads on the host (one the user
    placed there, else PREFIX/wheelhouse when the play pushes one, '' = online install)."""
    return {
        "install_lock": f"{wheelhouse}/lock.txt" if wheelhouse else lock_file,
        "host_wheelhouse": wheelhouse_remote or (f"{prefix}/wheelhouse" if wheelhouse else ""),
    }


def pip_source_args(host_wheelhouse: str, torch_index_url: str) -> list[str]:
    """Where pip finds wheels: the wheel folder on the host (offline), else the torch index (if any)."""
    if host_wheelhouse:
        return ["--no-index", "--find-links", host_wheelhouse]
    return ["--extra-index-url", torch_index_url] if torch_index_url else []


def vrrp_interface(ip_addresses: str | list[Mapping[str, Any]], address: str) -> str:
    """The interface that carries ``address`` on a gateway host: where keepalived puts gateway.virtual_address
    when gateway.vrrp.interface is not set (the gateway role's ``vllm_fleet_vrrp_interface``). ``ip_addresses``:
    what ``ip -json -4 address show`` printed (the text, or the list it parses to). A host that does not hold
    ``address`` (or holds it on the loopback, or twice) is an error that names it: keepalived cannot run there."""
    links = json.loads(ip_addresses) if isinstance(ip_addresses, str) else ip_addresses
    found = [
        str(link.get("ifname", ""))
        for link in links or []
        for a in link.get("addr_info") or []
        if a.get("family", "inet") == "inet" and a.get("local") == address
    ]
    if len(found) != 1:
        why = "holds it on " + ", ".join(found) if found else "does not hold it"
        raise ValueError(f"no interface for VRRP: this host {why} ({address}); set gateway.vrrp.interface")
    if found[0] == "lo":
        raise ValueError(f"{address} is on the loopback: VRRP needs the interface of the gateways' network")
    return found[0]
