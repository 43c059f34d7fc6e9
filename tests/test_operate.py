"""The small things an operator meets first (issue 25.8): the LICENSE the metadata names, the
`daemon --once` hint naming the extra that installs everything the daemon needs, and `golden
verify --golden-dir` as every other command takes the folder (the positional kept)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from cli_util import screener

ROOT = Path(__file__).resolve().parents[1]


def test_the_license_file_is_the_apache_2_text_the_metadata_names():
    text = (ROOT / "LICENSE").read_text()
    assert text.split()[:4] == ["Apache", "License", "Version", "2.0,"]
    assert "END OF TERMS AND CONDITIONS" in text and len(text.splitlines()) > 190
    assert 'license = { text = "Apache-2.0" }' in (ROOT / "pyproject.toml").read_text()


def test_daemon_without_prometheus_client_names_the_daemon_extra(tmp_path):
    # A prometheus_client that cannot be imported, as where the extra is not installed: the real
    # process, so the one line on a real stderr is what a user sees.
    blocked = tmp_path / "prometheus_client"
    blocked.mkdir()
    (blocked / "__init__.py").write_text(
        'raise ImportError("not installed", name="prometheus_client")\n')
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    r = subprocess.run([sys.executable, "-m", "screener.cli", "daemon", "--once"], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install 'screener[daemon]'" in lines[0], r.stderr


def test_golden_verify_takes_golden_dir_and_the_positional(tmp_path):
    by_option = screener("golden", "verify", "--golden-dir", str(ROOT / "golden"))
    by_argument = screener("golden", "verify", str(ROOT / "golden"))
    assert by_option.returncode == by_argument.returncode == 0, by_option.stderr
    assert by_option.stdout == by_argument.stdout and by_option.stdout.startswith("ok ")
    empty = tmp_path / "none"
    r = screener("golden", "verify", "--golden-dir", str(empty))
    assert r.returncode == 2 and str(empty) in r.stderr  # the option is the folder it reads
    r = screener("golden", "verify", str(ROOT / "golden"), "--golden-dir", str(tmp_path))
    assert r.returncode == 2 and "two golden folders" in r.stderr


def test_a_usage_error_is_one_line_naming_the_command_and_its_help():
    for args, words in ((["golden", "verify", "a", "--golden-dir", "b"], "golden verify: two"),
                        (["kat", "run", "--bogus"], "kat run: No such option '--bogus'"),
                        (["nope"], "No such command 'nope'")):
        r = screener(*args)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1, r.stderr
        assert lines[0].startswith("screener: ") and words in lines[0], lines[0]
        assert lines[0].endswith("--help')") and "Traceback" not in r.stderr
