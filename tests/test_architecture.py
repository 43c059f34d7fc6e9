"""The architecture as a contract: the layers of docs/architecture.md, checked by import-linter.

The contract lives in pyproject.toml ([tool.importlinter]); these tests run `lint-imports` on the
package and check that the contract covers every module, so a new module cannot slip past it.
"""

from __future__ import annotations

import ast
import pathlib
import re
import shutil
import subprocess
import sys
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]
LINT_IMPORTS = shutil.which("lint-imports", path=str(pathlib.Path(sys.executable).parent))


def _contracts() -> list[dict]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]


def _modules() -> set[str]:
    """Every module of the package that imports something, by dotted name.

    A package whose __init__ holds only its docstring (health, output, known_answer: their
    folders sit in different layers) imports nothing, so no layer needs to hold it.
    """
    out = set()
    for path in (ROOT / "screener").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            tree = ast.parse(path.read_text())
            if not any(isinstance(n, (ast.Import, ast.ImportFrom)) for n in ast.walk(tree)):
                continue
            parts = parts[:-1]
        out.add(".".join(parts))
    return out


def _layer_entries() -> list[str]:
    layers = next(c for c in _contracts() if c["type"] == "layers")["layers"]
    return [m.strip() for layer in layers for m in re.split(r"[|:]", layer)]


def test_every_module_belongs_to_a_layer():
    entries = _layer_entries()
    loose = sorted(m for m in _modules() - {"screener"}
                   if not any(m == e or m.startswith(e + ".") for e in entries))
    assert not loose, f"modules outside every layer of the import contract: {loose}"


def test_no_module_is_in_two_layers():
    entries = _layer_entries()
    twice = sorted(m for m in _modules()
                   if sum(m == e or m.startswith(e + ".") for e in entries) > 1)
    assert not twice, f"modules in more than one layer: {twice}"


def test_import_contracts_are_kept():
    assert LINT_IMPORTS, "lint-imports not found: the [test] extra installs import-linter"
    out = subprocess.run([LINT_IMPORTS, "--no-cache"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "BROKEN" not in out.stdout and "KEPT" in out.stdout


def test_a_broken_layer_is_caught(tmp_path):
    """The contract can fail: a vocabulary module that imports the agent breaks it."""
    assert LINT_IMPORTS, "lint-imports not found: the [test] extra installs import-linter"
    shutil.copytree(ROOT / "screener", tmp_path / "screener",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    types_py = tmp_path / "screener" / "types.py"
    types_py.write_text(types_py.read_text() + "\nfrom screener.agent import daemon  # noqa\n")
    out = subprocess.run([LINT_IMPORTS, "--no-cache"], cwd=tmp_path, capture_output=True, text=True,
                         env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert out.returncode != 0
    assert "screener.types" in out.stdout and "screener.agent" in out.stdout
