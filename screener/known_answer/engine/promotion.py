"""Goldens promoted from a fleet quorum: reading the stored ones, making new ones.

A screen that judged a job against a quorum of other nodes (screener.known_answer.verdict.quorum) and found
one of this node's devices reproducing it promotes that device's result, with every step, to the
platform's golden: the record `screener golden record` would write, whose `recorded` field also
says where it came from (source "quorum", the quorum's nodes, who promoted it, when, which
screener). The store keeps it (a ConfigMap `screener-quorum-<platform hash>` on Kubernetes, a table
of the shared SQLite store locally), add-only: a promoted record is never replaced, and a node
that would promote different bits reports the conflict. Every later screen reads the stored
records back as goldens (`lookup`), so a platform needs its quorum once, and the goldens show the
step and tensor where a device first differs, which a digest alone cannot.

A stored record is validated as a golden file is (screener.known_answer.engine.golden.parse). One that
is broken is left out with a warning, never a verdict and never a failed screen: the store is
shared, and one bad write must not stop the fleet's screens (its quorum still decides).
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Any, Mapping, Optional, Sequence

from screener import __version__
from screener.errors import GoldenError
from screener.known_answer.engine import golden as _golden
from screener.known_answer.verdict.quorum import FleetView, Quorum, provenance
from screener.known_answer.verdict.runs import DeviceRun
from screener.known_answer.verdict.screen_result import ScreenResult
from screener.known_answer.engine.specs import JobSpec
from screener.types import Outcome

log = logging.getLogger("screener.known_answer")

STORE_PATH = "fleet-quorum"  # how a promoted record's path reads in verdicts and `golden list`


def store_path(job: str, phash: str) -> str:
    """The path a promoted record is named by: not a file, but shaped like one so the golden
    parser's name check holds (`<job>.<platform hash>.json`)."""
    return f"{STORE_PATH}/{job}.{phash}.json"


def load(promoted: Mapping[str, Mapping[str, str]], spec: JobSpec,
         phash: str) -> Optional[_golden.GoldenRecord]:
    """The promoted golden of a job on a platform, or None (none stored, or a broken one)."""
    text = (promoted.get(phash) or {}).get(spec.name)
    if text is None:
        return None
    try:
        record = _golden.parse(store_path(spec.name, phash), text)
        problem = _golden.spec_problem(record, spec)
        if problem:
            raise GoldenError(f"promoted golden {store_path(spec.name, phash)}: {problem}")
        if phash not in record.platform_hashes:
            raise GoldenError(f"promoted golden {store_path(spec.name, phash)}: is for platform "
                              f"{record.platform_hash}")
    except GoldenError as e:
        log.warning("ignoring a stored golden: %s", e)
        return None
    return record


def promotions(result: ScreenResult, runs: Mapping[str, DeviceRun], specs: Sequence[JobSpec],
               fleet: FleetView, *, now: Optional[float] = None) -> dict[str, dict[str, str]]:
    """Platform hash -> job -> record text of the goldens this screen promotes: per job judged
    against a quorum, the result of the first device that reproduced it with nothing against
    the job."""
    by_name = {s.name: s for s in specs}
    out: dict[str, dict[str, str]] = {}
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() if now is None else now))
    for v in result.verdicts:
        run = runs.get(v.device)
        if run is None or not v.platform_hash or v.outcome == Outcome.SUSPECT:
            continue
        against = {i.get("job") for i in v.evidence.get("issues") or ()}
        for job, info in (v.evidence.get("jobs") or {}).items():
            q = info.get("quorum")
            spec = by_name.get(job)
            runs_of = run.jobs.get(job)
            if not isinstance(q, Mapping) or spec is None or runs_of is None or job in against \
                    or not runs_of.consistent or runs_of.runs < 2 \
                    or runs_of.reference.digest != q.get("digest") \
                    or job in out.get(v.platform_hash, {}):
                continue
            quorum = Quorum(v.platform_hash, job, int(q.get("need") or fleet.need),
                            str(q["digest"]), tuple(str(n) for n in q.get("nodes") or ()),
                            int(q.get("reporting") or 0))
            record = _golden.record_from_results(
                spec, run.platform, v.platform_hash, [(v.device, runs_of.reference)],
                repeats=runs_of.runs, host=fleet.node, now=now)
            record = replace(record, recorded={
                **record.recorded, **provenance(quorum, node=fleet.node, time_text=stamp,
                                                version=__version__)})
            out.setdefault(v.platform_hash, {})[job] = _golden.format_record(record)
    return out


def describe(record: _golden.GoldenRecord) -> dict[str, Any]:
    """What `screener golden list` shows of a promoted record's provenance."""
    rec = record.recorded
    raw = rec.get("quorum")
    q: Mapping[str, Any] = raw if isinstance(raw, Mapping) else {}
    return {"source": rec.get("source"), "nodes": list(q.get("nodes") or []),
            "agreeing": q.get("agreeing"), "need": q.get("need"),
            "promoted_by": rec.get("promoted_by"), "promoted_at": rec.get("promoted_at"),
            "screener_version": rec.get("promoted_with") or rec.get("screener_version")}
