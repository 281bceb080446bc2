"""The repository keeps its promises: .ci/run runs README.md's test command; every module has __all__;
the README's table of environment switches names every FREESOLO_* variable the package reads."""

from __future__ import annotations

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _bash_blocks(text: str) -> list[str]:
    blocks, inside, current = [], False, []
    for line in text.splitlines():
        if line.strip().startswith("```bash"):
            inside, current = True, []
        elif inside and line.strip().startswith("```"):
            inside = False
            blocks.append("\n".join(current).strip())
        elif inside:
            current.append(line)
    return blocks


def test_readme_has_two_setup_commands_and_ci_runs_the_test_one():
    blocks = _bash_blocks((ROOT / "README.md").read_text())
    assert len(blocks) == 2, blocks
    main_job, tests = blocks
    assert "freesolo scaling" in main_job
    assert "pytest" in tests
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert tests in ci_lines, "the README's test command must appear verbatim in .ci/run"


def test_every_module_defines_all():
    missing = []
    for path in (ROOT / "freesolo").rglob("*.py"):
        tree = ast.parse(path.read_text())
        names = {
            t.id for node in tree.body if isinstance(node, ast.Assign) for t in node.targets if isinstance(t, ast.Name)
        }
        if "__all__" not in names:
            missing.append(str(path.relative_to(ROOT)))
    assert not missing, f"modules without __all__: {missing}"


def test_readme_lists_every_environment_switch():
    """Every "FREESOLO_..." string literal of the package (a variable it reads) has a row in the README's
    "Environment switches" table, and every row names one that exists."""
    texts = [path.read_text() for path in (ROOT / "freesolo").rglob("*.py")]
    read = {name for text in texts for name in re.findall(r'"(FREESOLO_[A-Z0-9_]+)"', text)}
    # minus Python names exported by an __all__ (e.g. models.FREESOLO_ATTENTIONS): assigned at module level
    read = {name for name in read if not any(re.search(rf"^{name} = ", text, re.MULTILINE) for text in texts)}
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Environment switches", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"^\| `(FREESOLO_[A-Z0-9_]+)` \|", section, flags=re.MULTILINE))
    assert read - listed == set(), f"read by the package, missing from the README table: {sorted(read - listed)}"
    assert listed - read == set(), f"in the README table, read nowhere: {sorted(listed - read)}"
