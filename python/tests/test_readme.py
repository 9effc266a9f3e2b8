"""The README's promise: every shell command it gives a user is run by CI (.ci/run) exactly as written. Each
line of the README's ```bash blocks (comments stripped) must appear verbatim as a line of .ci/run."""
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]


def readme_commands():
    text = (ROOT / "README.md").read_text()
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            if line and not line.startswith("#"):
                commands.append(line)
    return commands


def test_readme_has_commands():
    commands = readme_commands()
    assert "pip install ." in commands and "pytest python/tests" in commands, commands


def test_every_readme_command_runs_in_ci():
    ci_lines = {line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()}
    ci_text = (ROOT / ".ci" / "run").read_text()
    missing = [c for c in readme_commands()
               if c not in ci_lines and not re.search(r"expect_no_gpu " + re.escape(c) + r"$", ci_text, re.M)]
    assert not missing, f"README commands that .ci/run does not run verbatim: {missing}"


def test_no_issue_numbers_in_readme():
    text = (ROOT / "README.md").read_text()
    assert not re.search(r"\b[Ii]ssue \d+|\bround \d+", text), "the README is the user's page: no issue numbers or rounds"
