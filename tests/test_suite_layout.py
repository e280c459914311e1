"""The suite's own layout: no module in tests/ or scripts/ imports a test file or conftest. What two test files
share lives in tests/support/ (a fixture in tests/conftest.py, which pytest hands every test by name), so a test
file can move, be renamed or be run alone without another file's tests being collected along with it."""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEST_MODULE = re.compile(r"(tests\.)?(test_\w+|conftest)")


def _imported(tree: ast.AST) -> set[str]:
    """Dotted names each absolute import in the tree can bind (module-level or inside functions)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return found


def imports_of_test_modules(folders: list[Path]) -> list[str]:
    """'<file> imports <test module>' for every such import under the folders."""
    return sorted(f"{path.relative_to(folder.parent)} imports {name}"
                  for folder in folders for path in folder.rglob("*.py")
                  for name in _imported(ast.parse(path.read_text(encoding="utf-8")))
                  if TEST_MODULE.fullmatch(name))


def test_no_module_imports_a_test_file_or_conftest():
    assert imports_of_test_modules([ROOT / "tests", ROOT / "scripts"]) == []


def test_the_check_finds_each_spelling_of_such_an_import(tmp_path):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_b.py").write_text(
        "from tests.test_a import helper\nimport tests.test_c\n\ndef f():\n    from tests.conftest import GPU\n")
    (tmp_path / "tests" / "test_d.py").write_text("from tests import test_a\nfrom tests.support.x import test_y\n")
    assert imports_of_test_modules([tmp_path / "tests"]) == [
        "tests/test_b.py imports tests.conftest", "tests/test_b.py imports tests.test_a",
        "tests/test_b.py imports tests.test_c", "tests/test_d.py imports tests.test_a"]
