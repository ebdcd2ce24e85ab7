"""The package's rooms (see each package's docstring): read from the sources' import statements (ast), not by
importing anything.

An import of ``a.b.c`` from a module outside ``a.b`` also runs ``a/b/__init__.py``: such edges count too.
Imports inside functions (lazy ones) count for cycles; what a room may load is what importing its modules
loads (module-level imports, followed) plus what their own functions import.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PKG = REPO / "vllm_fleet"


def _name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


FILES = {_name(p): p for p in sorted(PKG.rglob("*.py"))}
MODULES = set(FILES)


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _imports(name: str) -> list[tuple[str, bool]]:
    """(imported module, at module level) for every import statement of ``name``: our modules by their
    full name, third-party ones by their top-level name."""
    path = FILES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))
    found: list[tuple[str, bool]] = []

    def visit(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = top and not isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
            if isinstance(child, ast.Import):
                for alias in child.names:
                    found.append((alias.name, top))
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.split(".")[: len(package.split(".")) - (child.level - 1)]
                    mod = ".".join(base + ([child.module] if child.module else []))
                else:
                    mod = child.module or ""
                for alias in child.names:
                    sub = f"{mod}.{alias.name}"
                    found.append((sub if sub in MODULES else mod, top))
            visit(child, inner)

    visit(tree, True)
    out = []
    for target, top in found:
        if target.split(".")[0] != "vllm_fleet":
            out.append((target.split(".")[0], top))
            continue
        assert target in MODULES, f"{name} imports {target}, which is not a module of vllm_fleet"
        mine = {name, *_ancestors(name)}
        out += [(t, top) for t in [*_ancestors(target), target] if t not in mine]
    return out


IMPORTS = {name: _imports(name) for name in MODULES}


def _ours(edges: Iterable[tuple[str, bool]], *, top_only: bool = False) -> set[str]:
    return {t for t, top in edges if t in MODULES and (top or not top_only)}


def _loaded_by(names: Iterable[str]) -> set[str]:
    """Our modules that can be loaded by running ``names``: their direct imports (lazy ones too), followed
    through module-level imports."""
    todo = {t for n in names for t in _ours(IMPORTS[n])}
    seen: set[str] = set()
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo |= _ours(IMPORTS[n], top_only=True)
    return seen


def _cycles() -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), or a module importing itself."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(_ours(IMPORTS[v])):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in _ours(IMPORTS[v]):
                out.append(sorted(comp))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(MODULES)))
    for v in sorted(MODULES):
        if v not in index:
            strong(v)
    return out


def _room(prefix: str) -> list[str]:
    return sorted(n for n in MODULES if n == prefix or n.startswith(prefix + "."))


def test_the_rooms_exist() -> None:
    for room in ("vllm_fleet.fleet", "vllm_fleet.host", "vllm_fleet.bench", "vllm_fleet.devtools"):
        assert room in MODULES and len(_room(room)) > 1, room
        assert ast.get_docstring(ast.parse(FILES[room].read_text())), f"{room} has no docstring"


def test_no_import_cycle() -> None:
    assert _cycles() == []


def test_the_spec_is_the_leaf() -> None:
    # besides the contracts (the controller→host file formats: the service defaults), which are a leaf too
    assert _ours(IMPORTS["vllm_fleet.fleet.spec"]) <= {"vllm_fleet.contracts"}


def test_the_plan_checks_sit_below_the_plan() -> None:
    """fleet/plan_checks.py holds pure checks returning findings: it never loads the plan that composes them
    (nor what renders a plan), lazily either."""
    above = {"vllm_fleet.fleet.plan", "vllm_fleet.fleet.context", "vllm_fleet.fleet.render"}
    assert not {t for t, _ in IMPORTS["vllm_fleet.fleet.plan_checks"]} & above
    assert not _loaded_by(["vllm_fleet.fleet.plan_checks"]) & above
    assert "vllm_fleet.fleet.plan_checks" in _ours(IMPORTS["vllm_fleet.fleet.plan"])


def test_the_shared_leaves_use_the_standard_library_only() -> None:
    """vllm_fleet.contracts (the files one side writes and the other reads) and vllm_fleet.files (checksum,
    JSON reader) are shared by the controller and the hosts: they import none of ours and nothing outside the
    standard library (no pydantic, no jinja2)."""
    for leaf in ("vllm_fleet.contracts", "vllm_fleet.files"):
        imported = {t for t, _ in IMPORTS[leaf]}
        assert _ours(IMPORTS[leaf]) == set(), leaf
        assert {t.split(".")[0] for t in imported} <= set(sys.stdlib_module_names) | {"__future__"}, imported


def test_one_copy_of_the_file_helpers() -> None:
    """sha256_file, the JSON-object reader and the atomic JSON writer live in vllm_fleet/files.py only."""
    for name, path in FILES.items():
        tree = ast.parse(path.read_text())
        defs = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        if name != "vllm_fleet.files":
            assert not defs & {"sha256_file", "read_json_object", "_read_json", "write_json_atomic"}, name


def test_host_state_files_are_replaced_through_the_one_writer() -> None:
    """Host code replaces its state files with files.write_json_atomic: no other module of host/ renames a
    temp file over one (os.replace), but the gateway's drained-set file's writer (gateway_state.write_atomic:
    fsynced, and only while nginx's peer handler has not replaced the file meanwhile)."""
    renames = {
        name
        for name in _room("vllm_fleet.host")
        for n in ast.walk(ast.parse(FILES[name].read_text()))
        if isinstance(n, ast.Attribute)
        and n.attr in ("replace", "rename")
        and isinstance(n.value, ast.Name)
        and n.value.id == "os"
    }
    assert renames == {"vllm_fleet.host.gateway_state"}


def test_host_code_stays_off_the_planner_and_the_renderer() -> None:
    banned = {
        "vllm_fleet.fleet.plan",
        "vllm_fleet.fleet.plan_checks",
        "vllm_fleet.fleet.render",
        "vllm_fleet.fleet.context",
    }
    host = _room("vllm_fleet.host")
    for name in host:
        direct = {t for t, _ in IMPORTS[name]}
        assert not direct & (banned | {"jinja2"}), name
        loaded = _loaded_by([name])
        assert not loaded & banned, (name, sorted(loaded & banned))
        jinja = [n for n in loaded if "jinja2" in {t for t, top in IMPORTS[n] if top}]
        assert jinja == [], (name, jinja)


def test_the_controller_never_loads_host_code() -> None:
    """fleet/ decides on the controller from the spec and what the hosts reported, through the shared leaves
    (vllm_fleet.contracts: e.g. nvidia-smi's CSV); it never imports host/ code, lazily either ("nothing reaches
    backwards", docs/architecture.md)."""
    for name in _room("vllm_fleet.fleet"):
        host = sorted(n for n in _loaded_by([name]) if n.startswith("vllm_fleet.host"))
        assert host == [], (name, host)


def test_host_code_takes_only_the_typed_parts_of_fleet() -> None:
    """From fleet/, host code may import the engine's flag facts (standard library data), nothing else (the
    table in docs/architecture.md): what it needs of the spec comes in its contract file."""
    allowed = {"vllm_fleet.fleet", "vllm_fleet.fleet.engine_flags"}
    for name in _room("vllm_fleet.host"):
        fleet = {t for t in _ours(IMPORTS[name]) if t.startswith("vllm_fleet.fleet")}
        assert fleet <= allowed, (name, sorted(fleet - allowed))


SPEC_READERS = {"load_spec", "parse_spec"}
SPEC_SIDE = {"vllm_fleet.fleet.spec", "vllm_fleet.fleet.modelinfo"}


def _spec_reads(name: str) -> list[str]:
    """How module ``name`` reaches the spec: the spec-side modules it imports (lazily too) or loads through
    others, and each line that calls or names ``load_spec`` / ``parse_spec``."""
    direct = {t for t, _ in IMPORTS[name]} if name in IMPORTS else {t for t, _ in _imports(name)}
    found = sorted(direct & SPEC_SIDE)
    if name in IMPORTS:
        found += sorted(f"loads {t}" for t in _loaded_by([name]) & SPEC_SIDE)
    for n in ast.walk(ast.parse(FILES[name].read_text())):
        if isinstance(n, ast.Name) and n.id in SPEC_READERS:
            found.append(f"line {n.lineno}: {n.id}")
        elif isinstance(n, ast.Attribute) and n.attr in SPEC_READERS:
            found.append(f"line {n.lineno}: .{n.attr}")
        elif isinstance(n, ast.alias) and n.name.rpartition(".")[2] in SPEC_READERS:
            found.append(f"imports {n.name}")
    return found


def test_a_host_reads_its_contract_not_the_spec() -> None:
    """A host reads its host's contract file (CONFIG_DIR/host.json, ``contracts.HostContract``), not the
    whole spec: no module of host/ imports ``vllm_fleet.fleet.spec`` (lazily either, nor through another
    module, e.g. ``fleet.engine``) nor ``fleet.modelinfo``, and none calls or names ``load_spec`` /
    ``parse_spec``."""
    for name in _room("vllm_fleet.host"):
        assert _spec_reads(name) == [], name


def test_the_spec_check_sees_a_lazy_import_and_a_call(tmp_path: Path) -> None:
    """The check above fails on what it forbids: a lazy import of the spec inside a function, and its call."""
    fake = tmp_path / "fake.py"
    fake.write_text("def f(p):\n    from vllm_fleet.fleet import spec\n\n    return spec.load_spec(p)\n")
    FILES["vllm_fleet.host.fake"] = fake
    try:
        assert _spec_reads("vllm_fleet.host.fake") == ["vllm_fleet.fleet.spec", "line 4: .load_spec"]
    finally:
        del FILES["vllm_fleet.host.fake"]


def test_the_product_does_not_import_the_harness() -> None:
    product = [
        *_room("vllm_fleet.fleet"),
        *_room("vllm_fleet.host"),
        *_room("vllm_fleet.bench"),
        "vllm_fleet.cli",
        "vllm_fleet.host_commands",
        "vllm_fleet.file_lock",
        "vllm_fleet.files",
        "vllm_fleet.vllm_metrics",
        "vllm_fleet",
    ]
    for name in product:
        harness = sorted(n for n in _loaded_by([name]) if n.startswith("vllm_fleet.devtools"))
        assert harness == [], (name, harness)


BLOCK_DEVTOOLS = """
import sys


class NoDevtools:  # an installation without vllm_fleet/devtools: importing it fails as a missing module would
    def find_spec(self, name, path=None, target=None):
        if name == "vllm_fleet.devtools" or name.startswith("vllm_fleet.devtools."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, NoDevtools())
import vllm_fleet.cli as c

sys.exit(c.main(["--help"]))
"""


def test_cli_without_the_harness_offers_the_other_commands() -> None:
    """An installation without vllm_fleet/devtools: its commands (sandbox, tiny-model, tiny-adapter) are left out quietly,
    every other command is listed and none is marked unavailable."""
    from vllm_fleet import cli

    env = dict(os.environ, COLUMNS="200")
    r = subprocess.run([sys.executable, "-c", BLOCK_DEVTOOLS], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    harness = {name for name, p in cli.PLUGINS.items() if p.module.startswith("vllm_fleet.devtools.")}
    assert harness == {"sandbox", "tiny-model", "tiny-adapter"}
    listed = {m.group(1) for m in re.finditer(r"^    (\S+)", r.stdout, re.M)}
    assert listed == (set(cli.BUILTINS) | set(cli.PLUGINS)) - harness
    assert "UNAVAILABLE" not in r.stdout


# a default (or a rule's constant) and the one module that may write it (the others import it)
ONE_PLACE = [
    ("least_conn", "vllm_fleet.fleet.spec"),  # routing.policy's default
    ("PROBE_INTERVAL_PER_WATCHDOG", "vllm_fleet.contracts"),  # the watchdog timing rule
    ("PROBE_TIMEOUT_PER_WATCHDOG", "vllm_fleet.contracts"),
    ("SERVICE_DEFAULTS", "vllm_fleet.contracts"),  # the units' StartLimit*/TimeoutStartSec/RestartSec
    # idle upstream connections: the gateway keeps them shorter than the engine
    ("GATEWAY_UPSTREAM_KEEPALIVE_SECONDS", "vllm_fleet.contracts"),
    ("ENGINE_HTTP_KEEPALIVE_SECONDS", "vllm_fleet.contracts"),
    ("RETRY_AFTER_SECONDS", "vllm_fleet.host.stream_guard"),  # an engine's overload refusal
    (
        "/etc/vllm-fleet",
        "vllm_fleet.contracts",
    ),  # paths.config_dir's default, the host commands' --config-dir
]


def _written(name: str, tree: ast.AST, what: str) -> bool:
    """``what`` is written in ``tree``: a string constant equal to it, or an assignment to that name."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and node.value == what:
            return True
        if isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == what for t in targets):
                return True
    return False


def test_one_place_for_each_default() -> None:
    trees = {name: ast.parse(path.read_text()) for name, path in FILES.items() if ".devtools." not in name}
    for what, home in ONE_PLACE:
        where = sorted(n for n, t in trees.items() if _written(n, t, what))
        assert where == [home], f"{what} is written in {where}; only {home} may (the others import it)"
