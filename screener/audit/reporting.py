"""Where a verdict goes, for both auditors: the blast-radius rule, an alarm file, a log line.

Every check ends the same way when it finds something: an SDCAlarm (settled or not) or a
NumericFailure, raised on every rank alike from gathered data. `Reporter` is that ending, shared
by the DDP and the FSDP2/HSDP auditor: a settled verdict wider than one node or half the ranks
becomes a NumericFailure (blast.py); otherwise the node's lowest rank writes the node's alarm file
(alarms.py), every rank logs one JSON line on the "screener.audit" logger and raises.

`History` is what the alarms say about time: the first step checked and the last clean audit and
weight check, from which an alarm's first_suspect_step (the earliest step whose update may carry
the fault) follows.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Callable, NoReturn, Optional, Sequence

from screener.audit.alarms import NumericFailure, SDCAlarm, alarm_dir, log_json, node_records, \
    write_alarm_file
from screener.audit.blast import LIKELY_CAUSES, too_wide
from screener.audit.topology import Topology

__all__ = ["History", "Reporter"]


@dataclass
class History:
    """The steps an alarm's window is measured from (the same on every rank)."""

    first_step: Optional[int] = None
    last_clean_audit: Optional[int] = None
    last_clean_weights: Optional[int] = None

    def note(self, step: int) -> None:
        """A check ran at this step (the first one opens the window)."""
        if self.first_step is None:
            self.first_step = step

    def window_start(self, last_clean: Optional[int], step: int) -> int:
        """The first step a fault found at `step` may have touched: the step after the last
        clean check, else the first step checked."""
        if last_clean is not None:
            return last_clean + 1
        return self.first_step if self.first_step is not None else step


class Reporter:
    """The one way a check ends: an alarm file on the suspect's node and a line in every log."""

    def __init__(self, topology: Topology, rank: int, world_size: int, *, job: str,
                 alarm_dir: Optional[str | os.PathLike[str]]) -> None:
        self.topology = topology
        self.rank = rank
        self.world_size = world_size
        self.job = job
        self.alarm_dir = alarm_dir
        me = topology.info(rank)
        self.hostname, self.node = me.hostname, me.node
        # Called with every verdict (step, named ranks, settled, evidence; a numeric failure is
        # never settled) before anything is written: every rank reaches a verdict alike, so it
        # may run a collective. HSDP's shard vote, which may find the hardware first.
        self.before_verdict: Optional[Callable[[int, Sequence[int], bool, dict[str, Any]],
                                               None]] = None

    def key(self, check: str, step: int) -> str:
        """The alarm's key: the same on every rank for one check at one step."""
        return f"{self.job}-{check}-s{step}" if self.job else f"{check}-s{step}"

    def log(self, level: int, event: str, **fields: Any) -> None:
        """One JSON line on the audit's logger, with this rank's place."""
        log_json(level, event, rank=self.rank, hostname=self.hostname, node=self.node, **fields)

    def numeric(self, step: int, ranks: list[int], evidence: dict[str, Any],
                reason: Optional[str] = None) -> NoReturn:
        """Numbers no hardware explains (exit 76): log and raise NumericFailure."""
        if self.before_verdict is not None:
            self.before_verdict(step, ranks, False, {"numeric_failure": reason or "",
                                                     "evidence": evidence})
        self.log(logging.ERROR, "numeric_failure", step=step, ranks=ranks, reason=reason,
                 evidence=evidence)
        raise NumericFailure(step, ranks, evidence, reason)

    def alarm(self, alarm: SDCAlarm) -> NoReturn:
        """Drop this node's alarm file (if this rank writes for it), log one line, raise.

        A settled verdict wider than one node or half the ranks is no hardware verdict (blast.py):
        NumericFailure instead, and no file anywhere.
        """
        if self.before_verdict is not None and alarm.check != "weights":
            self.before_verdict(alarm.step, alarm.suspect_ranks, alarm.settled,
                                {"alarm": alarm.check, "evidence": alarm.evidence})
        topo = self.topology
        node_of = {r: topo.node_of(r) for r in topo.ranks}
        if alarm.settled:
            wide = too_wide(alarm.suspect_ranks, node_of, self.world_size)
            if wide is not None:
                evidence = {"alarm": alarm.to_dict(), "why": wide}
                self.numeric(alarm.step, list(alarm.suspect_ranks), evidence, reason=(
                    f"{alarm.check} would name rank(s) {', '.join(map(str, alarm.suspect_ranks))}"
                    f", but {wide}: this is the training setup or the software, not a GPU; "
                    f"{LIKELY_CAUSES}"))
        files: list[str] = []
        records = node_records(alarm, node_of,
                               {n: topo.suspect_node(topo.ranks_on(n)[0]) for n in topo.nodes},
                               job=self.job)
        record = records.get(self.node)
        if record is not None and topo.writer_of(self.node) == self.rank:
            directory = alarm_dir(self.alarm_dir)
            try:
                files.append(str(write_alarm_file(record, directory)))
            except OSError as e:
                self.log(logging.ERROR, "alarm_file_failed", directory=str(directory),
                         error=f"{type(e).__name__}: {e}")
        self.log(logging.ERROR, "sdc_alarm", files=files, alarm=alarm.to_dict())
        raise alarm
