"""Check 1: NaN/Inf in a rank's loss or local gradient, or in the reduced gradient.

Every step, one all_gather of (loss, local gradient's largest magnitude, reduced gradient's) per
rank (the round protocol's "head"); this check reads it. Finiteness is always a property of the
values, never of a norm that could overflow.

- Some ranks' loss or local gradient not finite: each is replayed on another node (its ring
  replayer, else a clean rank on the nearest node before; one "confirm" round). A finite replay
  names the rank (settled "nonfinite_local"); a non-finite one is the model's or the data's doing
  (NumericFailure, exit 76). With a GradScaler, every rank overflowing, or a replay overflowing at
  the same scale, is the scaler's business (it skips the step; counted, no alarm).
- Every local gradient finite, the reduced one not: past the gradient dtype's largest value the
  sum overflowed (the scaler's, or a numeric failure); below it the reduction made the NaN/Inf.
  Every rank replays its own step, the values it sent at the places some rank received NaN/Inf
  are gathered, and the bad bucket's all-reduce runs once more for real on the recomputed
  gradients, through the reduction the job uses ("redo_*" rounds): the alarm
  ("nonfinite_reduced", never settled) says what the redo shows and suspects only what it
  supports (reduction.py), since an all-reduce does not say on which link or GPU.

`NonFiniteCheck` is DDP's (replays local to each rank). `ShardedNonFinite` is the FSDP2/HSDP
auditor's: the same rules on its head (finite flags from the reduce-scatter recorders, magnitudes
after FSDP's pre-division, the reduce dtype's range as the bound), its confirmations in lockstep
rounds (sharded_rounds.py). Its redo runs inside one lockstep replay of every rank's own step:
the bad modules' reduce-scatter (and HSDP's all-reduce after it) runs again for real on the
recomputed inputs (fsdp_tap.py), so it too sees whether the fault stays ("redo_places",
"redo_offer", "redo_replay", "redo_values"). Both read their evidence through one
rule (reduction.py): a fault the redo does not reproduce and every holder of the result saw names
nobody and suspects nobody; one seen by only some holders of a shared result, or reproduced,
makes those ranks the candidates; no "nonfinite_reduced" alarm is settled.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from dataclasses import replace
from typing import Any, Callable, Optional, Sequence

import torch

from screener.audit.alarms import SDCAlarm
from screener.audit.capture import StepState, scaler_scale
from screener.audit.ddp_replay import LocalReplayer
from screener.audit.fsdp_tap import MAX_PLACES
from screener.audit.hooks import GradientRecorder, largest_magnitude
from screener.audit.protocol import Walk, error_flag, raise_if_failed
from screener.audit.reduction import ReductionEvidence, ReductionVerdict, reduction_verdict
from screener.audit.reporting import History, Reporter
from screener.audit.sharded_rounds import H_LOCAL, H_LOCAL_MAG, H_REDUCED, Lockstep, from_bits

__all__ = ["NonFiniteCheck", "ShardedNonFinite", "as_json_number"]

States = Callable[[], dict[int, StepState]]  # every rank's step state (maybe a collective)


def as_json_number(x: float) -> Any:
    """A float for JSON evidence: non-finite values as strings ("nan", "inf")."""
    return x if math.isfinite(x) else str(x)


def scaler_skip(counters: Counter[str], reporter: Reporter, scaler: Any, step: int,
                ranks: list[int], why: str) -> None:
    """A step the loss scaler owns (it skips it; so does the audit): counted and logged, for
    both auditors alike."""
    counters["scaler_skipped"] += 1
    reporter.log(logging.INFO, "scaler_skipped_step", step=step, ranks=ranks, why=why,
                 scale=scaler_scale(scaler))


class NonFiniteCheck:
    """Check 1 on the gathered (loss, local magnitude, reduced magnitude) of every rank (DDP)."""

    def __init__(self, replayer: LocalReplayer, reporter: Reporter, history: History,
                 counters: Counter[str], *, scaler: Any, confirm: bool, audits_on: bool) -> None:
        self.replayer, self.reporter, self.history = replayer, reporter, history
        self.counters = counters
        self.scaler = scaler
        self.confirm = confirm
        self.audits_on = audits_on
        self.topology = reporter.topology
        self.world_size = reporter.world_size
        # the comm hook's recorder (set by the Auditor once installed): the redo of a bad
        # reduction goes through it; without it the reduction is not redone
        self.recorder: Optional[GradientRecorder] = None

    def scaling(self) -> bool:
        """Whether an enabled GradScaler owns overflowing steps."""
        return self.scaler is not None and bool(self.scaler.is_enabled())

    def judge(self, walk: Walk, step: int, g: torch.Tensor, states: States) -> bool:
        """Check 1 on the gathered (world, 3) head. Returns True when the step is the loss
        scaler's to skip (no alarm); raises on a verdict."""
        finite = torch.isfinite(g)
        if bool(finite.all()):
            return False
        ranks = self.topology.ranks
        local_ok = (finite[:, 0] & finite[:, 1]).tolist()
        flagged = sorted(ranks[k] for k, ok in enumerate(local_ok) if not ok)
        if flagged:
            if self.scaling() and len(flagged) == self.world_size:
                self._scaler_skip(step, flagged, "every rank's gradient is non-finite at this "
                                                 "scale: an overflow, the scaler skips the step")
                return True
            self._nonfinite_local(walk, step, flagged, g, states)
            return True  # reached only when the scaler explains it
        seeing = sorted(ranks[k] for k, ok in enumerate(finite[:, 2].tolist()) if not ok)
        return bool(seeing) and self._nonfinite_reduced(walk, step, g, seeing, states)

    def _per_rank(self, column: torch.Tensor, ranks: Sequence[int]) -> dict[str, Any]:
        index = self.topology.index_of
        return {str(r): as_json_number(float(column[index(r)])) for r in ranks}

    def _scaler_skip(self, step: int, ranks: list[int], why: str) -> None:
        scaler_skip(self.counters, self.reporter, self.scaler, step, ranks, why)

    # ---- the reduced gradient ---------------------------------------------------------------

    def _nonfinite_reduced(self, walk: Walk, step: int, g: torch.Tensor, seeing: list[int],
                           states: States) -> bool:
        """Every local gradient finite, the reduced one NaN/Inf on the ranks `seeing`: the sum
        overflowed (the loss scaler's business or a numeric failure), else the reduction is
        suspect. Returns True when the scaler owns it; raises otherwise."""
        ranks = sorted(self.topology.ranks)
        params = self.replayer.params
        everywhere = len(seeing) == self.world_size
        evidence: dict[str, Any] = {
            "ranks_seeing_nonfinite": seeing,
            "reduced_norm": self._per_rank(g[:, 2], seeing),
            "local_norm_max": as_json_number(float(g[:, 1].max())),
            "why": "every local gradient was finite; the all-reduce produced NaN/Inf"}
        # No element of a sum exceeds the sum of the addends' largest magnitudes: below the
        # gradient dtype's largest value the sum cannot have overflowed, so the reduction made
        # the NaN/Inf. At or past it, an overflow explains it (the default hook sums before it
        # divides; hooks.py), but only when every rank sees it: the sum is the same everywhere.
        # A compressing reduce hook (torch's fp16 compression) sends a narrower dtype than the
        # gradients': its largest value is the one the sum must stay below.
        bound = float(g[:, 1].sum())
        limit, dtype_name = params.grad_max, str(params.grad_dtype)
        wire = self.recorder.wire_dtype if self.recorder is not None else None
        if wire is not None and torch.finfo(wire).max < limit:
            limit, dtype_name = float(torch.finfo(wire).max), f"{wire} (the reduce hook's)"
        if everywhere and bound >= limit:
            evidence["why"] = (f"every local gradient was finite, but their largest magnitudes "
                               f"add up to {bound:.3g}, past the largest {dtype_name}: "
                               f"the sum overflowed")
            evidence["local_norm_sum"] = bound
            if self.scaling():
                self._scaler_skip(step, ranks, evidence["why"])
                return True
            self.reporter.numeric(step, ranks, evidence, reason=(
                f"the gradients' sum overflowed {dtype_name} at step {step} (local "
                f"magnitudes add up to {bound:.3g}): the gradients are too large, not corrupted"))
        if not everywhere:
            # An all-reduce leaves the same result on every rank: a NaN/Inf only some ranks hold
            # was made where it is seen (after the sum arrived). The candidates narrow to those
            # ranks; which GPU did it stays unsettled.
            evidence["why"] = (f"every local gradient was finite; only rank(s) "
                               f"{', '.join(map(str, seeing))} of {self.world_size} hold a "
                               f"non-finite reduced gradient, and an all-reduce gives every rank "
                               f"the same result")
        evidence["redo"], verdict = self._redo_reduction(walk, step, states, seeing, g)
        self.counters[f"reduction_{verdict.verdict}"] += 1
        evidence["verdict"] = verdict.verdict
        evidence["why"] = f"{evidence['why']}; {verdict.why}"
        self.reporter.alarm(SDCAlarm("nonfinite_reduced", step, (), (), False, evidence,
                                     candidate_ranks=verdict.candidates,
                                     first_suspect_step=step,
                                     key=self.reporter.key("nonfinite_reduced", step)))

    def _bad_positions(self, limit: int = 8) -> torch.Tensor:
        """Up to `limit` (parameter, element) places where this rank's reduced gradient is NaN/Inf,
        as int64 codes parameter * 2**40 + element, padded with -1."""
        out = torch.full((limit,), -1, dtype=torch.int64)
        n = 0
        for k, p in enumerate(self.replayer.params.grad_params):
            if p.grad is None or n >= limit:
                continue
            bad = (~torch.isfinite(p.grad.detach().reshape(-1))).nonzero().flatten()[:limit - n]
            out[n:n + bad.numel()] = bad.cpu() + k * 2 ** 40
            n += bad.numel()
        return out

    def _layout_codes(self) -> torch.Tensor:
        """Per gradient parameter, where the recorder saw it in a bucket whose reduced result was
        NaN/Inf: bucket * 2**24 + position in the bucket, -1 unknown (one int64 each)."""
        out = torch.full((len(self.replayer.params.grad_params),), -1, dtype=torch.int64)
        bad = self.recorder.last_bad_buckets() if self.recorder is not None else {}
        for index, rows in bad.items():
            if all(r >= 0 for r in rows):  # a bucket the replay can rebuild whole
                for pos, r in enumerate(rows):
                    out[r] = index * 2 ** 24 + pos
        return out

    @staticmethod
    def _redo_buckets(places: list[int], layout: list[int], dtypes: list[torch.dtype]
                      ) -> list[tuple[int, list[int]]]:
        """The buffers to reduce again, the same on every rank (from gathered data): each bad
        bucket whole, its parameters in bucket order; a bad parameter of no known bucket with
        the others of its dtype, in parameter order (bucket index -1)."""
        bad = sorted({c >> 40 for c in places})
        buckets = sorted({layout[k] >> 24 for k in bad if layout[k] >= 0})
        out = [(b, sorted((k for k in range(len(layout)) if layout[k] >= 0
                           and layout[k] >> 24 == b), key=lambda k: layout[k]))
               for b in buckets]
        loose: dict[torch.dtype, list[int]] = {}
        for k in bad:
            if layout[k] < 0:
                loose.setdefault(dtypes[k], []).append(k)
        return out + [(-1, rows) for rows in loose.values()]

    def _redo_reduction(self, walk: Walk, step: int, states: States, seeing: list[int],
                        g: torch.Tensor) -> tuple[dict[str, Any], ReductionVerdict]:
        """Redo the reduction of the bad bucket once, for real, and compare (issue 21.5).

        "redo_places": where each rank's reduced gradient is NaN/Inf, and the layout of the
        buckets it went bad in. Every rank replays its own step (the gradient it sent, bit for
        bit) and reads it at those places; "redo_flags" agrees that every replay ran, that the
        recomputed buckets are finite and that each replay's largest magnitude is the one the
        step measured (the inputs reproduced). Only then, on every rank alike, "redo_reduce":
        each bad bucket's recomputed gradients, whole and in bucket order, go through the
        reduction the job uses (the comm hook's fused sum and division, or the caller's reduce
        hook with its state; hooks.GradientRecorder.reduce_again) over the same process group.
        "redo_values": what each rank sent to each place, what the redo gave there, and whether
        any redone value is NaN/Inf. The rule (reduction.py) reads it: finite senders, a finite
        sum and a finite redo are a one-off; NaN/Inf again names where it shows; a replay that
        fails raises on every rank alike (no redo runs)."""
        replayer, recorder = self.replayer, self.recorder
        params = replayer.params
        ranks = self.topology.ranks
        owner_states = states()  # maybe a collective: every rank is here
        found = walk.gather("redo_places", torch.cat([self._bad_positions(),
                                                      self._layout_codes()]))
        codes, layout_t = found[:, :8], found[:, 8:].max(dim=0).values
        places = sorted({int(c) for c in codes.flatten().tolist() if c >= 0})[:16]
        layout = [int(x) for x in layout_t.tolist()]
        groups = self._redo_buckets(places, layout, [p.dtype for p in params.grad_params])
        values = torch.full((max(len(places), 1),), float("nan"), dtype=torch.float64)
        flags = torch.tensor([0.0, 0.0, math.nan], dtype=torch.float64)  # error, finite, magnitude
        error: Optional[BaseException] = None
        grads: list[Optional[torch.Tensor]] = []
        if replayer.can_replay and places:
            try:
                _, grads = replayer.replay(replayer.rank, step, owner_states[replayer.rank])
                for i, code in enumerate(places):
                    gr = grads[code >> 40]
                    values[i] = 0.0 if gr is None else float(gr.reshape(-1)[code & (2 ** 40 - 1)])
                flags[1] = float(bool(torch.isfinite(largest_magnitude(
                    [grads[k] for _, rows in groups for k in rows], params.device))))
                flags[2] = float(largest_magnitude(grads, params.device))
            except Exception as e:  # noqa: BLE001 - reported collectively below
                error = e
        flags[0] = error_flag(error)
        got = walk.gather("redo_flags", flags)  # (world, 3)
        raise_if_failed(got[:, 0], ranks, error, step, "the replay that redoes the reduction")
        evidence = ReductionEvidence(seeing, ranks, ranks, "all-reduce")
        if not (replayer.can_replay and places):
            return {"done": False, "why": "no replay (loss_fn/batch_fn) to recompute what each "
                                          "rank sent" if places else "no place found"}, \
                reduction_verdict(evidence)
        reproduced: Optional[bool] = None  # not comparable: the step measured some buckets only
        if recorder is not None and recorder.measures_every_bucket:
            reproduced = all(float(got[k, 2]) == float(g[k, 1]) for k in range(len(ranks)))
        # Redo only what is known: every bad place in a bucket the hook saw go bad (a place read
        # from a .grad the loop has touched since, e.g. clipped by a NaN norm, is not), through a
        # reduction that gives the same result twice.
        placed = all(layout[c >> 40] >= 0 for c in places)
        safe = recorder is not None and recorder.redo_safe
        redo = (recorder is not None and safe and placed and bool((got[:, 1] == 1.0).all())
                and reproduced is not False)
        redone_at = torch.full((len(places) + 2,), math.nan, dtype=torch.float64)
        redone_at[-2:] = 0.0  # any redone value NaN/Inf here; an error in the redo here
        if redo:
            assert recorder is not None
            walk.enter("redo_reduce")
            try:
                for index, rows in groups:
                    members = [params.grad_params[k] for k in rows]
                    flat = [(torch.zeros_like(p) if gr is None else gr.to(p.dtype)).reshape(-1)
                            for p, gr in zip(members, (grads[k] for k in rows))]
                    out = recorder.reduce_again(max(index, 0), torch.cat(flat), members)
                    if not bool(torch.isfinite(out).all()):
                        redone_at[-2] = 1.0
                    offsets, at = {}, 0
                    for k, t in zip(rows, flat):
                        offsets[k], at = at, at + t.numel()
                    for i, code in enumerate(places):
                        if code >> 40 in offsets:
                            redone_at[i] = float(out[offsets[code >> 40] + (code & (2 ** 40 - 1))])
            except Exception as e:  # noqa: BLE001 - reported collectively below
                error = e
                redone_at[-1] = error_flag(e)
        sent = walk.gather("redo_values", torch.cat([values[:len(places)], redone_at]))
        raise_if_failed(sent[:, -1], ranks, error, step, "the redone reduction")
        judged, verdict = self._judge_redo(sent, places, evidence, reproduced, redo, groups)
        if not redo and not (safe and placed):
            judged["why"] = ("the all-reduce was not redone (" + (
                "the reduce hook may keep state between calls, e.g. PowerSGD's error feedback"
                if not safe else "a bad place lies outside every bucket the hook saw go bad")
                + "); " + verdict.why)
        return judged, verdict

    def _judge_redo(self, sent: torch.Tensor, places: list[int], evidence: ReductionEvidence,
                    reproduced: Optional[bool], redo: bool, groups: list[tuple[int, list[int]]]
                    ) -> tuple[dict[str, Any], ReductionVerdict]:
        """The gathered (world, 2 * places + 2) values as evidence rows, and the rule's verdict."""
        ranks = self.topology.ranks
        names = self.replayer.params.grad_names
        n = len(places)
        rows, sent_ok, sum_ok = [], True, True
        for i, code in enumerate(places):
            col = [float(sent[k, i]) for k in range(len(ranks))]
            total = sum(col) / len(col)
            sent_ok = sent_ok and all(math.isfinite(v) for v in col)
            sum_ok = sum_ok and math.isfinite(total)
            row: dict[str, Any] = {
                "parameter": names[code >> 40], "element": code & (2 ** 40 - 1),
                "sent": {str(r): as_json_number(v) for r, v in zip(ranks, col)},
                "mean_of_sent": as_json_number(total)}
            if redo:
                row["redone_all_reduce"] = {str(r): as_json_number(float(sent[k, n + i]))
                                            for k, r in enumerate(ranks)}
            rows.append(row)
        out: dict[str, Any] = {
            "done": True, "places": rows, "senders_finite_and_sum_finite": sent_ok and sum_ok,
            "inputs_reproduced": reproduced, "redone": redo,
            "redone_buckets": [{"bucket": b, "parameters": len(rs)} for b, rs in groups]}
        if not redo:
            verdict = reduction_verdict(replace(evidence, sent_finite=sent_ok,
                                                sum_finite=sum_ok))
            out["why"] = ("the all-reduce was not redone (" + (
                "a recomputed value at a bad place is not finite" if not sent_ok else
                "the replay did not recompute every rank's original gradient: its largest "
                "magnitude differs" if reproduced is False else
                "a recomputed gradient in the bad bucket is not finite") + "); " + verdict.why) \
                if self.recorder is not None else verdict.why
            return out, verdict
        bad = [r for k, r in enumerate(ranks) if float(sent[k, 2 * n]) == 1.0]
        out["redone_nonfinite_ranks"] = bad
        verdict = reduction_verdict(replace(evidence, sent_finite=sent_ok, sum_finite=sum_ok,
                                            redone=[("all-reduce", bad)]))
        out["why"] = verdict.why
        return out, verdict

    # ---- a rank's own gradient --------------------------------------------------------------

    def _nonfinite_local(self, walk: Walk, step: int, flagged: list[int], g: torch.Tensor,
                         states: States) -> None:
        """Settle a NaN/Inf in some ranks' local gradients; returns only when the scaler owns it."""
        reporter = self.reporter
        evidence: dict[str, Any] = {"flagged_ranks": flagged,
                                    "loss": self._per_rank(g[:, 0], flagged),
                                    "local_norm": self._per_rank(g[:, 1], flagged)}
        window = self.history.window_start(self.history.last_clean_audit, step) \
            if self.audits_on else step
        key = reporter.key("nonfinite_local", step)
        scaling = self.scaling()
        if not (self.replayer.can_replay and self.confirm):
            if scaling:
                self._scaler_skip(step, flagged, "non-finite on some ranks, no replay to confirm")
                return
            if len(flagged) == self.world_size:
                reporter.numeric(step, flagged, evidence)
            evidence["why"] = "no replay to confirm: loss_fn/batch_fn not given or turned off"
            reporter.alarm(SDCAlarm("nonfinite_local", step, (), (), False, evidence,
                                    candidate_ranks=flagged, first_suspect_step=window, key=key))
        owner_states = states()
        plan = {o: self.replayer.confirmer(o, set(flagged)) for o in flagged}
        got = self._confirm_round(walk, step, flagged, plan, owner_states)
        confirmed: list[int] = []
        reproduced: list[int] = []
        unconfirmed: list[int] = []
        replays: dict[str, Any] = {}
        for i, owner in enumerate(flagged):
            who = plan[owner]
            if who is None:
                unconfirmed.append(owner)
                continue
            finite = float(got[self.topology.index_of(who), i]) == 1.0
            replays[str(owner)] = {"replayer": who, "replay_finite": finite,
                                   "scale": owner_states[owner].scale}
            (confirmed if finite else reproduced).append(owner)
        evidence["replays"] = replays
        evidence["reproduced_ranks"] = reproduced
        if confirmed:
            evidence["why"] = ("non-finite here, finite when replayed on another node"
                               + (" at the same loss scale" if scaling else ""))
            reporter.alarm(SDCAlarm("nonfinite_local", step, confirmed,
                                    self.topology.suspect_nodes(confirmed), True, evidence,
                                    candidate_ranks=confirmed, first_suspect_step=window, key=key))
        if scaling:
            self._scaler_skip(step, flagged, "the replay at the same scale overflows too: the "
                                             "data did it")
            return
        if unconfirmed:
            evidence["why"] = "no other rank could replay the micro-batch"
            reporter.alarm(SDCAlarm("nonfinite_local", step, (), (), False, evidence,
                                    candidate_ranks=unconfirmed, first_suspect_step=window,
                                    key=key))
        reporter.numeric(step, flagged, evidence)

    def _confirm_round(self, walk: Walk, step: int, flagged: list[int],
                       plan: dict[int, Optional[int]], owner_states: dict[int, StepState]
                       ) -> torch.Tensor:
        """Each confirmer replays the flagged owners given to it; one gather of whether each
        replay came out finite (1.0), not finite (0.0) or was not this rank's (-1.0)."""
        replayer = self.replayer
        results = torch.full((len(flagged) + 1,), -1.0, dtype=torch.float64)
        error: Optional[BaseException] = None
        for i, owner in enumerate(flagged):
            if plan[owner] != replayer.rank:
                continue
            try:
                loss, grads = replayer.replay(owner, step, owner_states[owner])
                # the values themselves, not a norm whose squares could overflow (issue 28)
                ok = bool(torch.isfinite(loss).all()) and bool(
                    torch.isfinite(largest_magnitude(grads, replayer.params.device)))
                results[i] = 1.0 if ok else 0.0
            except Exception as e:  # noqa: BLE001 - reported collectively below
                error = e
        results[-1] = error_flag(error)
        got = walk.gather("confirm", results)  # (world, len(flagged) + 1)
        raise_if_failed(got[:, -1], self.topology.ranks, error, step,
                        "the non-finite confirmation replay")
        return got


class ShardedNonFinite:
    """Check 1 for FSDP2/HSDP on the gathered head (sharded_rounds.H_*): local gradients from the
    reduce-scatter inputs, the reduced one from FSDP's all-reduce hook; confirmations replay in
    lockstep rounds."""

    def __init__(self, lockstep: Lockstep, reporter: Reporter, counters: Counter[str], *,
                 scaler: Any, confirm: bool, module_names: Sequence[str] = ()) -> None:
        self.lockstep, self.reporter, self.counters = lockstep, reporter, counters
        self.module_names = list(module_names)
        self.scaler = scaler
        self.confirm = confirm
        self.topology = reporter.topology
        self.world_size = reporter.world_size

    def judge(self, walk: Walk, step: int, got: torch.Tensor, state: StepState, batch: Any,
              data: Optional[torch.Tensor]) -> bool:
        """Check 1 on the gathered flags; raises on a verdict. Returns True when the loss scaler
        owns the step (it skips it; so does the audit), False when all is finite."""
        ranks = self.topology.ranks
        bad_local = [ranks[k] for k in range(self.world_size) if int(got[k, H_LOCAL]) == 0]
        bad_reduced = [ranks[k] for k in range(self.world_size) if int(got[k, H_REDUCED]) == 0]
        if not bad_local and not bad_reduced:
            return False
        scaling = self.scaler is not None and bool(self.scaler.is_enabled())
        if bad_local and scaling and len(bad_local) == self.world_size:
            scaler_skip(self.counters, self.reporter, self.scaler, step, bad_local,
                        "every rank's local gradient is NaN/Inf: the loss scale is too high")
            return True
        if not bad_local:
            return self._nonfinite_reduced(walk, step, got, bad_reduced, scaling, state, batch,
                                           data)
        self._nonfinite_local(walk, step, bad_local, state, batch, data, scaling)
        return True

    def _nonfinite_reduced(self, walk: Walk, step: int, got: torch.Tensor, seeing: list[int],
                           scaling: bool, state: StepState, batch: Any,
                           data: Optional[torch.Tensor]) -> bool:
        """Every local gradient finite, a reduced one NaN/Inf. No element of a sum exceeds the
        sum of the addends' largest magnitudes (taken after FSDP's pre-division): past the
        reduce dtype's largest value the sum overflowed, which is the loss scaler's business (it
        skips the step: True) or a numeric failure; below it the reduction made the NaN/Inf:
        redone once (`_redo_reduction`), the alarm names only what that supports."""
        ranks = sorted(self.topology.ranks)
        dtype = self.lockstep.tap.reduce_dtype
        bound = sum(from_bits(x) for x in got[:, H_LOCAL_MAG])
        top = float(torch.finfo(dtype).max)
        evidence: dict[str, Any] = {"ranks_seeing_nonfinite": seeing, "local_magnitude_sum": bound,
                                    "reduce_dtype": str(dtype)}
        if bound >= top:
            evidence["why"] = (f"every local gradient was finite, but their largest magnitudes "
                               f"add up to {bound:.3g}, past the largest {dtype}: the sum "
                               f"overflowed")
            if scaling:
                scaler_skip(self.counters, self.reporter, self.scaler, step, ranks,
                            evidence["why"])
                return True
            self.reporter.numeric(step, ranks, evidence, reason=(
                f"the gradients' sum overflowed {dtype} at step {step}: the gradients are too "
                f"large for the reduce dtype, not corrupted"))
        evidence["redo"], verdict = self._redo_reduction(walk, step, seeing, state, batch, data)
        self.counters[f"reduction_{verdict.verdict}"] += 1
        evidence["verdict"] = verdict.verdict
        evidence["why"] = ("every local gradient was finite and their sum cannot overflow, so "
                           "the reduction made the NaN/Inf; " + verdict.why)
        self.reporter.alarm(SDCAlarm("nonfinite_reduced", step, (), (), False, evidence,
                                     candidate_ranks=verdict.candidates, first_suspect_step=step,
                                     key=self.reporter.key("nonfinite_reduced", step)))

    def _redo_reduction(self, walk: Walk, step: int, seeing: list[int], state: StepState,
                        batch: Any, data: Optional[torch.Tensor]
                        ) -> tuple[dict[str, Any], ReductionVerdict]:
        """Redo the bad modules' reduction once and compare (issue 21.5).

        One gather of where each rank's reduced gradient went NaN/Inf (module, its shard
        position, element) and of every rank's shard position ("redo_places"); the offer of
        every rank's own batch and step state ("redo_offer"); one lockstep replay in which every
        rank recomputes its own step and the recorders of the bad modules reduce-scatter the
        recomputed input for real once more (and all-reduce it across HSDP's replicas;
        fsdp_tap.py); one gather of what each rank sent to each place and what the redone
        collective gave there ("redo_values"). Every decision reads gathered data: every rank
        runs the same rounds. The rule (reduction.py) is the DDP auditor's too."""
        lockstep, topo = self.lockstep, self.topology
        tap = lockstep.tap
        ranks = topo.ranks
        rows = torch.full((MAX_PLACES + 1, 3), -1, dtype=torch.int64)
        rows[0, 0] = tap.shard_pos
        for k, (module, element) in enumerate(tap.last_bad_places[:MAX_PLACES]):
            rows[k + 1] = torch.tensor([module, tap.shard_pos, element])
        found = walk.gather("redo_places", rows)  # (world, MAX_PLACES + 1, 3)
        pos_of = {r: int(found[k, 0, 0]) for k, r in enumerate(ranks)}
        seen_at: dict[tuple[int, int, int], set[int]] = {}
        for k, r in enumerate(ranks):
            for m, pos, e in found[k, 1:].tolist():
                if m >= 0:
                    seen_at.setdefault((m, pos, e), set()).add(r)
        places = sorted(seen_at)[:2 * MAX_PLACES]
        positions = {pos for _, pos, _ in places}
        holders = [r for r in ranks if pos_of[r] in positions] or list(seeing)
        evidence = ReductionEvidence(seeing, holders, ranks, "reduce-scatter and all-reduce"
                                     if tap.replicate_group is not None else "reduce-scatter")
        offer = lockstep.offer(walk, "redo_offer", step, batch, data, state)
        if not (lockstep.can_replay and offer.ready and places):
            return {"done": False, "why": "no place found" if not places else
                    "no replay to recompute what each rank sent (no loss_fn, or a rank gave no "
                    "batch)"}, reduction_verdict(evidence)
        tap.redo = {}
        for m, pos, e in places:
            tap.redo.setdefault(m, []).append((pos, e))
        try:
            lockstep.replay(walk, "redo_replay", offer.batch, offer.states[lockstep.rank])
            redone = dict(tap.redone)
        finally:
            tap.redo = {}
        payload = torch.full((len(places), 5), math.nan, dtype=torch.float64)
        payload[:, 3:] = 0.0
        for m, wanted in {m: [(p, e) for mm, p, e in places if mm == m]
                          for m, _, _ in places}.items():
            red = redone.get(m)
            if red is None:
                continue
            for j, (pos, e) in enumerate(wanted):
                i = places.index((m, pos, e))
                payload[i] = torch.tensor([red.sent[j], red.reduce_scatter[j], red.final[j],
                                           float(red.holder[j]), float(red.reproduced)],
                                          dtype=torch.float64)
        got = walk.gather("redo_values", payload)  # (world, places, 5)
        return self._judge_redo(got, places, seen_at, evidence)

    def _judge_redo(self, got: torch.Tensor, places: list[tuple[int, int, int]],
                    seen_at: dict[tuple[int, int, int], set[int]], evidence: ReductionEvidence
                    ) -> tuple[dict[str, Any], ReductionVerdict]:
        """The redo's gathered values as evidence rows and the rule's verdict."""
        ranks = self.topology.ranks
        hsdp = self.lockstep.tap.replicate_group is not None
        reproduced = bool((got[:, :, 4] == 1.0).all())
        rows: list[dict[str, Any]] = []
        sent_ok = sum_ok = True
        rs_bad: set[int] = set()
        final_bad: set[int] = set()
        for i, (m, pos, e) in enumerate(places):
            sent = [float(got[k, i, 0]) for k in range(len(ranks))]
            mean = sum(sent) / len(sent)
            sent_ok = sent_ok and all(math.isfinite(v) for v in sent)
            sum_ok = sum_ok and math.isfinite(mean)
            here = [k for k in range(len(ranks)) if float(got[k, i, 3]) == 1.0]
            rs_bad |= {ranks[k] for k in here if not math.isfinite(float(got[k, i, 1]))}
            final_bad |= {ranks[k] for k in here if not math.isfinite(float(got[k, i, 2]))}
            row: dict[str, Any] = {
                "module": self.module_names[m] if m < len(self.module_names) else m,
                "shard": pos, "element": e, "seen_by": sorted(seen_at[(m, pos, e)]),
                "sent": {str(r): as_json_number(v) for r, v in zip(ranks, sent)},
                "mean_of_sent": as_json_number(mean),
                "redone_reduce_scatter": {str(ranks[k]): as_json_number(float(got[k, i, 1]))
                                          for k in here}}
            if hsdp:
                row["redone_all_reduce"] = {str(ranks[k]): as_json_number(float(got[k, i, 2]))
                                            for k in here}
            rows.append(row)
        out: dict[str, Any] = {"done": True, "places": rows, "inputs_reproduced": reproduced,
                               "senders_finite_and_sum_finite": sent_ok and sum_ok}
        if not reproduced:
            # the replay did not recompute the original inputs: the redo compares other numbers
            verdict = reduction_verdict(evidence)
            out["why"] = ("the replay did not recompute every rank's original reduce-scatter "
                          "input (largest magnitude differs), so the redo cannot judge; " +
                          verdict.why)
            return out, verdict
        stages: list[tuple[str, list[int]]] = [("reduce-scatter", sorted(rs_bad))]
        if hsdp:
            stages.append(("all-reduce", sorted(final_bad)))
        verdict = reduction_verdict(replace(evidence, sent_finite=sent_ok, sum_finite=sum_ok,
                                            redone=stages))
        out["why"] = verdict.why
        return out, verdict

    def _nonfinite_local(self, walk: Walk, step: int, flagged: list[int], state: StepState,
                         batch: Any, data: Optional[torch.Tensor], scaling: bool) -> None:
        """Replay each flagged owner on another node (lockstep rounds): finite there names it."""
        key = self.reporter.key("nonfinite_local", step)
        evidence: dict[str, Any] = {"flagged_ranks": flagged}
        lockstep = self.lockstep
        offer = lockstep.offer(walk, "confirm_offer", step, batch, data, state)
        if not (lockstep.can_replay and self.confirm and offer.ready):
            if scaling:
                scaler_skip(self.counters, self.reporter, self.scaler, step, flagged,
                            "NaN/Inf in local gradients, with no replay to confirm them")
                return
            if len(flagged) == self.world_size:
                self.reporter.numeric(step, flagged, evidence)
            evidence["why"] = "no replay to confirm (no loss_fn, or a rank gave no batch)"
            self.reporter.alarm(SDCAlarm("nonfinite_local", step, (), (), False, evidence,
                                         candidate_ranks=flagged, key=key))
        plan = lockstep.confirm_plan(flagged)  # with TP partners, under tensor parallel
        received = lockstep.ship(walk, "confirm_ship", plan, offer.data, offer.sizes)
        owners_here = [o for o in sorted(plan) if plan[o] == lockstep.rank]
        rounds = max(Counter(r for r in plan.values() if r is not None).values(), default=0)
        results = torch.full((len(flagged),), -1, dtype=torch.int64)
        for i in range(rounds):
            owner = owners_here[i] if i < len(owners_here) else None
            rec = lockstep.replay(walk, "confirm_replay",
                                  received.get(owner) if owner is not None else offer.batch,
                                  offer.states[owner if owner is not None else lockstep.rank])
            loss = from_bits(int(rec[0, 0]))
            ok = math.isfinite(loss) and lockstep.tap.replay_finite
            if owner is not None and owner in flagged:  # a TP partner is replayed, not judged
                results[flagged.index(owner)] = int(ok)
        got = walk.gather("confirm", results).max(dim=0).values
        confirmed = [o for i, o in enumerate(flagged) if int(got[i]) == 1]
        reproduced = [o for i, o in enumerate(flagged) if int(got[i]) == 0]
        evidence.update(confirmed_by_replay=confirmed, reproduced_ranks=reproduced,
                        confirmers={str(o): plan[o] for o in flagged})
        if confirmed:
            evidence["why"] = "non-finite here, finite when replayed on another node"
            self.reporter.alarm(SDCAlarm("nonfinite_local", step, confirmed,
                                         self.topology.suspect_nodes(confirmed), True, evidence,
                                         candidate_ranks=confirmed, key=key))
        if scaling:
            scaler_skip(self.counters, self.reporter, self.scaler, step, flagged,
                        "the replay on another node is non-finite too: the loss scale")
            return
        evidence["why"] = "the replay on another node is non-finite too: the data or the model"
        self.reporter.numeric(step, reproduced or flagged, evidence)
