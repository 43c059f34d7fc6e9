"""Straggler detector (median/MAD with a persistence window) and the in-job helper over gloo."""

from __future__ import annotations

import json
import math
import multiprocessing as mp
import os
import random
import time
from pathlib import Path

import pytest

from screener.audit.straggler import (DEFAULT_K, DEFAULT_WINDOW, MAD_TO_SIGMA, StragglerDetector,
                                straggler_findings, summarize)
from screener.types import Severity


def noisy_steps(n_steps, n_ranks, seed=0, jitter=0.01, base=1.0):
    rng = random.Random(seed)
    return [[base * (1 + rng.uniform(-jitter, jitter)) for _ in range(n_ranks)]
            for _ in range(n_steps)]


def test_defaults_are_documented_values():
    d = StragglerDetector()
    assert (d.k, d.window, d.min_relative_scale) == (DEFAULT_K, DEFAULT_WINDOW, 0.02)
    assert (DEFAULT_K, DEFAULT_WINDOW, MAD_TO_SIGMA) == (3.0, 5, 1.4826)


def test_rank_throttled_by_20_percent_is_flagged_after_w_steps():
    d = StragglerDetector()
    steps = noisy_steps(30, 8)
    start = 10
    flagged_at = None
    for i, times in enumerate(steps):
        if i >= start:
            times[3] *= 1.2
        r = d.update(times)
        if r.newly_flagged:
            assert flagged_at is None and r.newly_flagged == (3,)
            flagged_at = i
        if i < start + d.window - 1:
            assert r.flagged == (), (i, r.scores)
        else:
            assert r.flagged == (3,)
            s = r.stragglers[0]
            assert s.consecutive == i - start + 1 and 0.15 < s.slowdown < 0.25
            assert s.score > d.k
    assert flagged_at == start + d.window - 1


def test_single_10x_stall_is_not_flagged():
    d = StragglerDetector()
    for i, times in enumerate(noisy_steps(20, 8, seed=1)):
        if i == 7:
            times[5] *= 10  # one rank writes a checkpoint
        if i == 12:
            times = [t * 10 for t in times]  # everyone waits on the same barrier
        r = d.update(times)
        assert r.flagged == () and r.newly_flagged == ()
    assert d.update([1.0] * 8).step == 21


def test_intermittent_slowness_does_not_meet_the_window():
    d = StragglerDetector(window=3)
    for i, times in enumerate(noisy_steps(20, 4, seed=2)):
        if i % 3 != 2:
            times[0] *= 1.5  # two slow steps, then a normal one, repeatedly
        assert d.update(times).flagged == ()


def test_mad_zero_identical_ranks_no_division_and_no_noise_flag():
    d = StragglerDetector(window=2)
    for _ in range(5):
        r = d.update([2.0] * 6)
        assert r.mad == 0 and r.scale == pytest.approx(0.04)
        assert all(s == 0 for s in r.scores) and r.flagged == ()
    # identical others, one rank 3% slower: within the floor (k * 2% of the median), not flagged
    for _ in range(10):
        r = d.update([2.0] * 5 + [2.06])
        assert r.flagged == () and math.isfinite(r.scores[-1])
    # 20% slower with MAD still 0 is flagged after the window
    d.update([2.0] * 5 + [2.4])
    r = d.update([2.0] * 5 + [2.4])
    assert r.flagged == (5,) and r.scores[5] == pytest.approx(0.4 / 0.04)
    # every rank at 0: median 0, scale 0, still no division
    assert StragglerDetector().update([0.0, 0.0, 0.0]).scores == (0.0, 0.0, 0.0)


def test_recovery_resets_the_streak():
    d = StragglerDetector(window=3)
    base = [1.0] * 5
    slow = [1.0] * 4 + [1.5]
    for times in (slow, slow, base, slow, slow):
        assert d.update(times).flagged == ()
    assert d.update(slow).newly_flagged == (4,)
    assert d.update(slow).newly_flagged == () and d.update(slow).flagged == (4,)


def test_two_ranks_cannot_name_a_straggler():
    d = StragglerDetector(window=1)
    for _ in range(5):
        r = d.update([1.0, 3.0])
        assert r.flagged == () and r.scores == (0.0, 0.0)


def test_group_size_change_restarts_streaks():
    d = StragglerDetector(window=2)
    d.update([1.0, 1.0, 1.0, 1.5])
    assert d.update([1.0, 1.0, 1.0, 1.0, 1.5]).flagged == ()  # new group: streak 1, not 2
    assert d.update([1.0, 1.0, 1.0, 1.0, 1.5]).flagged == (4,)


@pytest.mark.parametrize("kw", [dict(k=0), dict(k=float("nan")), dict(window=0),
                                dict(min_relative_scale=0), dict(min_relative_scale=1.5)])
def test_bad_parameters(kw):
    with pytest.raises(ValueError):
        StragglerDetector(**kw)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0])
def test_bad_durations(bad):
    with pytest.raises(ValueError, match="rank 2"):
        StragglerDetector().update([1.0, 1.0, bad])


def test_findings_and_summary():
    d = StragglerDetector(window=1)
    r = d.update([1.0, 1.0, 1.0, 2.0])
    f = straggler_findings(r)
    assert len(f) == 1 and f[0].severity is Severity.WARNING and f[0].code == "straggler"
    assert f[0].evidence["rank"] == 3 and "100% slower" in f[0].message
    assert summarize(r)["flagged"] == [3]


# --- in-job helper over real torch.distributed (gloo) ----------------------------------------

WORLD = 3
NODES = ["node-a", "node-a", "hyperpod-i-0123456789abcdef0"]


def _rank_main(rank, store_path, out):
    os.environ["NODE_NAME"] = NODES[rank]  # what the downward API sets in a pod
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch.distributed as dist

    from screener.audit.straggler import StragglerDetector, StragglerMonitor

    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank,
                            world_size=WORLD)
    try:
        mon = StragglerMonitor(detector=StragglerDetector(window=3), job="llm",
                               alarm_dir=str(Path(store_path).parent / "alarms" / NODES[rank]))
        seen, newly = [], []
        for step in range(6):
            # a one-off 10x stall on rank 0 at step 0; rank 2 is 25% slower from step 1 on
            t = 0.100
            if rank == 0 and step == 0:
                t *= 10
            if rank == 2 and step >= 1:
                t *= 1.25
            found = mon.observe(t)
            seen.append([(s.rank, s.node.node, s.node.instance_id, s.consecutive,
                          round(s.slowdown, 3)) for s in found])
            newly.append(list(mon.last.newly_flagged))
        out.put((rank, seen, newly))
    finally:
        dist.destroy_process_group()


def test_monitor_reports_stragglers_with_their_nodes_over_gloo(tmp_path):
    # fork: the children share the parent's imported torch instead of paying seconds each to
    # import it again (the parent holds no process group and runs single-threaded torch)
    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, str(tmp_path / "store"), out))
             for r in range(WORLD)]
    for p in procs:
        p.start()
    results, newly = {}, {}
    try:
        for _ in range(WORLD):
            rank, seen, new = out.get(timeout=120)
            results[rank], newly[rank] = seen, new
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert all(p.exitcode == 0 for p in procs)
    expected_flag = (2, NODES[2], "i-0123456789abcdef0")
    for rank in range(WORLD):
        seen = results[rank]
        assert seen[0] == seen[1] == seen[2] == []  # the stall ignored; steps 1-2 slow only twice
        for step in (3, 4, 5):
            assert [s[:3] for s in seen[step]] == [expected_flag], (rank, step, seen)
            assert seen[step][0][3] == step and seen[step][0][4] == pytest.approx(0.25)
        assert newly[rank] == [[], [], [], [2], [], []]  # raised once, when the window fills
    assert results[0] == results[1] == results[2]  # every rank reaches the same verdict
    # One alarm, written by the slow rank into its own node's folder, and none for the others.
    files = sorted((tmp_path / "alarms").glob("*/*.json"))
    assert [f.parent.name for f in files] == [NODES[2]]
    alarm = json.loads(files[0].read_text())
    assert alarm["check"] == "straggler" and alarm["settled"] is False and alarm["step"] == 4
    assert alarm["evidence"]["slowdown"] == pytest.approx(0.25) and alarm["evidence"]["window"] == 3

    # The DaemonSet on that node takes it in: suspect, the figures as evidence, a screen due.
    from fakes.daemon import DaemonRig, ScriptedRunner, outcome
    from screener.types import NodeState, Outcome

    from fakes.clock import FakeClock

    # the daemon's clock where the job's was: an alarm from past the node's clock plus its skew
    # allowance is refused (alarmfile.MAX_CLOCK_SKEW_S)
    rig = DaemonRig(tmp_path / "daemon", ScriptedRunner(outcome(Outcome.PASS), outcome(Outcome.PASS)),
                    node=NODES[2], alarm_dir=str(files[0].parent), idle_window_s=0.0,
                    clock=FakeClock(time.time()))
    try:
        rig.nvml.gpus[0].utilization = (90, 50)  # the job is still running: no screen yet
        first = rig.tick()
        assert first.state == NodeState.SUSPECT and first.screen is None
        t = rig.store.history(NODES[2])[-1]
        assert t.code == "Straggler" and t.evidence["straggler"]["slowdown"] == pytest.approx(0.25)
        assert first.screen_due == "the node is suspect: confirming screen"
    finally:
        rig.close()
