"""The training setups the Auditor refuses, each with one line that says why and what to do instead.

A setup whose steps no replay can reproduce bit for bit cannot be audited: accepted, it would die at
its first audit step, of a NumericFailure (the replays disagree with the step, exit 76) or of an
AuditError (a replay cannot run, exit 1), which for a user is as bad as a false alarm. So each such
setup the audit knows of is refused instead, on every rank alike, before any verdict:
AuditUsageError, exit 2, one line.

- torch.compile around the DDP model, `torch.compile(DDP(model))`: the training step runs compiled
  code, the replays run DDP's module, eager code, whose bits differ (a fused kernel rounds
  differently). Compiled the other way round, `DDP(torch.compile(model))`, DDP's module is the
  compiled callable itself and the replays run it: audited. Found when the Auditor is given the
  compiled wrapper; when it is given the DDP model and the loop calls a compiled wrapper of it,
  on the first forward (dynamo traces the DDP model's forward pre-hooks, where the Auditor looks),
  and the first check_gradients refuses before any collective of its own.
- SyncBatchNorm: its forward is a collective over all ranks, which one rank's replay cannot run.
- CPU ranks with different torch thread counts: CPU kernels split their sums by thread count.
- CUDA without deterministic algorithms: several kernels pick their summation order at run time.

Audited, not refused: reentrant activation checkpointing (`use_reentrant=True`), which refuses the
replay's torch.autograd.grad; ring.py replays it with a backward pass into parameter aliases.

Imports only torch and the standard library (and the audit's exception classes).
"""

from __future__ import annotations

from typing import Sequence

import torch

from screener.audit.alarms import AuditUsageError

__all__ = ["refuse_compiled_wrapper", "refuse_unreplayable", "refuse_placement",
           "COMPILED_AROUND_DDP"]

COMPILED_AROUND_DDP = (
    "screener.audit: the DDP model runs inside torch.compile (torch.compile(DDP(model))): the "
    "training step runs compiled code that the replays, which run DDP's module, cannot reproduce "
    "bit for bit; compile the module inside DDP instead, DDP(torch.compile(model)), and give "
    "that DDP model to the Auditor")


def refuse_compiled_wrapper(model: torch.nn.Module) -> None:
    """AuditUsageError for a torch.compile wrapper (or any wrapper keeping the original module in
    `_orig_mod`) around the DDP model: the Auditor would otherwise take its forwarded `.module`,
    the eager one."""
    if isinstance(getattr(model, "_orig_mod", None), torch.nn.Module):
        raise AuditUsageError(COMPILED_AROUND_DDP)


def refuse_unreplayable(module: torch.nn.Module) -> None:
    """AuditUsageError for a model no replay can reproduce bit for bit, whatever the ranks."""
    for name, m in module.named_modules():
        if isinstance(m, torch.nn.SyncBatchNorm):
            raise AuditUsageError(
                f"screener.audit: {name or 'the model'} is a SyncBatchNorm, whose forward is a "
                f"collective over all ranks: a replay of one rank's micro-batch cannot reproduce "
                f"it (use BatchNorm, or audit_every=0 for the weight vote only)")


def refuse_placement(device: torch.device, threads: Sequence[int]) -> None:
    """AuditUsageError for ranks whose kernels cannot agree bit for bit: different CPU thread
    counts (every rank's, from the topology), CUDA without deterministic algorithms."""
    if device.type == "cpu" and len(set(threads)) > 1:
        raise AuditUsageError(
            f"screener.audit: the ranks run {sorted(set(threads))} torch threads; CPU kernels "
            f"split sums by thread count, so replays cannot match bit for bit (call "
            f"torch.set_num_threads with one value on every rank)")
    if device.type == "cuda" and not torch.are_deterministic_algorithms_enabled():
        raise AuditUsageError(
            "screener.audit: on CUDA the audit replays bit for bit only with deterministic "
            "kernels: call torch.use_deterministic_algorithms(True) and set "
            "CUBLAS_WORKSPACE_CONFIG=:4096:8 (or screener.determinism.make_deterministic) before "
            "the Auditor")
