"""One way screener writes a file (issue 37.5): screener.atomicfile, whole or not at all, durable."""

from __future__ import annotations

import ast
import os
import stat
from pathlib import Path

import pytest

from screener.atomicfile import write_atomic

ROOT = Path(__file__).resolve().parents[1]
# moves of files that already exist (the alarm intake setting files aside), not writes, and the
# health answer's listening socket bound under a temporary name and renamed over a killed
# daemon's (a socket has no content to write: write_atomic cannot make one), and the intent
# journal setting an unreadable intent aside
MOVES = {"screener/agent/daemon/intake.py", "screener/stores/local.py", "screener/agent/health_answer.py",
         "screener/stores/intents.py"}


def _calls(path: Path) -> set[str]:
    """The dotted names a module calls (os.replace, tempfile.mkstemp, ...)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                isinstance(node.func.value, ast.Name):
            out.add(f"{node.func.value.id}.{node.func.attr}")
    return out


def test_no_module_writes_a_file_by_rename_but_atomicfile():
    writers = {}
    for p in sorted((ROOT / "screener").rglob("*.py")):
        rel = p.relative_to(ROOT).as_posix()
        if rel == "screener/atomicfile.py" or rel in MOVES:
            continue
        found = _calls(p) & {"os.replace", "os.rename", "tempfile.mkstemp",
                             "tempfile.NamedTemporaryFile"}
        if found:
            writers[rel] = sorted(found)
    assert writers == {}, f"write files through screener.atomicfile.write_atomic: {writers}"


def test_a_write_replaces_the_file_whole_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "state.json"
    target.write_text("old")
    assert write_atomic(target, '{"new": "\u00e9"}') == target
    assert target.read_text(encoding="utf-8") == '{"new": "\u00e9"}'
    write_atomic(target, b"\x00\x01")
    assert target.read_bytes() == b"\x00\x01"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]


def test_permissions_are_private_unless_public(tmp_path):
    umask = os.umask(0o022)
    try:
        private = write_atomic(tmp_path / "a", "x")
        public = write_atomic(tmp_path / "b", "x", public=True)
    finally:
        os.umask(umask)
    assert stat.S_IMODE(private.stat().st_mode) == 0o600
    assert stat.S_IMODE(public.stat().st_mode) == 0o644


def test_a_write_that_cannot_happen_raises_and_leaves_nothing(tmp_path):
    with pytest.raises(OSError):
        write_atomic(tmp_path / "missing" / "f", "x")
    (tmp_path / "dir").mkdir()
    with pytest.raises(OSError):  # a folder in the way: the rename fails, the temp file goes
        write_atomic(tmp_path / "dir", "x")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir"]
    assert list((tmp_path / "dir").iterdir()) == []
