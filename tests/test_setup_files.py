"""The setup files agree with each other."""

from __future__ import annotations

import re
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]


def _pip_section(text: str) -> list[str]:
    lines, inside = [], False
    for line in text.splitlines():
        if re.match(r"\s*- pip:\s*$", line):
            inside = True
        elif inside and re.match(r"\s{6,}- ", line):
            lines.append(line.split("- ", 1)[1].strip())
        elif inside and line.strip():
            inside = False
    return lines


def test_environment_yml_matches_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    wanted = project["dependencies"] + extras["test"] + extras["e2e"] + extras["book"]
    listed = [
        p for p in _pip_section((ROOT / "environment.yml").read_text()) if not p.startswith("-e")
    ]
    assert sorted(listed) == sorted(wanted)


def test_readme_starts_with_the_two_commands_and_ci_runs_the_test_one():
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```(?:\w+)?\n(.*?)```", readme, re.S)
    assert blocks and blocks[0].split("\n")[:2] == ["make lab", "make test"]
    assert "make test" in (ROOT / ".ci" / "run").read_text()
