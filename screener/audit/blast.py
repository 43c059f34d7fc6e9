"""The blast-radius rule: silent data corruption is local, so a verdict that is not is no hardware verdict.

One faulty GPU sits on one node. A settled verdict that names ranks on more than one node, or more
than half of all ranks, says more about the training setup or the software than about any GPU: a
nondeterministic kernel, randomness the replay cannot restore, a code path that differs by rank.
Such a verdict becomes `NumericFailure` (exit 76) with its evidence; no node gets an alarm file.
The same holds for a step that does not even reproduce on its own rank (the self-check).

Pure: plain ranks and node names in, a reason (or None) out.
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

__all__ = ["too_wide", "LIKELY_CAUSES"]

LIKELY_CAUSES = (
    "usual causes: nondeterministic kernels (torch.use_deterministic_algorithms(True), "
    "CUBLAS_WORKSPACE_CONFIG=:4096:8, or screener.determinism.make_deterministic), randomness the "
    "replay cannot restore (a torch.Generator of your own, random numbers drawn in loss_fn before "
    "the model's forward: call auditor.begin_step() first), a GradScaler not passed as "
    "Auditor(scaler=...), gradient accumulation not declared (accumulation_steps=...), autocast "
    "outside loss_fn, zero_grad(set_to_none=False), different torch thread counts, torch.compile "
    "around the DDP model (compile inside it: DDP(torch.compile(model))) or compiling different "
    "graphs on different ranks (new shapes recompiled: compile with fixed shapes, dynamic=False), "
    "or a code path that depends on the rank")


def too_wide(suspects: Sequence[int], node_of: Mapping[int, str], world_size: int) -> Optional[str]:
    """Why naming these ranks is no hardware verdict, or None when it may be one."""
    nodes = sorted({node_of[r] for r in suspects})
    if len(nodes) > 1:
        return (f"the suspects span {len(nodes)} nodes ({', '.join(nodes)}); silent data "
                f"corruption is local to one GPU")
    if 2 * len(set(suspects)) > world_size:
        return (f"{len(set(suspects))} of {world_size} ranks are suspects; silent data corruption "
                f"is local to one GPU")
    return None
