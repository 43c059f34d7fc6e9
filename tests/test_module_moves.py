"""What moving modules into subpackages must leave as it was: an uninstalled checkout still finds
the repository's data, and log lines keep the logger names log queries filter on.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("kind", ["jobs", "golden"])
def test_uninstalled_checkout_finds_the_repository_data(kind: str) -> None:
    """A checkout merely on sys.path (not installed: no `screener._jobs`/`screener._golden`
    mapping) reads the repository's jobs/ and golden/ folders, as it did before packagedata.py
    moved from screener/ into screener/known_answer/ (one folder deeper).

    `python -S` skips site-packages, and with it the editable install's import mapping: the same
    situation as `PYTHONPATH=. python -m screener.cli ...` on a machine without the package.
    """
    code = (f"import sys; sys.path.insert(0, {str(REPO)!r}); "
            "from screener.known_answer.engine.packagedata import data_dir; "
            f"print(data_dir({kind!r}))")
    out = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True,
                         timeout=60, check=True).stdout.strip()
    assert Path(out) == REPO / kind
    assert (REPO / kind).is_dir()


@pytest.mark.parametrize("module,name", [
    ("screener.agent.daemon.intake", "screener.intake"),
    ("screener.agent.screening.window", "screener.screening"),
    ("screener.agent.daemon.loop", "screener.daemon"), ("screener.remediation.hyperpod", "screener.hyperpod"),
    ("screener.known_answer.verdict.crosscheck", "screener.crosscheck"),
    ("screener.stores.kube.store", "screener.stores.kube"),
    ("screener.stores.kube.calls", "screener.stores.kube"),
])
def test_log_lines_keep_their_logger_names_after_the_move(module, name):
    """The daemon's JSON log lines carry the logger's name; log queries filter on it, so moving a
    module into a subpackage must not rename its logger."""
    import importlib

    assert importlib.import_module(module).log.name == name


def test_the_renamed_known_answer_reason_answers_with_a_deprecation_line() -> None:
    """One name for the known-answer screen (issue 37.2): KatReason is KnownAnswerReason, and
    the old name still resolves, saying so."""
    import screener.types as types

    with pytest.warns(DeprecationWarning, match="KatReason is now KnownAnswerReason"):
        assert types.KatReason is types.KnownAnswerReason
    assert types.KnownAnswerReason("golden_mismatch") is types.KnownAnswerReason.GOLDEN_MISMATCH
