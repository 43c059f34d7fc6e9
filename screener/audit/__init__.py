"""In-job silent data corruption checks for PyTorch DDP, FSDP2 and HSDP: a few lines in a loop.

    import sys

    from screener.audit import Auditor, SDCAlarm, rollback_target, run_guarded, shutdown

    def main():
        auditor = Auditor(ddp_model, loss_fn=compute_loss, batch_fn=batch_for,
                          audit_every=50, weights_every=100)
        for step in range(start, total):
            ...; loss.backward()
            auditor.check_gradients(step, loss)   # check 1 every step, check 2 on audit steps
            optimizer.step()
            auditor.check_weights(step)           # check 3 every weights_every steps
            if step % ckpt_every == 0:
                auditor.verified_save(lambda: save(step), step)
        auditor.close()

    sys.exit(shutdown(run_guarded(main)))  # SDCAlarm -> 75, numeric -> 76, peer lost -> 77,
                                           # a setup it refuses -> 2, its own failure -> 1

The same Auditor takes a model sharded with fully_shard (FSDP2, HSDP, and either over a tensor-
parallel model: tensor_parallel); pass the loop's batch
instead of a batch_fn: `auditor.check_gradients(step, loss, batch=batch)` (screener.audit.sharded).
Given a torch.distributed.pipelining schedule (GPipe or 1F1B, FSDP2 per stage), it audits the
pipelines: `auditor.check_gradients(step, losses, batch=what_this_rank_gave_the_schedule)`
(screener.audit.pipeline).

Modules, one job each. The entry points: auditor (the DDP Auditor, and the one entry point that
hands a sharded model or a pipeline schedule on), sharded (the FSDP2/HSDP auditor), pipeline (the
pipeline-parallel auditor), config (AuditConfig). The checks, each
for both auditors: nonfinite (check 1, NaN/Inf in a rank's or the reduced gradient), ring_audit
(check 2, the ring replay with its self-check and referee rounds), weight_check (check 3, the
weight vote and verified saves), attribution (the spike sentinel's attribution between audits).
How they run: protocol (the round protocol: the collectives of each entry point in one order, as
code), cadence (which step runs which check), reporting (how a verdict ends: alarm file, log line,
History), ddp_replay (DDP's local replays), fsdp_tap (the reduce-scatter recorders inside FSDP),
sharded_rounds (FSDP's lockstep replays and the batches they ship), pipeline_plan (which pipeline
replays which, and the stage where two runs part), update_buddy (the optimizer update recomputed
on another node), reduction (the rule that says
whom a reduction that went bad names, for both), layout (what every rank holds, agreed at
construction: audited or refused alike), tensor_parallel (which ranks replay together under
TP). The parts below them: topology
(rank -> node, host, instance), base (what the three auditors share: AuditorBase, the
cadence and the context manager), hooks (the DDP comm hook recording local gradients), ring (replay
assignment and recomputation), sentinel (the spike test and the verdict of its rerun), vote
(majority over replicas), blast (the blast-radius rule), capture (RNG states and loss scale a
replay starts from), collective (the gathers), alarms (SDCAlarm, the exception classes and alarm
files), refusals (the setups refused, and why), checkpoints (verified-save markers, rollback
target), guard (run_guarded, shutdown and the exit codes), straggler (slow ranks). Imports only
torch, the standard library, screener.types, screener.atomicfile, screener.alarmfile (the alarm
file's contract, shared with the daemon's intake) and screener.fingerprint.
"""

from __future__ import annotations

from screener.audit.alarms import AuditError, AuditUsageError, NumericFailure, SDCAlarm
from screener.audit.auditor import AuditConfig, Auditor
from screener.audit.base import AuditorBase
from screener.audit.checkpoints import rollback_target
from screener.audit.guard import classify, run_guarded, shutdown
from screener.audit.topology import RankInfo, Topology, gather_topology

__all__ = ["Auditor", "AuditorBase", "AuditConfig", "AuditError", "AuditUsageError", "SDCAlarm", "NumericFailure",
           "rollback_target", "run_guarded", "shutdown", "classify", "RankInfo", "Topology",
           "gather_topology"]
