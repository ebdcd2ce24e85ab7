#!/usr/bin/env python3
"""Count what makes the next change hard (docs/architecture.md, "Decide in Python: where it stands").

    tools/structure_counts.py [--rev REV]      the checkout, or a git revision (e.g. a749057)

Prints: the set_fact tasks of the roles (and those whose Jinja still decides: list filters, if/else, JSON
parsing), the lines of such Jinja in the roles; the tasks that pipe Python into ``python -c`` (and the role files run
that way); the bundle's own Ansible modules and the Python functions the roles call
(filters, lookups); the longest functions and classes of the package; the places
``routing.policy``'s default ("least_conn") is written in Python. Reads the files of the revision from git.
"""

from __future__ import annotations

import argparse
import ast
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def files(rev: str | None, prefix: str, suffix: str) -> dict[str, str]:
    if rev is None:
        return {
            str(p.relative_to(REPO)): p.read_text()
            for p in sorted((REPO / prefix).rglob(f"*{suffix}"))
            if p.is_file() and not p.is_symlink() and "module_utils" not in p.parts
        }
    names = subprocess.run(["git", "ls-tree", "-r", "--name-only", rev, prefix], cwd=REPO, capture_output=True,
                           text=True, check=True).stdout.split()  # fmt: skip
    out = {}
    for n in names:
        if n.endswith(suffix) and "module_utils" not in n:
            out[n] = subprocess.run(["git", "show", f"{rev}:{n}"], cwd=REPO, capture_output=True, text=True,
                                    check=True).stdout  # fmt: skip
    return out


def count(rev: str | None) -> dict[str, object]:
    tasks = files(rev, "ansible/roles", ".yml")
    set_facts = sum(
        len(re.findall(r"^\s*(?:- )?ansible\.builtin\.set_fact:", t, re.M)) for t in tasks.values()
    )
    # `- -c` in an argv list, '-c' in a templated argv, `python3 -c` in a shell command
    pipes = sum(
        len(re.findall(r"^\s*- -c\s*$", t, re.M))
        + len(re.findall(r"'-c'", t))
        + len(re.findall(r"python3? -c ", t))
        for t in tasks.values()
    )
    piped = sorted(p for p in files(rev, "ansible/roles", ".py") if "/files/" in p)
    # Jinja that decides: list filters, conditional expressions, parsing JSON output
    deciding = re.compile(
        r"selectattr|rejectattr|map\(|zip\(|combine\(|subelements|dict2items|from_json|\bif\b.*\belse\b"
    )
    jinja_lines = sum(
        1
        for t in tasks.values()
        for line in t.splitlines()
        if "{{" in line or line.strip().startswith(("|", "{%")) or deciding.search(line)
        if deciding.search(line) and not line.lstrip().startswith("#")
    )
    computing = 0
    for t in tasks.values():
        for m in re.finditer(r"ansible\.builtin\.set_fact:", t):
            nxt = re.search(r"^\s*- name:", t[m.end() :], re.M)
            body = t[m.end() : m.end() + nxt.start()] if nxt else t[m.end() :]
            body = "\n".join(x for x in body.splitlines() if not x.lstrip().startswith("#"))
            computing += bool(deciding.search(body))
    filters = files(rev, "ansible/plugins/filter", ".py")
    called = sorted(
        set(re.findall(r"\bvllm_fleet_[a-z_]+(?=\()|(?<=\| )vllm_fleet_[a-z_]+", "\n".join(tasks.values())))
    )
    python_calls = sorted(
        n for n in called if any(f'"{n.removeprefix("vllm_fleet_")}"' in f for f in filters.values())
    ) + sorted(set(re.findall(r"query\('(vllm_fleet_[a-z_]+)'", "\n".join(tasks.values()))))
    modules = sorted(Path(p).stem for p in files(rev, "ansible/plugins/modules", ".py"))
    funcs: list[tuple[int, str]] = []
    classes: list[tuple[int, str]] = []
    policy = 0
    for path, text in files(rev, "vllm_fleet", ".py").items():
        if "/devtools/" in path:
            continue
        tree = ast.parse(text)
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                funcs.append((node.end_lineno - node.lineno + 1, f"{path}:{node.lineno} {node.name}"))  # type: ignore[operator]
            elif isinstance(node, ast.ClassDef):
                classes.append((node.end_lineno - node.lineno + 1, f"{path}:{node.lineno} {node.name}"))  # type: ignore[operator]
            elif isinstance(node, ast.Constant) and node.value == "least_conn":
                policy += 1
    return {
        "set_fact tasks in the roles": set_facts,
        "set_fact tasks with list filters, if/else or JSON parsing in their Jinja": computing,
        "lines with list filters, if/else or JSON parsing in the roles' tasks and vars": jinja_lines,
        "python -c pipes in the roles": pipes,
        "Python files the roles run through python -c": piped,
        "the bundle's Ansible modules": modules,
        "Python decisions the roles call (vllm_fleet_* filters and lookups)": python_calls,
        "longest functions": [f"{n} lines {w}" for n, w in sorted(funcs, reverse=True)[:5]],
        "longest classes": [f"{n} lines {w}" for n, w in sorted(classes, reverse=True)[:3]],
        # the spec's Literal names it and its default is it: 2 is the floor
        "string constants 'least_conn' in the package (routing.policy's default)": policy,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Count set_facts, python -c pipes, long functions, defaults.")
    ap.add_argument("--rev", help="a git revision instead of the checkout")
    a = ap.parse_args(argv)
    for k, v in count(a.rev).items():
        if isinstance(v, list):
            print(f"{k}: {len(v)}")
            for x in v:
                print(f"    {x}")
        else:
            print(f"{k}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
