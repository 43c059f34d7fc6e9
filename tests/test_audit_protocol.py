"""The round protocol (screener.audit.protocol): every collective of a check names its round, the
rounds keep the schedule's order, and ranks in different rounds fail alike instead of hanging or
reading each other's data."""

from __future__ import annotations

import ast
import os
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from screener.audit.alarms import AuditError, AuditUsageError
from screener.audit.auditor import DDP_STEP, DDP_WEIGHTS
from screener.audit.protocol import FAILED, OK, USAGE, Schedule, error_flag, raise_if_failed
from screener.audit.sharded import FSDP_STEP, FSDP_WEIGHTS

AUDIT = Path(__file__).resolve().parents[1] / "screener" / "audit"
CPU = torch.device("cpu")


def test_rounds_may_be_skipped_but_never_reordered_or_repeated_unless_repeatable():
    s = Schedule("s", ("a", "b", "c"), repeatable=("b",))
    w = s.walk(None, CPU)
    assert w.enter("a") == 1 and w.enter("b") == 2 and w.enter("b") == 2 and w.enter("c") == 3
    assert w.taken == ["a", "b", "b", "c"]
    w = s.walk(None, CPU)
    w.enter("c")  # a and b skipped
    with pytest.raises(AuditError, match="breaks the order"):
        w.enter("a")
    w = s.walk(None, CPU)
    w.enter("a")
    with pytest.raises(AuditError, match="breaks the order"):
        w.enter("a")
    with pytest.raises(AuditError, match="no round"):
        w.enter("z")
    with pytest.raises(ValueError):
        Schedule("bad", ("a", "a"))


def _round_names(path: Path) -> set[str]:
    """The round names a module passes to a walk: the first string argument of gather/enter, or
    the string after the walk in offer/ship/replay calls."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        args = node.args
        strings = [a.value for a in args[:2] if isinstance(a, ast.Constant)
                   and isinstance(a.value, str)]
        walked = args and isinstance(args[0], ast.Name) and args[0].id == "walk"
        if node.func.attr in ("gather", "enter") and strings and not walked:
            names.add(strings[0])
        if node.func.attr in ("offer", "ship", "replay") and walked and strings:
            names.add(strings[0])
    return names


def test_every_round_the_checks_run_is_in_their_schedule():
    ddp = {"auditor.py", "nonfinite.py", "ring_audit.py", "attribution.py", "weight_check.py"}
    used = set().union(*(_round_names(AUDIT / f) for f in ddp | {"sharded.py"}))
    declared = set(DDP_STEP.rounds + DDP_WEIGHTS.rounds + FSDP_STEP.rounds + FSDP_WEIGHTS.rounds)
    assert used and used <= declared, used - declared
    # and every declared round is run somewhere: a schedule lists no round that does not exist
    assert declared <= used, declared - used


def test_errors_are_agreed_usage_errors_only_when_every_failure_is_one():
    assert [error_flag(None), error_flag(RuntimeError()), error_flag(AuditUsageError())] == \
        [OK, FAILED, USAGE]
    raise_if_failed(torch.tensor([OK, OK]), [0, 1], None, 3, "x")
    with pytest.raises(AuditUsageError, match="rank\\(s\\) 1"):
        raise_if_failed(torch.tensor([OK, USAGE]), [0, 1], None, 3, "x")
    with pytest.raises(AuditError, match="not the hardware") as e:
        raise_if_failed(torch.tensor([USAGE, FAILED]), [0, 1], None, 3, "x")
    assert not isinstance(e.value, AuditUsageError)


def _diverge(rank: int, world: int, init: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        s = Schedule("t", ("head", "states", "digests"))
        w = s.walk(None, CPU)
        got = w.gather("head", torch.tensor([float(rank), 2.0], dtype=torch.float64))
        assert got.tolist() == [[0.0, 2.0], [1.0, 2.0]]  # the tag is not in the result
        try:  # same shape, different rounds: without the tag each would read the other's row
            w.gather("states" if rank == 0 else "digests", torch.tensor([rank], dtype=torch.int64))
            result = "no error"
        except AuditError as e:
            result = str(e)
        Path(out, str(rank)).write_text(result)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_ranks_in_different_rounds_raise_alike():
    with tempfile.TemporaryDirectory() as d:
        init = f"file://{os.path.join(d, 'store')}"
        mp.start_processes(_diverge, args=(2, init, d), nprocs=2, start_method="spawn")
        results = [Path(d, str(r)).read_text() for r in range(2)]
    assert all("left the round protocol" in r for r in results), results
    assert "here 'states'" in results[0] and "here 'digests'" in results[1]
