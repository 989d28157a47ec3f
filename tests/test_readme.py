"""The README's quick start is a contract: two set-up commands, the second of which CI runs verbatim."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def quick_start_commands() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    return [line for line in block.splitlines() if line.strip() and not line.startswith("#")]


def test_quick_start_has_two_commands_and_ci_runs_the_test_command():
    commands = quick_start_commands()
    assert len(commands) == 2
    assert "spes simulate" in commands[0] and "pytest" in commands[1]
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert commands[1] in ci
