"""Where a store keeps its files on this machine when no path is given."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["default_state_dir"]


def default_state_dir() -> Path:
    """$XDG_STATE_HOME/screener, or ~/.local/state/screener when XDG_STATE_HOME is unset/empty."""
    base = os.environ.get("XDG_STATE_HOME") or ""
    root = Path(base) if base and os.path.isabs(base) else Path.home() / ".local" / "state"
    return root / "screener"
