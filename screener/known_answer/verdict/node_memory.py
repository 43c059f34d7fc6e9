"""A node's memory of its own earlier known-answer results (pure): what to keep, never to replace.

The daemon keeps, in known-digests.json under its state folder (screener.agent.screening.window),
the digest each job gave on each platform in its earlier screens, so that a later screen with no
golden can tell a device that disagrees with itself from a job that does (the judgment reads it
as `known`: screener.known_answer.verdict.reference). A memory that a faulty unit can rewrite is worse
than none: a persistently bad lane that overwrote the good digest made the next screen blame
the healthy run (expected = the faulty value). So:

- only a result the device reproduced (two or more runs, one result) with nothing found against
  the job (no issue but a missing reference) on a device that is not suspect is kept (the rule
  is screener.known_answer.verdict.quorum.reproduced, the same one for what a node tells the fleet);
- a kept digest is never replaced by a different one for the same platform and spec: that is a
  conflict (one of the two results is wrong, and nothing here says which), reported and left
  as it was; the screen's verdict says it too (reason earlier_screens_differ, inconclusive);
- the memory never overrides a golden: the judgment consults it only where the platform has no
  golden (screener.known_answer.verdict.reference), and a result kept here is one that did not differ
  from any golden it was compared with.

A changed spec (another spec hash) changes the bits, so its entry is replaced.
"""

from __future__ import annotations

from typing import Any, Mapping

from screener.known_answer.verdict.quorum import reproduced
from screener.known_answer.verdict.reference import known_digest


def remember(known: Mapping[str, Any], screen: Mapping[str, Any]
             ) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """The memory after a screen (the screen's JSON form, ScreenResult.to_dict() or a burn-in's),
    and one line per conflict: a reproduced result that differs from the one kept."""
    out: dict[str, dict[str, Any]] = {p: dict(jobs) for p, jobs in known.items()
                                      if isinstance(p, str) and isinstance(jobs, Mapping)}
    conflicts: list[str] = []
    for device, phash, job, digest, spec_hash in reproduced(screen):
        kept = known_digest(out, phash, job, spec_hash)
        if kept is not None and kept != digest:
            conflicts.append(
                f"{device} reproduced digest {digest} for {job} on platform "
                f"{phash}, but this node's earlier screens kept {kept}: kept the earlier "
                f"one (one of the two is wrong; a golden of the platform settles it)")
            continue
        out.setdefault(phash, {})[job] = {"digest": digest, "spec_hash": spec_hash}
    return out, conflicts
