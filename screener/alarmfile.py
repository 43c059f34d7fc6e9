"""The alarm file: the one contract between the in-job audit that drops it and the daemon's
intake that takes it.

An alarm file crosses a trust boundary (a training job's pod writes it, the node's DaemonSet acts
on it), so both ends read their rules from here and cannot drift apart:

- the record and its JSON (`AlarmRecord`, `SCHEMA`): one object per file, the fields of
  `AlarmRecord.to_dict`, nothing else;
- the check names (`CHECKS`, each with the transition reason it means; `SDC_CHECKS`, the ones an
  in-job `SDCAlarm` carries): the one list the audit raises from and the intake accepts;
- the bounds a reader holds a file to (`validate`): ids short and of a safe charset, the job
  printable, numbers finite and in the range of what they mean, evidence small, and every
  suspect node the alarm's own node (an alarm acts only on the node it was dropped on);
- the id rule (`bounded_alarm_id`), which cuts a writer's ids to what `validate` accepts;
- the write (`write_alarm_file`): `<alarm_id>.json`, whole or not at all and durable
  (screener.atomicfile), so the intake never reads half a file; a dot name is a write in progress.

How the intake opens a file it did not write (no symlinks, no FIFOs, bounded reads) is the
reader's business and lives with it (screener.agent.daemon.intake). Imports only the standard
library and screener's vocabulary (types, atomicfile): `import screener.audit` stays torch and the
standard library.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional

from screener.atomicfile import write_atomic
from screener.types import Reason, SuspectNode, printable_text

__all__ = ["SCHEMA", "CHECKS", "SDC_CHECKS", "NONFINITE_LOCAL", "NONFINITE_REDUCED", "RING_REPLAY",
           "SPIKE_RERUN", "WEIGHTS", "OPTIMIZER_UPDATE", "STRAGGLER", "HARDWARE_ERROR",
           "PREFLIGHT", "AlarmRecord", "MAX_ID_LEN", "MAX_NAME_LEN", "MAX_ALARM_BYTES",
           "MAX_EVIDENCE_BYTES", "MAX_DEPTH", "MAX_RANKS", "MAX_SUSPECT_NODES", "MIN_CREATED",
           "MAX_CREATED", "MAX_CLOCK_SKEW_S", "STRAGGLER_BOUNDS", "bounded_alarm_id",
           "file_name", "encode", "write_alarm_file", "is_ours", "validate"]

SCHEMA = 1

# --- the check names: the one list ---------------------------------------------------------------

# The in-job collective checks (screener.audit): an SDCAlarm carries one of these.
NONFINITE_LOCAL = "nonfinite_local"  # a NaN/Inf in a rank's own gradient (audit.nonfinite)
NONFINITE_REDUCED = "nonfinite_reduced"  # a NaN/Inf that appeared inside a reduction
RING_REPLAY = "ring_replay"  # a rank's step replayed on another node differs (audit.ring_audit)
WEIGHTS = "weights"  # a replica's weights differ from the majority's (audit.weight_check)
SPIKE_RERUN = "spike_rerun"  # a spike a rerun elsewhere did not reproduce (audit.sentinel)
OPTIMIZER_UPDATE = "optimizer_update"  # an FSDP2 shard's update, recomputed elsewhere (update_buddy)
# The other writers of alarm files, each always unsettled.
STRAGGLER = "straggler"  # audit.straggler: a rank slower than its peers for w steps
HARDWARE_ERROR = "hardware_error"  # audit.run_guarded: a worker ended with 75 on an ECC error
# screener preflight (a job's init container): a suspect probe or known-answer mismatch (one
# signal: the daemon confirms with its own screen)
PREFLIGHT = "preflight"

SDC_CHECKS: tuple[str, ...] = (NONFINITE_LOCAL, NONFINITE_REDUCED, RING_REPLAY, WEIGHTS,
                               SPIKE_RERUN, OPTIMIZER_UPDATE)
# Every check an alarm file may carry, and what it means as a transition reason: the intake
# accepts exactly these.
CHECKS: Mapping[str, Reason] = {
    NONFINITE_LOCAL: Reason.NONFINITE,
    NONFINITE_REDUCED: Reason.NONFINITE,
    RING_REPLAY: Reason.RING_REPLAY,
    SPIKE_RERUN: Reason.SPIKE_RERUN,
    WEIGHTS: Reason.WEIGHTS,
    OPTIMIZER_UPDATE: Reason.OPTIMIZER_UPDATE,
    STRAGGLER: Reason.STRAGGLER,
    HARDWARE_ERROR: Reason.HARDWARE_ERROR_IN_JOB,
    PREFLIGHT: Reason.PREFLIGHT,
}

# --- the bounds a reader holds a file to ---------------------------------------------------------

# The longest alarm_id (and instance id) the intake accepts: the Kubernetes store keeps 160
# characters of a string in history, and the writer cuts its ids to fit (bounded_alarm_id).
MAX_ID_LEN = 128
MAX_NAME_LEN = 253  # a DNS subdomain, the longest Kubernetes node name
MAX_ALARM_BYTES = 256 * 1024  # an alarm is a few KiB; anything this large is not one
MAX_EVIDENCE_BYTES = 64 * 1024  # evidence is stored with the transition: keep it small
MAX_DEPTH = 16
MAX_RANKS = 65536
MAX_SUSPECT_NODES = 64
MAX_CREATED = 1e11  # unix seconds, year 5138: the bound when no clock is known
MIN_CREATED = 946684800.0  # 2000-01-01: no alarm is older (unless the node's own clock is)
MAX_CLOCK_SKEW_S = 600.0  # how far ahead of the daemon's clock an alarm's `created` may be
# The straggler's figures (screener.audit.straggler), bounded by what they mean: a slowdown is
# t_i / median - 1 (0.25 = 25% slower; 1000 = a thousand and one times slower is no straggler
# but a stall), times are seconds of one step, k is a z-score threshold, w a count of steps.
STRAGGLER_BOUNDS: Mapping[str, tuple[float, float, bool]] = {  # name: (lo, hi, integer)
    "slowdown": (0.0, 1000.0, False),
    "score": (0.0, 1e9, False),
    "consecutive": (0, 2**31 - 1, True),
    "window": (1, 2**31 - 1, True),
    "median": (0.0, 86400.0, False),
    "duration": (0.0, 86400.0, False),
    "k": (0.0, 1e6, False),
    "rank": (0, 2**31 - 1, True),
}
_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_FIELDS = frozenset({"schema", "alarm_id", "check", "step", "settled", "suspect_ranks",
                     "suspect_nodes", "node", "job", "created", "evidence"})
_REQUIRED = ("alarm_id", "check", "step", "settled", "suspect_ranks", "suspect_nodes", "node")


# --- the record ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class AlarmRecord:
    """The JSON content of one alarm file dropped by an in-job check for the DaemonSet.

    Written by `screener.audit` (write_alarm_file) into SCREENER_ALARM_DIR on the suspect node;
    read exactly once by the daemon on that node (screener.agent.daemon.intake, through `validate`).
    """

    alarm_id: str  # unique; also the file's stem
    check: str  # one of CHECKS
    step: int
    settled: bool
    suspect_ranks: tuple[int, ...]
    suspect_nodes: tuple[SuspectNode, ...]
    node: str  # the node this file is about (the one it was dropped on)
    job: str = ""
    created: float = 0.0  # unix time
    evidence: Mapping[str, Any] = field(default_factory=dict)

    SCHEMA = SCHEMA

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": self.SCHEMA,
            "alarm_id": self.alarm_id,
            "check": self.check,
            "step": self.step,
            "settled": self.settled,
            "suspect_ranks": list(self.suspect_ranks),
            "suspect_nodes": [asdict(n) for n in self.suspect_nodes],
            "node": self.node,
            "job": self.job,
            "created": self.created,
            "evidence": dict(self.evidence),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "AlarmRecord":
        """The record of a dict of its own shape (to_dict's, as stored in a transition's
        evidence); raises ValueError naming the first thing that is wrong. The structure only: a
        file from outside goes through `validate`, which holds it to the bounds first."""
        if not isinstance(d, Mapping):
            raise ValueError("alarm is not a JSON object")
        if d.get("schema") != cls.SCHEMA:
            raise ValueError(f"alarm schema {d.get('schema')!r} is not {cls.SCHEMA}")
        _require(d)
        if d["check"] not in CHECKS:
            raise ValueError(f"alarm check {d['check']!r} is not one of {sorted(CHECKS)}")
        if not isinstance(d["step"], int) or isinstance(d["step"], bool):
            raise ValueError(f"alarm step {d['step']!r} is not an integer")
        if not isinstance(d["settled"], bool):
            raise ValueError(f"alarm settled {d['settled']!r} is not a boolean")
        try:
            nodes = tuple(SuspectNode(node=str(n["node"]), hostname=str(n["hostname"]),
                                      instance_id=n.get("instance_id")) for n in d["suspect_nodes"])
            ranks = tuple(int(r) for r in d["suspect_ranks"])
        except (TypeError, KeyError, ValueError) as e:
            raise ValueError(f"alarm suspect_ranks/suspect_nodes malformed: {e}") from None
        return cls(alarm_id=str(d["alarm_id"]), check=str(d["check"]), step=d["step"],
                   settled=d["settled"], suspect_ranks=ranks, suspect_nodes=nodes,
                   node=str(d["node"]), job=str(d.get("job") or ""),
                   created=float(d.get("created") or 0.0), evidence=dict(d.get("evidence") or {}))


def _require(d: Mapping[str, Any]) -> None:
    for key in _REQUIRED:
        if key not in d:
            raise ValueError(f"alarm lacks the field {key!r}")


# --- the writer's side ---------------------------------------------------------------------------

def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("._") or "x"


def bounded_alarm_id(*parts: str, unique: str) -> str:
    """`part-part-...-unique`, the parts cut so the whole fits what the daemon's intake accepts
    (MAX_ID_LEN): a long job or node name must not get the alarm rejected."""

    head = "-".join(_slug(p) for p in parts)[:max(1, MAX_ID_LEN - len(unique) - 1)]
    return f"{head.strip('._-') or 'x'}-{unique}"


def file_name(alarm_id: str) -> str:
    """The name of an alarm's file: its id and `.json` (a dot name is a write in progress)."""
    return f"{alarm_id}.json"


def encode(record: AlarmRecord) -> bytes:
    """The bytes of an alarm file: the record's JSON, keys sorted; evidence that JSON cannot
    carry (a tensor's dtype, a path) is written as its str."""
    return json.dumps(record.to_dict(), sort_keys=True, default=str).encode()


def write_alarm_file(record: AlarmRecord, directory: str | os.PathLike[str]) -> Path:
    """Write `<alarm_id>.json` whole and durably into directory (created if missing); returns
    the path; raises OSError."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    return write_atomic(d / file_name(record.alarm_id), encode(record))


# --- the reader's side ---------------------------------------------------------------------------

def is_ours(data: Any) -> bool:
    """Whether parsed JSON claims to be a screener alarm: an object with the alarm's `schema` or
    `alarm_id` field (a broken alarm of ours still has one; another program's file neither)."""
    return isinstance(data, Mapping) and ("schema" in data or "alarm_id" in data)


def _name(v: Any, what: str, limit: int, *, pattern: bool = True) -> str:
    if not isinstance(v, str) or not v:
        raise ValueError(f"alarm {what} must be a non-empty string")
    if len(v) > limit:
        raise ValueError(f"alarm {what} is {len(v)} characters long (at most {limit})")
    if pattern and not _ID_RE.match(v):
        raise ValueError(f"alarm {what} {v[:40]!r} may hold only letters, digits, '_', '.', '-'")
    return v


def _int(v: Any, what: str, hi: int) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= hi:
        raise ValueError(f"alarm {what} {str(v)[:40]} is not an integer in 0..{hi}")
    return v


def validate(d: Any, *, now: Optional[float] = None) -> AlarmRecord:
    """An AlarmRecord from a parsed alarm file, every field checked; ValueError naming the first
    field that is wrong. Beyond AlarmRecord.from_dict: ids are bounded in length and charset,
    the job is printable text (types.printable_text), numbers are finite and bounded by what
    they mean (`created` no older than 2000 and at most MAX_CLOCK_SKEW_S ahead of `now`, the
    daemon's wall clock, time.time() when not given; a straggler's figures, STRAGGLER_BOUNDS),
    evidence is small and its strings encodable, and every suspect node named is the alarm's own
    node (an alarm may only ever speak about the node it was dropped on)."""
    if not isinstance(d, Mapping):
        raise ValueError("alarm is not a JSON object")
    unknown = sorted(str(k)[:40] for k in set(d) - _FIELDS)
    if unknown:
        raise ValueError(f"alarm has unknown field(s) {', '.join(unknown)}")
    if d.get("schema") != SCHEMA or isinstance(d.get("schema"), bool):
        raise ValueError(f"alarm schema {str(d.get('schema'))[:40]} is not {SCHEMA}")
    _require(d)
    _name(d["alarm_id"], "alarm_id", MAX_ID_LEN)
    node = _name(d["node"], "node", MAX_NAME_LEN)
    if not isinstance(d["check"], str) or d["check"] not in CHECKS:
        raise ValueError(f"alarm check {str(d['check'])[:40]!r} is not one of "
                         f"{sorted(CHECKS)}")
    _int(d["step"], "step", 2**63 - 1)
    if not isinstance(d["settled"], bool):
        raise ValueError("alarm settled is not true or false")
    _suspects(d["suspect_ranks"], d["suspect_nodes"], node)
    job = d.get("job")
    if job not in (None, ""):
        printable_text(job, "alarm job", MAX_NAME_LEN)
    created = _created(d.get("created", 0.0), time.time() if now is None else now)
    evidence = d.get("evidence")
    if evidence is None:
        evidence = {}
    if not isinstance(evidence, Mapping):
        raise ValueError("alarm evidence is not an object")
    size = len(json.dumps(evidence))
    if size > MAX_EVIDENCE_BYTES:
        raise ValueError(f"alarm evidence is {size} bytes of JSON (at most {MAX_EVIDENCE_BYTES})")
    _encodable(evidence)
    if d["check"] == STRAGGLER:
        _straggler_figures(evidence)
    return AlarmRecord.from_dict({**d, "created": float(created), "evidence": dict(evidence)})


def _created(created: Any, now: float) -> float:
    """`created` (0 or absent: not known) as a unix time between 2000 (0 while the daemon's own
    clock is before then: a node whose clock was reset cannot judge) and now plus a small skew
    (the writer ran on this node, on this clock)."""
    if created is None:
        return 0.0
    if not isinstance(created, (int, float)) or isinstance(created, bool) \
            or not math.isfinite(created):
        raise ValueError(f"alarm created {str(created)[:40]} is not a unix time")
    if created == 0:
        return 0.0
    lo = MIN_CREATED if now >= MIN_CREATED else 0.0
    hi = min(MAX_CREATED, now + MAX_CLOCK_SKEW_S)
    if not lo <= created <= hi:
        raise ValueError(f"alarm created {created:.0f} is not a unix time in {lo:.0f}..{hi:.0f} "
                         f"(not before 2000, at most {MAX_CLOCK_SKEW_S:.0f} s ahead of this "
                         f"node's clock)")
    return float(created)


def _encodable(evidence: Mapping[str, Any]) -> None:
    """Every key and string in the evidence can be written as UTF-8 (no lone surrogate, which
    breaks every store, log line and terminal that meets it later); keys are printable text.
    String values may hold newlines (an error message): whoever prints them escapes them."""
    stack: list[Any] = [evidence]
    while stack:
        v = stack.pop()
        if isinstance(v, Mapping):
            for k, x in v.items():
                printable_text(k, "alarm evidence key", 256)
                stack.append(x)
        elif isinstance(v, list):
            stack.extend(v)
        elif isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ValueError(f"alarm evidence holds a lone surrogate (U+{ord(v[e.start]):04X})"
                                 f", which no UTF-8 text can carry") from None


def _straggler_figures(evidence: Mapping[str, Any]) -> None:
    """A straggler's figures, when present, are numbers in the range of what they mean."""
    for key, (lo, hi, integer) in STRAGGLER_BOUNDS.items():
        if key not in evidence:
            continue
        v = evidence[key]
        kind = (int,) if integer else (int, float)
        if not isinstance(v, kind) or isinstance(v, bool) or not math.isfinite(v) \
                or not lo <= v <= hi:
            raise ValueError(f"alarm straggler {key} {str(v)[:40]} is not "
                             f"{'an integer' if integer else 'a number'} in {lo:g}..{hi:g}")


def _suspects(ranks: Any, nodes: Any, node: str) -> None:
    """The suspect ranks and nodes are bounded lists, and every suspect node is `node` itself."""
    if not isinstance(ranks, list) or len(ranks) > MAX_RANKS:
        raise ValueError(f"alarm suspect_ranks must be a list of at most {MAX_RANKS} ranks")
    for r in ranks:
        _int(r, "suspect rank", 2**31 - 1)
    if not isinstance(nodes, list) or len(nodes) > MAX_SUSPECT_NODES:
        raise ValueError(f"alarm suspect_nodes must be a list of at most {MAX_SUSPECT_NODES}")
    for n in nodes:
        if not isinstance(n, Mapping) or set(n) - {"node", "hostname", "instance_id"}:
            raise ValueError("alarm suspect_nodes entries must be {node, hostname, instance_id}")
        named = _name(n.get("node"), "suspect node", MAX_NAME_LEN)
        _name(n.get("hostname"), "suspect hostname", MAX_NAME_LEN)
        if n.get("instance_id") is not None:
            _name(n["instance_id"], "suspect instance_id", MAX_ID_LEN)
        if named != node:
            raise ValueError(f"alarm names node {named[:60]} as suspect but was dropped for "
                             f"node {node}: an alarm acts only on its own node")
