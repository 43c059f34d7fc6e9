"""The round protocol: every rank runs the same collectives in the same order, written down as code.

A check is collective: each of its rounds (one all_gather, one point-to-point exchange of batches,
one lockstep replay that runs the model's own collectives) needs every rank of the group, at the
same moment, with the same payload shape. A rank that skips a round, runs one twice, or takes
another branch than its peers leaves them waiting in a collective it never enters (a hang until
the process group's timeout), or worse, pairs its payload with theirs in a different round.

So the rounds each entry point may run are listed once, in order, as a `Schedule` (the auditors
declare theirs next to their entry points), and every collective goes through a `Walk`, one per
call of an entry point, that keeps to it:

- a round may only come after the rounds already run (rounds may be skipped, never reordered);
  only rounds the schedule marks repeatable run more than once (one lockstep replay per owner);
- every gather carries the round's number, and the gathered numbers must agree: ranks that
  diverged raise AuditError on every rank alike instead of misreading each other's data;
- a gather's payload size must agree too, or a backend aborts the process (gloo's SIGABRT) or
  hangs (NCCL): a round whose payload shape every rank derives from what it agreed at
  construction (the parameters and the step state's width, layout.py) and from nothing
  rank-local (the step's head: the same width on every step, audit step or not) is one gather,
  the round's number and the step riding along (ranks at different steps raise alike); every
  other round first gathers its number, size and dtype, and a mismatch is an AuditError on every
  rank alike;
- a round is run or skipped on gathered data only (the same on every rank), never on a rank-local
  value: the one rule a schedule cannot check, which is why every decision below reads `got`.

Errors are agreed the same way: a replay that fails on one rank is reported in the next gather as
an error flag, and every rank raises alike (`raise_if_failed`).
"""

from __future__ import annotations

from typing import Collection, Optional, Sequence

import torch
import torch.distributed as dist

from screener.audit.alarms import AuditError, AuditUsageError
from screener.audit.collective import gather

__all__ = ["Schedule", "Walk", "OK", "FAILED", "USAGE", "error_flag", "raise_if_failed"]

OK, FAILED, USAGE = 0, 1, 2  # what a rank tells the others about its replays


class Schedule:
    """The rounds one entry point may run, in the one order every rank runs them."""

    def __init__(self, name: str, rounds: Sequence[str], repeatable: Collection[str] = (),
                 fixed: Collection[str] = ()) -> None:
        if len(set(rounds)) != len(rounds) or not set(repeatable) <= set(rounds) \
                or not set(fixed) <= set(rounds):
            raise ValueError(f"schedule {name}: rounds must be distinct, repeatable and fixed "
                             f"among them")
        self.name = name
        self.rounds = tuple(rounds)
        self.repeatable = frozenset(repeatable)
        # rounds whose payload shape every rank derives from what it agreed at construction
        # (layout.py: the parameters and the step state's width), e.g. the step's head: one
        # gather, the round's number riding along; every other round checks sizes first
        self.fixed = frozenset(fixed)
        self._number = {r: k + 1 for k, r in enumerate(self.rounds)}

    def number(self, round_: str) -> int:
        """The round's place in the schedule (1-based: 0 is no round)."""
        try:
            return self._number[round_]
        except KeyError:
            raise AuditError(f"screener.audit: {round_!r} is no round of {self.name}") from None

    def walk(self, group: Optional[dist.ProcessGroup], comm: torch.device,
             step: Optional[int] = None) -> "Walk":
        """A fresh way through the schedule, for one call of its entry point (at `step`, which
        the fixed rounds' tags carry: ranks at different steps raise alike)."""
        return Walk(self, group, comm, step)

    def __repr__(self) -> str:
        return f"Schedule({self.name}: {' -> '.join(self.rounds)})"


class Walk:
    """One call's way through a Schedule: each collective names its round, in order."""

    def __init__(self, schedule: Schedule, group: Optional[dist.ProcessGroup],
                 comm: torch.device, step: Optional[int] = None) -> None:
        self.schedule = schedule
        self.group = group
        self.comm = comm
        self.step = -1 if step is None else int(step)
        self.at = 0  # the number of the last round entered
        self.taken: list[str] = []

    def enter(self, round_: str) -> int:
        """Enter a round (before its collective runs); returns its number. Raises AuditError for
        a round out of order: a bug of ours that would leave the ranks in different collectives."""
        n = self.schedule.number(round_)
        if n < self.at or (n == self.at and round_ not in self.schedule.repeatable):
            raise AuditError(f"screener.audit: round {round_!r} after {self.taken[-1]!r} breaks "
                             f"the order of {self.schedule!r}")
        self.at = n
        self.taken.append(round_)
        return n

    def gather(self, round_: str, t: torch.Tensor) -> torch.Tensor:
        """all_gather of one same-shaped tensor per rank in this round: (world, *t.shape) on the
        CPU. Raises AuditError on every rank alike when the ranks are not all in this round, or
        bring payloads of different sizes or dtypes (a backend would abort the process or hang)."""
        n = self.enter(round_)
        if round_ in self.schedule.fixed and t.dtype in (torch.int64, torch.float64):
            flat = t.detach().to(self.comm).reshape(-1)
            tag = torch.tensor([n, self.step], dtype=t.dtype, device=flat.device)
            got = gather(torch.cat([flat, tag]), self.group, self.comm)  # (world, numel + 2)
            self._check_rounds(round_, n, [int(x) for x in got[:, -2].tolist()])
            steps = [int(x) for x in got[:, -1].tolist()]
            if len(set(steps)) > 1:
                raise AuditError(f"screener.audit: the ranks called {self.schedule.name} at "
                                 f"different steps ({sorted(set(steps))}); every rank must pass "
                                 f"the same step number; the audit's own failure, not the "
                                 f"hardware")
            return got[:, :-2].reshape(got.shape[0], *t.shape)
        if round_ in self.schedule.fixed:
            raise AuditError(f"screener.audit: fixed round {round_!r} gathers {t.dtype}; a "
                             f"fixed round's payload is int64 or float64")
        code = _DTYPES.index(t.dtype) if t.dtype in _DTYPES else len(_DTYPES)
        header = torch.tensor([n, t.numel(), code], dtype=torch.int64)
        heads = gather(header, self.group, self.comm)  # (world, 3): small, before the payload
        self._check_rounds(round_, n, [int(x) for x in heads[:, 0].tolist()])
        if bool((heads[:, 1:] != header[1:]).any()):
            sizes = {k: (int(heads[k, 1]), _dtype_name(int(heads[k, 2])))
                     for k in range(heads.shape[0])}
            raise AuditError(f"screener.audit: round {round_!r} of {self.schedule.name} got "
                             f"payloads of different sizes (group index: elements, dtype: "
                             f"{sizes}): the ranks do not hold the same model or took "
                             f"different paths; the audit's own failure, not the hardware")
        got = gather(t.detach(), self.group, self.comm)
        return got.reshape(got.shape[0], *t.shape)

    def _check_rounds(self, round_: str, n: int, tags: list[int]) -> None:
        if any(x != n for x in tags):
            rounds = {k: (self.schedule.rounds[x - 1] if 0 < x <= len(self.schedule.rounds)
                          else f"#{x}") for k, x in enumerate(tags) if x != n}
            raise AuditError(f"screener.audit: the ranks left the round protocol of "
                             f"{self.schedule.name}: here {round_!r}, at group index(es) "
                             f"{rounds}; the audit's own failure, not the hardware")


_DTYPES = (torch.int64, torch.float64, torch.float32, torch.bfloat16, torch.float16,
           torch.int32, torch.uint8, torch.bool)


def _dtype_name(code: int) -> str:
    return str(_DTYPES[code]).replace("torch.", "") if 0 <= code < len(_DTYPES) else "other"


def error_flag(error: Optional[BaseException]) -> int:
    """What a rank tells the others about its replays: OK, USAGE or FAILED."""
    if error is None:
        return OK
    return USAGE if isinstance(error, AuditUsageError) else FAILED


def raise_if_failed(flags: torch.Tensor, ranks: Sequence[int], local: Optional[BaseException],
                    step: int, what: str) -> None:
    """Raise on every rank alike when a replay failed on any (flags: each rank's error_flag, in
    the order of `ranks`): AuditUsageError when every failure was one, else AuditError."""
    codes = [int(flags[k]) for k in range(flags.numel())]
    failed = [ranks[k] for k, c in enumerate(codes) if c != OK]
    if not failed:
        return
    msg = (f"screener.audit: {what} at step {step} failed on rank(s) "
           f"{', '.join(map(str, failed))}")
    here = "" if local is None else \
        f" (here: {type(local).__name__}: {' '.join(str(local).split())})"
    if all(c == USAGE for c in codes if c != OK):
        raise AuditUsageError(msg + here) from local
    raise AuditError(msg + ": the auditor failed, not the hardware (a replay runs "
                     "loss_fn(ddp_model.module, batch_fn(rank, step)) outside the training "
                     "loop)" + here) from local
