"""The shared vocabulary of screener: findings, verdicts, node states, alarms and the exit-code contract.

Every other module speaks in these types, so this module imports nothing of ours and only the
standard library. Values that cross a process or machine boundary (verdict annotations, Kubernetes
labels) are defined here once so writer and reader cannot drift apart; the alarm file has a module
of its own on top of this one (screener.alarmfile: its record, check names, bounds and write).
"""

from __future__ import annotations

import enum
import os
import socket
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping, Optional


class ExitCode(enum.IntEnum):
    """Process exit codes, identical for every command and documented in the README.

    A Kubernetes Job's podFailurePolicy can match on them: 75 fails the Job (exclude the node),
    77 is ignored (a peer died; requeue without blaming this node).
    """

    PASS = 0
    SCREENER_ERROR = 1  # the screener itself failed: never a hardware verdict
    USAGE = 2  # bad command line or bad input file
    INCONCLUSIVE = 3  # nothing to compare against
    # A burn-in whose stages all passed but that was not a full one (shorter, fewer rounds, a
    # stage skipped) on a node that therefore stays in burnin: not a pass, and no fault either.
    PARTIAL = 4
    HARDWARE_SUSPECT = 75
    NUMERIC = 76  # non-finite numbers not blamed on hardware
    PEER_FAILED = 77

    @property
    def meaning(self) -> str:
        """What the code says, in the words of `screener --help` (the one home of that text)."""
        return _EXIT_MEANINGS[self]


_EXIT_MEANINGS: dict[ExitCode, str] = {
    ExitCode.PASS: "pass",
    ExitCode.SCREENER_ERROR: "the screener itself failed (never a hardware verdict)",
    ExitCode.USAGE: "usage error or bad input",
    ExitCode.INCONCLUSIVE: "inconclusive (nothing to compare against)",
    ExitCode.PARTIAL: "partial burn-in: every stage passed, the node stays in burnin",
    ExitCode.HARDWARE_SUSPECT: "hardware suspect",
    ExitCode.NUMERIC: "numeric failure, not blamed on hardware",
    ExitCode.PEER_FAILED: "a peer failed",
}


class Severity(enum.IntEnum):
    """How bad a finding is; ordered so that max() gives the worst of several."""

    OK = 0
    INFO = 1
    WARNING = 2
    SUSPECT = 3
    CRITICAL = 4

    @property
    def label(self) -> str:
        return self.name.lower()

    @classmethod
    def parse(cls, text: str) -> "Severity":
        try:
            return cls[text.upper()]
        except KeyError:
            raise ValueError(f"unknown severity {text!r}; expected one of "
                             f"{', '.join(s.label for s in cls)}") from None


class NodeState(str, enum.Enum):
    """The five lifecycle states; the value is what the `screener.io/state` label holds."""

    BURNIN = "burnin"
    HEALTHY = "healthy"
    SUSPECT = "suspect"
    QUARANTINED = "quarantined"
    REPAIR = "repair"

    @classmethod
    def parse(cls, text: str) -> "NodeState":
        try:
            return cls(text.strip().lower())
        except ValueError:
            raise ValueError(f"unknown node state {text!r}; expected one of "
                             f"{', '.join(s.value for s in cls)}") from None


# States that take a node out of service and count against the quarantine budget.
BUDGET_STATES = frozenset({NodeState.QUARANTINED, NodeState.REPAIR})
# States in which a node takes no new work: tainted NoSchedule, and not screened while idle.
NO_WORK_STATES = frozenset({NodeState.SUSPECT, NodeState.QUARANTINED, NodeState.REPAIR})


class Outcome(str, enum.Enum):
    """The result of a known-answer screen of one device (or of a whole run)."""

    PASS = "pass"
    SUSPECT = "suspect"
    INCONCLUSIVE = "inconclusive"


# --- Kubernetes conventions shared by the stores, the daemon and the manifests -------------------

LABEL_STATE = "screener.io/state"
TAINT_STATE_KEY = "screener.io/state"  # value = state, effect NoSchedule, on every state but healthy
TAINT_SCREENING_KEY = "screener.io/screening"  # value "true", NoSchedule, only during an idle screen
CONDITION_TYPE = "GPUHardwareSuspect"
ANNOTATION_VERDICT = "screener.io/verdict"
ANNOTATION_HISTORY = "screener.io/history"
ANNOTATION_DIGESTS = "screener.io/kat-digests"
# the results a node's devices reproduced, which other nodes of its platform count towards a
# quorum where the platform has no golden (screener.known_answer.verdict.quorum,
# stores/kube/quorum.py)
ANNOTATION_CANDIDATES = "screener.io/kat-candidates"

ALARM_DIR_ENV = "SCREENER_ALARM_DIR"
DEFAULT_ALARM_DIR = "/var/run/screener/alarms"
NODE_NAME_ENV = "NODE_NAME"
EXIT_DIR_ENV = "SCREENER_EXIT_DIR"  # set by screener launch: run_guarded records its exit code there

# --- text from outside ---------------------------------------------------------------------------
#
# The one rule for free text read from a file another party wrote (an alarm's job, a golden's
# labels) and for what is printed of stored text: printable characters only. str.isprintable()
# is Unicode's own line: it refuses the C0 and C1 controls and DEL (Cc), the format characters
# with the bidi overrides and isolates U+202A..U+202E and U+2066..U+2069 (Cf), lone UTF-16
# surrogates (Cs, which no UTF-8 stream can carry: printing one raises UnicodeEncodeError),
# private-use and unassigned code points, and every separator but the ASCII space (U+2028 and
# U+2029 break a log line as a newline does).

def printable_text(value: Any, what: str, limit: int) -> str:
    """`value` if it is a string of at most `limit` printable characters (see above); else
    ValueError, one line, naming `what` and the first offending character by its code point."""
    if not isinstance(value, str):
        raise ValueError(f"{what} is not a string")
    if len(value) > limit:
        raise ValueError(f"{what} is {len(value)} characters long (at most {limit})")
    for i, c in enumerate(value):
        if not c.isprintable():
            raise ValueError(f"{what} holds U+{ord(c):04X} at position {i}, which is not a "
                             f"printable character (controls, bidi and format characters, "
                             f"surrogates and line separators are refused)")
    return value


def shown(text: Any) -> str:
    """`text` as it may be printed on a terminal or in a log line: every character that is not
    printable (see printable_text) written as its Python escape (\\x1b, \\u202e, \\ud800),
    so records stored before that rule, or text from elsewhere, can never reorder a line, start a
    new one, or fail to encode."""
    s = text if isinstance(text, str) else str(text)
    if s.isprintable():
        return s
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii")
                   for c in s)


class StrValue(str, enum.Enum):
    """A str enum that formats as its value on every Python (f-strings, str(), JSON, YAML).

    Python 3.11 made format() of a (str, Enum) member give `Class.NAME`; values that end up in
    Kubernetes objects, alarm files and messages must stay the plain strings they always were.
    """

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


class Reason(StrValue):
    """The CamelCase reason of a transition: the GPUHardwareSuspect condition's and the Event's.

    Reasons derived from a probe finding's code (e.g. RowRemapPending) are made from the code by
    screener.lifecycle.machine.camel and are not listed here.
    """

    # evidence against the hardware
    KNOWN_ANSWER_MISMATCH = "KnownAnswerMismatch"
    RING_REPLAY = "RingReplayMismatch"
    SPIKE_RERUN = "SpikeRerunMismatch"  # a loss/gradient spike a rerun elsewhere did not reproduce
    WEIGHTS = "WeightFingerprintMismatch"
    OPTIMIZER_UPDATE = "OptimizerUpdateMismatch"  # an FSDP2 shard's update, recomputed elsewhere
    NONFINITE = "NonFiniteGradient"
    ROW_REMAP = "RowRemapFailure"
    STRAGGLER = "Straggler"
    HARDWARE_ERROR_IN_JOB = "HardwareErrorInJob"
    REPEATED_FAILURES = "RepeatedFailures"
    RESET_REQUIRED = "ResetRequired"
    PREFLIGHT = "PreflightFailed"  # screener preflight at a job's start: probes or known answers
    # the lifecycle's own moves
    NEW_NODE = "NewNode"
    KNOWN_ANSWER_PASSED = "KnownAnswerPassed"
    BUDGET = "QuarantineBudgetExhausted"
    REMEDIATED = "RemediationPassed"
    REMEDIATION_FAILED = "RemediationFailed"
    REPAIR_STEP = "RepairStep"  # a quarantined node's repair in progress (a reboot requested)
    MANUAL = "ManualDecision"
    ADOPTED = "AdoptedUnscreened"
    REPLACED = "NodeReplaced"


@dataclass(frozen=True)
class Finding:
    """One observation from a probe (NVML, kernel log, host) that the lifecycle can act on."""

    severity: Severity
    code: str  # short stable identifier, e.g. "row_remap_pending", "xid"
    message: str
    gpu: Optional[str] = None  # GPU index, UUID or PCI bus id; None for host-level findings
    evidence: Mapping[str, Any] = field(default_factory=dict)
    action: str = ""  # recommended action, in words

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["severity"] = self.severity.label
        d["evidence"] = dict(self.evidence)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Finding":
        return cls(severity=Severity.parse(d["severity"]), code=str(d["code"]),
                   message=str(d["message"]), gpu=d.get("gpu"),
                   evidence=dict(d.get("evidence") or {}), action=str(d.get("action") or ""))


@dataclass(frozen=True)
class Verdict:
    """The outcome of a known-answer screen of one device, with where results first differ."""

    device: str
    outcome: Outcome
    reason: str = ""  # e.g. "golden_mismatch", "peer_mismatch", "self_mismatch", "timeout", "crash"
    job: Optional[str] = None
    step: Optional[int] = None
    tensor: Optional[str] = None
    expected: Any = None
    observed: Any = None
    platform_hash: Optional[str] = None
    evidence: Mapping[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["outcome"] = self.outcome.value
        d["evidence"] = dict(self.evidence)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Verdict":
        return cls(device=str(d["device"]), outcome=Outcome(d["outcome"]),
                   reason=str(d.get("reason") or ""), job=d.get("job"), step=d.get("step"),
                   tensor=d.get("tensor"), expected=d.get("expected"), observed=d.get("observed"),
                   platform_hash=d.get("platform_hash"), evidence=dict(d.get("evidence") or {}))


@dataclass(frozen=True)
class SuspectNode:
    """Where a suspect rank runs: the Kubernetes node, the host, and the cloud instance if known."""

    node: str
    hostname: str
    instance_id: Optional[str] = None


class RunStatus(StrValue):
    """How a device's known-answer child ended
    (screener.known_answer.verdict.runs.DeviceRun.status).

    Only OK runs are compared; the others become a verdict (or an exception) on their own, and
    the value is written as the verdict evidence's "status".
    """

    OK = "ok"
    TIMEOUT = "timeout"  # no progress within the timeout; killed by the parent
    CRASH = "crash"  # died of a signal other than SIGKILL, or exited without finishing
    KILLED = "killed"  # SIGKILL from outside (the OOM killer, an operator): not the device
    DEVICE_ERROR = "device_error"  # a CUDA error, ECC, illegal access inside a job
    SCREENER_ERROR = "screener_error"  # a bug of ours in the child: ScreenerError, exit 1
    # A job raised an exception that is not plainly ours (an IndexError from an index tensor
    # the device computed wrong): a crash of the device when peers or a golden show the job
    # completes, else a bug of ours.
    JOB_ERROR = "job_error"
    BAD_INPUT = "bad_input"  # a missing device, a job that cannot fit: BadInputError, exit 2


class KnownAnswerReason(StrValue):
    """Why a device's known-answer verdict is not a pass (Verdict.reason of a screen).

    The first four repeat the RunStatus a child ended with; the next eight come from comparing
    results with goldens, peers and the device's own repeats
    (screener.known_answer.verdict.judgment).
    """

    TIMEOUT = "timeout"
    CRASH = "crash"
    KILLED = "killed"
    DEVICE_ERROR = "device_error"
    SELF_MISMATCH = "self_mismatch"  # the device disagrees with its own repeats
    GOLDEN_MISMATCH = "golden_mismatch"
    PEER_MISMATCH = "peer_mismatch"  # differs from a strict majority of its platform's devices
    PEER_SPLIT = "peer_split"  # devices of one platform disagree and no strict majority agrees
    GOLDEN_DISAGREES_WITH_PEERS = "golden_disagrees_with_peers"
    SIBLING_GOLDEN_DIFFERS = "sibling_golden_differs"
    NO_GOLDEN = "no_golden"
    INCOMPLETE = "incomplete"  # the job produced no result on the device
    # reproduced itself on another result than this node's earlier screens kept (no golden)
    EARLIER_SCREENS_DIFFER = "earlier_screens_differ"
    # no golden: the result differs from what a quorum of other nodes of the platform gave
    # (screener.known_answer.verdict.quorum), or too few of them agree yet to be a reference
    QUORUM_MISMATCH = "quorum_mismatch"
    AWAITING_QUORUM = "awaiting_quorum"
    # the engine's other comparisons (screener.known_answer.verdict.crosscheck, allreduce,
    # peer_training; a peer burn-in's alarm gives "peer_<check>", made from the alarm's check)
    FLEET_DIGEST_MISMATCH = "fleet_digest_mismatch"  # a platform's digest differs across nodes
    COLLECTIVE_MISMATCH = "collective_mismatch"  # an all-reduce result differs from its known sum
    PEER_COLLECTIVE_MISMATCH = "peer_collective_mismatch"


def node_name(environ: Optional[Mapping[str, str]] = None) -> str:
    """This machine's node name: $NODE_NAME (the Kubernetes downward API) when set and not blank,
    stripped, else the hostname.

    The one rule for every part that names the node it runs on (the daemon, burn-in, the kube
    store's Event reporter, the in-job audit, the all-reduce check), so an alarm written by a job
    and the daemon reading it always agree on the name. environ: a mapping to read instead of
    os.environ (tests, a config's environment).
    """
    env = os.environ if environ is None else environ
    return env.get(NODE_NAME_ENV, "").strip() or socket.gethostname()


class ScreenStop(StrValue):
    """Why an idle-time screening window ended without a verdict (screener.agent.screening.window):
    the screen's `stopped`, the verdict annotation's, and the screener_screen_stops_total label. A
    stopped screen is inconclusive: it says nothing about the hardware."""

    YIELDED = "yielded"  # a job landed on the node
    TIME_CAP = "time_cap"
    SHUTDOWN = "shutdown"  # the daemon got SIGTERM
    ERROR = "error"  # the runner failed (our problem, exit 1)
    TAINT_FAILED = "taint_failed"  # could not taint the node: no screen without the taint


class AlarmResult(StrValue):
    """What became of an alarm file the daemon's intake took (the screener_alarms_total label)."""

    APPLIED = "applied"
    DUPLICATE = "duplicate"  # applied before: moved aside without applying it again
    REJECTED = "rejected"  # unreadable or invalid: moved to rejected/


# The alarm record, its check names and its id bound moved to screener.alarmfile, the alarm file's
# contract, which builds on this module: a static import of it here would be a cycle, so the old
# names (`from screener.types import AlarmRecord`) resolve on first use instead.
_MOVED_TO_ALARMFILE = {"AlarmRecord": "AlarmRecord", "ALARM_CHECK_REASONS": "CHECKS",
                       "MAX_ID_LEN": "MAX_ID_LEN"}


def __getattr__(name: str) -> Any:
    if name in _MOVED_TO_ALARMFILE:
        import importlib
        import warnings

        new = _MOVED_TO_ALARMFILE[name]
        warnings.warn(f"screener.types.{name} moved: import {new} from screener.alarmfile",
                      DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module("screener.alarmfile"), new)
    if name == "KatReason":  # renamed: one name for the known-answer screen (issue 37.2)
        import warnings

        warnings.warn("screener.types.KatReason is now KnownAnswerReason", DeprecationWarning,
                      stacklevel=2)
        return KnownAnswerReason
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
