"""Where the job specs and golden records shipped with screener live on this machine.

They are the package data `screener._jobs` and `screener._golden` (the repository's jobs/ and
golden/ folders, mapped onto those names by pyproject.toml) and are found through
importlib.resources, so an installed wheel, an editable install and the image read the same way.
A source tree run without being installed (its folder merely on sys.path) has no such mapping; it
reads the folders next to the package.
"""

from __future__ import annotations

import importlib.resources
from pathlib import Path

from screener.errors import ScreenerError

KINDS = ("jobs", "golden")


def data_dir(kind: str) -> Path:
    """The folder of the shipped `kind` ("jobs" or "golden") as a filesystem path."""
    if kind not in KINDS:
        raise ValueError(f"no package data {kind!r}; known: {', '.join(KINDS)}")
    try:
        found = importlib.resources.files(f"screener._{kind}")
    except ModuleNotFoundError:
        # Not installed (a checkout on sys.path, or an editable install made before the mapping):
        # the repository's folder, two levels above this file (screener/known_answer/).
        return Path(__file__).resolve().parents[3] / kind
    if not isinstance(found, Path):
        # A zip import has no folder that a child process or `golden record` could use.
        raise ScreenerError(f"screener's {kind} data is not on the filesystem ({found}); "
                            f"install screener as a regular (unzipped) package")
    return found
