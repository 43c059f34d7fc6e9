"""Which checkpoints were saved after a passing weight check, and which one to roll back to.

`Auditor.verified_save` runs the weight vote, calls the user's save function and, when that returns
the path it wrote, drops a marker file next to it: `<checkpoint>.screener-verified.json` holding the
step and the digest of the verified weight fingerprints. The marker is written after the save
returns, atomically, so a save that crashed halfway leaves no marker. `rollback_target` trusts only
checkpoints with a marker at least as new as the checkpoint itself.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Iterable, Optional, Union

from screener.audit.alarms import write_atomic

__all__ = ["MARKER_SUFFIX", "marker_path", "write_marker", "read_marker", "rollback_target"]

MARKER_SUFFIX = ".screener-verified.json"
_SCHEMA = 1

PathLike = Union[str, "os.PathLike[str]"]


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A marker's object; ValueError on a key given twice (a hidden second value)."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def marker_path(checkpoint: PathLike) -> Path:
    p = Path(checkpoint)
    return p.with_name(p.name + MARKER_SUFFIX)


def write_marker(checkpoint: PathLike, *, step: int, weights_digest: str, job: str = "") -> Path:
    """Mark a checkpoint as saved through verified_save (atomic: temp file, fsync, rename)."""
    target = marker_path(checkpoint)
    body = json.dumps({"schema": _SCHEMA, "checkpoint": Path(checkpoint).name, "step": int(step),
                       "weights_digest": weights_digest, "job": job, "created": time.time()},
                      sort_keys=True).encode()
    write_atomic(target, body)
    return target


def read_marker(checkpoint: PathLike) -> Optional[dict[str, Any]]:
    """The marker of a checkpoint, or None when it has none, the marker is not for it, or the
    checkpoint was written again after its marker (a path reused by a save that was not verified,
    such as `latest.pt`)."""
    marker = marker_path(checkpoint)
    try:
        d = json.loads(marker.read_text(), object_pairs_hook=_unique)
        if Path(checkpoint).stat().st_mtime_ns > marker.stat().st_mtime_ns:
            return None
    except (OSError, ValueError):
        return None
    if not isinstance(d, dict) or d.get("schema") != _SCHEMA:
        return None
    if d.get("checkpoint") != Path(checkpoint).name:
        return None
    step = d.get("step")
    if not isinstance(step, int) or isinstance(step, bool):
        return None
    return d


def rollback_target(checkpoints: Union[PathLike, Iterable[PathLike]],
                    first_suspect_step: int) -> Optional[PathLike]:
    """The newest verified checkpoint saved strictly before first_suspect_step, or None.

    checkpoints: paths of checkpoints (files or directories), or one directory whose entries are
    the checkpoints. Only checkpoints that still exist and carry a verified_save marker count; the
    step is the one recorded in the marker. Returns the path as it was given.
    """
    if isinstance(checkpoints, (str, os.PathLike)):
        d = Path(checkpoints)
        entries: list[Path] = sorted(
            (p for p in d.iterdir() if not p.name.endswith(MARKER_SUFFIX)
             and not p.name.startswith(".")), key=lambda p: p.name) if d.is_dir() else []
        candidates: list[PathLike] = list(entries)
    else:
        candidates = list(checkpoints)
    best: Optional[tuple[int, PathLike]] = None
    for c in candidates:
        if not Path(c).exists():
            continue
        m = read_marker(c)
        if m is None or m["step"] >= first_suspect_step:
            continue
        if best is None or m["step"] > best[0]:
            best = (m["step"], c)
    return best[1] if best else None
