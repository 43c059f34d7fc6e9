"""What an in-job check raises, and the alarm files it leaves for the DaemonSet on each suspect node.

`SDCAlarm` is the collective verdict of one check: every rank builds it from the same gathered data,
so every rank raises an equal alarm at the same step. `NumericFailure` is the other outcome of the
non-finite check: a NaN/Inf that a replay on another node reproduces is the model's or the data's
doing, not the hardware's (exit code 76, see guard.py). `AuditError` is the auditor's own failure
(exit 1) and `AuditUsageError` a setup or argument it refuses (exit 2).

Alarm files. Exactly one rank per node writes, the node's lowest rank in the process group, and a
node only ever gets a file about itself (`AlarmRecord.node` is that node):

- settled alarm: each node hosting a named rank gets a file with settled=True, suspect_ranks = the
  named ranks on that node. The DaemonSet quarantines the node.
- unsettled alarm (no rank can be named): each *candidate* node gets a file with settled=False,
  suspect_ranks = () and evidence["candidate_ranks"] = its candidate ranks. The DaemonSet makes the
  node `suspect` and schedules a confirming known-answer screen. The candidates are the nodes whose
  ranks took part in the disagreement: owner and replayer (and referee) of a ring mismatch, every
  node without a strict majority in a weight vote, and for a NaN/Inf that appeared inside a
  reduction the ranks the redo of that reduction points to (reduction.py; none for a one-off
  every rank saw, every node of the group when it cannot be redone).

The file itself is the alarm file's contract (screener.alarmfile, shared with the daemon's intake:
the record, the check names, the id rule and the write): written whole and durably as
`<alarm_id>.json`, where alarm_id = `<key>-<node>-<random>`: unique per file, so files of simulated
nodes sharing one directory, and of a re-run that fails at the same step, never collide. A
directory that cannot be written is logged and never hides the alarm.

Every rank logs one JSON line (logger "screener.audit", level ERROR) with its rank and hostname.
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

# write_atomic, bounded_alarm_id and write_alarm_file were defined or imported here before the
# alarm file had its contract module; they stay importable from here.
from screener.alarmfile import SDC_CHECKS, AlarmRecord, bounded_alarm_id, write_alarm_file
from screener.atomicfile import write_atomic
from screener.types import ALARM_DIR_ENV, DEFAULT_ALARM_DIR, SuspectNode

__all__ = ["SDCAlarm", "NumericFailure", "AuditError", "AuditUsageError", "CHECKS", "alarm_dir",
           "node_records", "bounded_alarm_id", "write_alarm_file", "write_atomic", "log_json"]

log = logging.getLogger("screener.audit")

CHECKS = SDC_CHECKS  # the checks an SDCAlarm carries (the contract's list)


class SDCAlarm(Exception):
    """A check found a replica computing or holding different numbers than its peers.

    check: one of CHECKS (screener.alarmfile.SDC_CHECKS). suspect_ranks are
    global ranks, empty when the alarm is unsettled (never a guess); suspect_nodes are their nodes.
    candidate_ranks: the ranks under suspicion when no rank can be named (for a settled alarm, the
    suspect ranks). first_suspect_step: the earliest step whose update may carry the fault (roll
    back to a checkpoint strictly before it, see rollback_target).
    """

    def __init__(self, check: str, step: int, suspect_ranks: Sequence[int] = (),
                 suspect_nodes: Sequence[SuspectNode] = (), settled: bool = False,
                 evidence: Optional[Mapping[str, Any]] = None, *,
                 candidate_ranks: Sequence[int] = (), first_suspect_step: Optional[int] = None,
                 key: str = "") -> None:
        if check not in CHECKS:
            raise ValueError(f"unknown check {check!r}; expected one of {', '.join(CHECKS)}")
        if settled and not suspect_ranks:
            raise ValueError("a settled alarm names at least one rank")
        self.check = check
        self.step = int(step)
        self.suspect_ranks = tuple(int(r) for r in suspect_ranks)
        self.suspect_nodes = tuple(suspect_nodes)
        self.settled = bool(settled)
        self.evidence = dict(evidence or {})
        self.candidate_ranks = tuple(int(r) for r in (candidate_ranks or suspect_ranks))
        self.first_suspect_step = int(step if first_suspect_step is None else first_suspect_step)
        self.key = key or f"{check}-s{step}"
        super().__init__(self._message())

    def _message(self) -> str:
        if self.settled:
            where = ", ".join(f"rank {r}" for r in self.suspect_ranks)
            nodes = ", ".join(n.node + (f" ({n.instance_id})" if n.instance_id else "")
                              for n in self.suspect_nodes)
            return f"SDC alarm {self.check} at step {self.step}: {where} on {nodes} (settled)"
        cands = ", ".join(str(r) for r in self.candidate_ranks) or "none"
        return (f"SDC alarm {self.check} at step {self.step}: unsettled, no rank named "
                f"(candidate ranks: {cands})")

    def to_dict(self) -> dict[str, Any]:
        return {"check": self.check, "step": self.step, "settled": self.settled,
                "suspect_ranks": list(self.suspect_ranks),
                "suspect_nodes": [n.__dict__.copy() for n in self.suspect_nodes],
                "candidate_ranks": list(self.candidate_ranks),
                "first_suspect_step": self.first_suspect_step, "key": self.key,
                "evidence": self.evidence}

    # picklable across processes despite the keyword-only arguments
    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_alarm, (self.to_dict(),))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SDCAlarm) and self.to_dict() == other.to_dict()

    __hash__ = Exception.__hash__


def _rebuild_alarm(d: Mapping[str, Any]) -> SDCAlarm:
    return SDCAlarm(d["check"], d["step"], d["suspect_ranks"],
                    tuple(SuspectNode(**n) for n in d["suspect_nodes"]), d["settled"],
                    d["evidence"], candidate_ranks=d["candidate_ranks"],
                    first_suspect_step=d["first_suspect_step"], key=d["key"])


class NumericFailure(FloatingPointError):
    """Numbers no hardware fault explains: a non-finite loss or gradient that a replay reproduced,
    or a verdict too wide to be hardware (see blast.py), or a step that does not reproduce on its
    own rank. Exit code 76; no node gets an alarm file. `reason` says which, and what to check."""

    def __init__(self, step: int, ranks: Sequence[int], evidence: Optional[Mapping[str, Any]] = None,
                 reason: Optional[str] = None):
        self.step = int(step)
        self.ranks = tuple(int(r) for r in ranks)
        self.evidence = dict(evidence or {})
        self.reason = reason
        ranks_text = ", ".join(map(str, self.ranks))
        if reason is None:
            msg = (f"non-finite loss or gradient at step {step} on ranks {ranks_text}, reproduced "
                   f"on another node: a numeric failure, not blamed on hardware")
        else:
            msg = f"numeric failure at step {step} (ranks {ranks_text}), not blamed on hardware: {reason}"
        super().__init__(msg)

    def __reduce__(self) -> tuple[Any, ...]:
        return (NumericFailure, (self.step, self.ranks, self.evidence, self.reason))


class AuditError(RuntimeError):
    """The auditor itself failed on some rank (e.g. a replay raised): never a hardware verdict.

    Exit code 1 (guard.py): the screener failed, a person looks. Its cause (`__cause__`) is the
    exception this rank saw, if it saw one."""


class AuditUsageError(AuditError, ValueError):
    """The Auditor cannot audit what it was given: a training setup no replay can reproduce bit
    for bit, or an argument it cannot use. The message is one line that says why and what to do
    instead. Raised when the Auditor is built, or on the first step for what only the first step
    shows; before any verdict. Exit code 2 (usage or bad input)."""


def alarm_dir(explicit: Optional[str | os.PathLike[str]] = None) -> Path:
    """The directory alarm files go to: explicit, else $SCREENER_ALARM_DIR, else the default."""
    return Path(explicit if explicit is not None
                else (os.environ.get(ALARM_DIR_ENV) or DEFAULT_ALARM_DIR))


def node_records(alarm: SDCAlarm, node_of: Mapping[int, str],
                 node_info: Mapping[str, SuspectNode], *, job: str = "",
                 created: Optional[float] = None) -> dict[str, AlarmRecord]:
    """One AlarmRecord per node that must get a file (see the module docstring), by node name.

    node_of maps every rank named or suspected in the alarm to its node; node_info gives each
    node's SuspectNode.
    """
    created = time.time() if created is None else created
    named: dict[str, list[int]] = {}
    for r in alarm.suspect_ranks:
        named.setdefault(node_of[r], []).append(r)
    candidates: dict[str, list[int]] = {}
    for r in alarm.candidate_ranks:
        if r not in alarm.suspect_ranks:
            candidates.setdefault(node_of[r], []).append(r)
    records: dict[str, AlarmRecord] = {}
    for node in list(named) + [n for n in candidates if n not in named]:
        settled = node in named
        evidence = dict(alarm.evidence)
        evidence.update({"alarm": alarm.key, "first_suspect_step": alarm.first_suspect_step,
                         "candidate_ranks": sorted(named.get(node, []) + candidates.get(node, [])),
                         "alarm_settled": alarm.settled})
        records[node] = AlarmRecord(
            alarm_id=bounded_alarm_id(alarm.key, node, unique=uuid.uuid4().hex[:8]),
            check=alarm.check, step=alarm.step, settled=settled,
            suspect_ranks=tuple(sorted(named.get(node, []))),
            suspect_nodes=(node_info[node],), node=node, job=job, created=created,
            evidence=evidence)
    return records


def log_json(level: int, event: str, *, rank: int, hostname: str, **fields: Any) -> None:
    """Log one JSON line that starts with the rank and hostname: the first thing to look for."""
    log.log(level, json.dumps({"rank": rank, "hostname": hostname, "event": event, **fields},
                              default=str))
