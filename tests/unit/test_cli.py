"""The command line: plugin commands are imported lazily, and a plugin module that fails to import breaks only
its own command."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_fleet import cli

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def broken_plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A plugin command whose module raises on import."""
    (tmp_path / "vf_broken_plugin.py").write_text('raise RuntimeError("boom: broken on import")\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("COLUMNS", "200")  # argparse wraps help lines at the terminal width
    monkeypatch.setitem(cli.PLUGINS, "broken", cli.Plugin("vf_broken_plugin:add_args", "a broken plugin"))
    return "broken"


def help_text(args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """What ``vllm-fleet ARGS --help`` prints (argparse exits 0 after printing it)."""
    with pytest.raises(SystemExit) as exc:
        cli.main([*args, "--help"])
    assert exc.value.code == 0
    return capsys.readouterr().out


def test_builtin_command_runs_with_a_broken_plugin(
    broken_plugin: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert "usage: vllm-fleet plan" in help_text(["plan"], capsys)
    assert cli.main(["validate", str(REPO / "examples" / "seed-004-4xa100.yml")]) == 0
    assert "valid" in capsys.readouterr().out


def test_plugin_command_runs_with_a_broken_plugin(
    broken_plugin: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert "usage: vllm-fleet manifest" in help_text(["manifest"], capsys)


def test_help_lists_every_command_and_marks_the_broken_one(
    broken_plugin: str, capsys: pytest.CaptureFixture[str]
) -> None:
    out = help_text([], capsys)
    for name in (*cli.BUILTINS, *cli.PLUGINS):
        assert f"    {name} " in out or f"    {name}\n" in out, name
    broken_line = next(line for line in out.splitlines() if line.strip().startswith("broken"))
    assert "UNAVAILABLE" in broken_line and "vf_broken_plugin" in broken_line
    assert "RuntimeError" in out and "boom" in out


def test_the_broken_command_itself_fails_loudly(broken_plugin: str) -> None:
    with pytest.raises(RuntimeError, match="boom"):
        cli.main(["broken"])


def test_the_plugin_table_is_the_one_list_of_commands(capsys: pytest.CaptureFixture[str]) -> None:
    """Every PLUGINS entry names a function of its module (the module registers nothing itself), and the
    parser offers exactly the built-ins and the table."""
    for name, plugin in cli.PLUGINS.items():
        add_args = plugin.add_args()
        assert callable(add_args) and add_args.__module__ == plugin.module, name
        assert plugin.help, name
    parser = cli.build_parser()
    choices = next(a.choices for a in parser._actions if a.dest == "cmd")
    assert choices is not None
    assert set(choices) == set(cli.BUILTINS) | set(cli.PLUGINS)


@pytest.mark.parametrize("name", ["h200.yml", "h200-burst.yml", "h200-unit.yml", "h200-sleep.yml"])
def test_the_gpu_lab_specs_plan_with_the_lab_flags_only(
    name: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/gpu-validation.md's specs run the carried vLLM 0.21.0: no lock and no captured argument list, so a
    plain plan refuses them (as it must for a deploy) and the device scripts pass the two lab flags
    (tools/gpu-validate/measure.py LAB). Both halves are checked: a check added to the planner that the lab
    flags do not lift would break the GPU procedure, as the per-stack lock check once did unnoticed."""
    monkeypatch.chdir(REPO)  # ./locks is where the default lock folder is found
    spec = str(REPO / "tools/gpu-validate" / name)
    assert cli.main(["plan", spec]) == 1
    out = capsys.readouterr().out
    assert "no lock locks/gpu-0.21.0.txt" in out and "no captured argument list" in out
    assert cli.main(["plan", spec, "--lock-dir", "", "--allow-unchecked-flags"]) == 0, capsys.readouterr().out
