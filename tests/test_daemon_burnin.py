"""The full burn-in sequence: real known-answer burn-in on the CPU (a tiny GEMM job with a golden
recorded here), the real HBM and probe stages, the cross-check against other nodes' annotations on
the Kubernetes API test server, and the lifecycle move at the end."""

from __future__ import annotations

import json

import pytest

from fakes.fake_nvml import FakeNvml, h100
from fakes.kubeapi import KubeAPI
from screener.agent.burnin.full import BurninPlan, BurninRequirement, run_burnin, run_full_burnin
from screener.agent.screening.window import ScreenOptions, ScreenProcessRunner
from screener.health.sources.hbm import stuck_bit
from screener.health.probes import run_probes
from screener.known_answer.verdict.crosscheck import platform_digests
from screener.known_answer.engine.screen import DeviceFault, record_goldens
from screener.known_answer.engine.workloads import select_jobs
from screener.settings.health import ProbeConfig
from screener.stores.kube import KubeStore
from screener.stores.local import LocalStore
from screener.types import ANNOTATION_DIGESTS, ExitCode, NodeState, Outcome, Verdict
from fakes.daemon import DaemonRig, ScriptedRunner, as_full_burnin, outcome

JOB = """name = "tiny-gemm"
version = 1
kind = "gemm"
quick = true
[params]
dtype = "float32"
seed = 3
chain = 3
[cpu]
shapes = [[48, 64], [33, 40]]
"""

PLAN = BurninPlan(hbm_max_bytes=2 << 20)
# CPU tests use seconds, not the default hour.
SECONDS = BurninRequirement(min_seconds=0.0)


@pytest.fixture(scope="module")
def kat_env(tmp_path_factory):
    root = tmp_path_factory.mktemp("kat")
    jobs = root / "jobs"
    jobs.mkdir()
    (jobs / "tiny-gemm.toml").write_text(JOB)
    golden = root / "golden"
    specs = select_jobs(["tiny-gemm"], jobs_dir=jobs)
    rec = record_goldens(specs, ["cpu"], out_dir=str(golden), repeat=2)
    assert rec.exit_code == ExitCode.PASS and rec.written

    def kat(faults=None):
        return lambda: run_burnin(["cpu"], specs, iterations=2, golden_dir=str(golden),
                                  jobs_dir=str(jobs), faults=faults)

    clean = kat()()
    assert clean.screen.outcome == Outcome.PASS
    kat.dirs = (str(jobs), str(golden))  # type: ignore[attr-defined]
    return kat, clean


def probe_fn(tmp_path):
    cfg = ProbeConfig(kmsg_path=None, disk_paths=(str(tmp_path),), min_free_disk_fraction=0.0,
                      min_free_memory_fraction=0.0)
    nvml = FakeNvml([h100(0)])
    return lambda previous: run_probes(cfg, nvml=nvml, previous=previous)


@pytest.mark.slow
def test_a_clean_node_ends_healthy(kat_env, tmp_path):
    _, clean = kat_env
    store = LocalStore(tmp_path / "s.db")
    try:
        rep = run_full_burnin("new-1", ["cpu"], lambda: clean, plan=PLAN, store=store,
                              probe=probe_fn(tmp_path), requirement=SECONDS)
        assert [s.name for s in rep.stages] == ["probes-before", "known-answer", "hbm",
                                                "probes-after"]
        assert rep.kind == "full" and rep.missing == []
        assert rep.outcome == Outcome.PASS and rep.exit_code == ExitCode.PASS
        assert rep.state_before is None and rep.state_after == NodeState.HEALTHY
        assert [t["to"] for t in rep.transitions] == ["burnin", "healthy"]
        assert store.get_verdict("new-1")["kind"] == "full"
        assert store.get_verdict("new-1")["screen"] == "burnin"
        assert "new-1: (new) -> healthy" in rep.table()
        json.dumps(rep.to_dict())
    finally:
        store.close()


@pytest.mark.slow
def test_a_partial_burnin_never_makes_the_node_healthy(kat_env, tmp_path):
    """The same clean run, but short of the configured duration, or without the HBM test, or
    with a single round: recorded as partial, and the node stays in burnin."""
    _, clean = kat_env
    store = LocalStore(tmp_path / "s.db")
    try:
        short = run_full_burnin("new-2", ["cpu"], lambda: clean, plan=PLAN, store=store,
                                probe=probe_fn(tmp_path),
                                requirement=BurninRequirement(min_seconds=3600.0))
        assert short.outcome == Outcome.PASS and short.kind == "partial"
        assert any("of the required 3600 s" in m for m in short.missing)
        assert short.state_after == NodeState.BURNIN
        # What it prints says what happened to the node, and its exit code is not a pass's
        # (issue 25.4): no line reads "pass" as a result, the time is the whole run's.
        assert short.exit_code == ExitCode.PARTIAL and short.to_dict()["exit_code"] == 4
        last = short.table().splitlines()[-1]
        assert last.startswith("overall: partial: node stays in burnin (missing: the known-answer"
                               " jobs ran ") and "(exit 4) in " in last, last
        assert not [ln for ln in short.table().splitlines()
                    if ln.startswith(("burn-in pass", "overall: pass"))]
        assert short.to_dict()["summary"] == last.split("overall: ", 1)[1].split(" (exit")[0]
        nowhere = run_full_burnin("new-3", ["cpu"], lambda: clean, plan=PLAN, store=None,
                                  probe=probe_fn(tmp_path),
                                  requirement=BurninRequirement(min_seconds=3600.0))
        assert nowhere.exit_code == ExitCode.PASS  # --store none: no node is kept in burnin
        assert nowhere.summary().startswith("partial: the stages that ran passed, no node state")
        assert store.get_verdict("new-2")["kind"] == "partial"
        no_hbm = run_full_burnin("new-2", ["cpu"], lambda: clean,
                                 plan=BurninPlan(hbm=False), store=store,
                                 probe=probe_fn(tmp_path), requirement=SECONDS)
        assert no_hbm.missing == ["the HBM pattern test did not run"]
        once = run_full_burnin("new-2", ["cpu"], lambda: clean, plan=PLAN, store=store,
                               probe=None, requirement=BurninRequirement(min_seconds=0.0,
                                                                         min_iterations=3))
        assert "probes-before did not run" in once.missing
        assert any("at least 3 times" in m for m in once.missing)
        assert store.get_state("new-2") == NodeState.BURNIN
        assert "burn-in: partial" in once.table()
    finally:
        store.close()


@pytest.mark.slow
def test_a_reproduced_known_answer_mismatch_quarantines(kat_env, tmp_path):
    kat, _ = kat_env
    fault = {"cpu": [DeviceFault(op="mm", call=1, element=5, bit=0)]}  # every iteration
    store = LocalStore(tmp_path / "s.db")
    try:
        rep = run_full_burnin("bad-1", ["cpu"], kat(fault), plan=PLAN, store=store)
        known_answer_stage = rep.stages[0]
        assert known_answer_stage.outcome == Outcome.SUSPECT
        assert known_answer_stage.verdicts[0].reason == "golden_mismatch"
        assert known_answer_stage.verdicts[0].evidence["confirmed"] is True  # both rounds mismatched
        assert rep.state_after == NodeState.QUARANTINED
        assert rep.exit_code == ExitCode.HARDWARE_SUSPECT
    finally:
        store.close()


@pytest.mark.slow
def test_a_stuck_hbm_bit_quarantines_even_when_the_known_answers_pass(kat_env, tmp_path):
    _, clean = kat_env
    store = LocalStore(tmp_path / "s.db")
    try:
        rep = run_full_burnin("bad-2", ["cpu"], lambda: clean, plan=PLAN, store=store,
                              hbm_inject=stuck_bit(0, 123, 30, value=0))
        hbm = next(s for s in rep.stages if s.name == "hbm")
        assert hbm.outcome == Outcome.SUSPECT and hbm.verdicts[0].evidence["confirmed"]
        assert rep.state_after == NodeState.QUARANTINED
    finally:
        store.close()


@pytest.mark.slow
def test_digests_that_disagree_with_the_fleet_make_the_node_suspect(kat_env, tmp_path):
    _, clean = kat_env
    v = clean.screen.verdicts[0]
    mine = clean.screen.digests["cpu"]["tiny-gemm"]
    fleet = json.dumps({v.platform_hash: {"tiny-gemm": "0" * len(mine)}})
    with KubeAPI() as api:
        api.add_node("new-3")
        for n in ("old-1", "old-2", "old-3"):
            api.add_node(n, annotations={ANNOTATION_DIGESTS: fleet})
        api.add_node("other-platform", annotations={ANNOTATION_DIGESTS: json.dumps({"p9": {"tiny-gemm": mine}})})
        store = KubeStore(api.api_client(), sleep=lambda s: None, instance="t")
        try:
            rep = run_full_burnin("new-3", ["cpu"], lambda: clean, plan=PLAN, store=store,
                                  requirement=SECONDS)
        finally:
            store.close()
        cc = next(s for s in rep.stages if s.name == "crosscheck")
        assert cc.outcome == Outcome.SUSPECT and cc.data["nodes_compared"] == 3
        assert cc.verdicts[0].reason == "fleet_digest_mismatch"
        assert rep.state_after == NodeState.SUSPECT  # not confirmed: the daemon screens again
        assert api.node("new-3")["metadata"]["labels"]["screener.io/state"] == "suspect"


def test_only_passing_devices_publish_digests_by_platform():
    verdicts = [Verdict("cuda:0", Outcome.PASS, platform_hash="p1"),
                Verdict("cuda:1", Outcome.SUSPECT, reason="peer_mismatch", platform_hash="p1"),
                Verdict("cuda:2", Outcome.PASS, platform_hash="p2"),
                Verdict("cuda:3", Outcome.PASS)]  # no platform: nothing to key it by
    digests = {"cuda:0": {"j": "aa"}, "cuda:1": {"j": "bb", "k": "cc"}, "cuda:2": {"j": "dd"},
               "cuda:3": {"j": "ee"}}
    assert platform_digests(verdicts, digests) == {"p1": {"j": "aa"}, "p2": {"j": "dd"}}


@pytest.mark.slow
def test_the_daemon_runs_the_full_burnin_itself_in_its_worker(kat_env, tmp_path):
    """A new node, idle: the daemon's real worker process runs the burn-in's device stages (the
    known-answer jobs for the configured seconds, at least twice, and the HBM test), the daemon
    adds the probes before and after, and the node becomes healthy with a verdict saying so."""
    kat, _ = kat_env
    jobs, golden = kat.dirs
    options = ScreenOptions(jobs=("tiny-gemm",), devices=("cpu",), golden_dir=golden, jobs_dir=jobs,
                            burnin_seconds=1.0, hbm_max_bytes=1 << 20)
    runner = ScreenProcessRunner(options, work_dir=str(tmp_path / "screens"))
    # A CPU node: NVML reports no GPU, so the node has one device (the CPU).
    rig = DaemonRig(tmp_path, runner, nvml=FakeNvml([]), idle_window_s=0.0, burnin_duration_s=1.0,
                    jobs=["tiny-gemm"], job_poll_s=0.2)
    try:
        report = rig.tick()
        assert report.screen is not None and report.screen.kind == "full", report.errors
        names = [st["name"] for st in report.screen.stages]
        assert names == ["known-answer", "hbm"]
        kat_data = report.screen.stages[0]["data"]
        assert kat_data["seconds"] >= 1.0 and kat_data["iterations"]["cpu"] >= 2
        assert report.state == NodeState.HEALTHY
        verdict = rig.store.get_verdict(rig.config.node)
        assert verdict["kind"] == "full" and verdict["missing"] == []
        assert [st["name"] for st in verdict["stages"]] == ["probes-before", "known-answer", "hbm",
                                                            "probes-after"]
        # the worker's folder is gone; what its passing screen produced is kept for the next one
        assert [p.name for p in (tmp_path / "screens").iterdir()] == ["known-digests.json"]
    finally:
        rig.close()


@pytest.mark.slow
def test_a_burnin_shorter_than_configured_is_partial_and_keeps_the_node_in_burnin(kat_env, tmp_path):
    # The worker reports 5 s of known-answer rounds; the node requires an hour.
    runner = ScriptedRunner(as_full_burnin(outcome(Outcome.PASS)))
    rig = DaemonRig(tmp_path, runner, idle_window_s=0.0, burnin_duration_s=3600.0)
    try:
        report = rig.tick()
        assert report.state == NodeState.BURNIN and report.screen.outcome == Outcome.PASS
        verdict = rig.store.get_verdict(rig.config.node)
        assert verdict["kind"] == "partial"
        assert verdict["missing"] == ["the known-answer jobs ran 5 s of the required 3600 s"]
    finally:
        rig.close()


@pytest.mark.slow
def test_a_mismatch_in_the_timed_rounds_stands_even_when_too_few_repeats_ran(kat_env):
    """The daemon's worker runs the burn-in's rounds for the configured seconds and, when that was
    too short for the required repeats, runs them again by count. A mismatch in the timed rounds is
    evidence and must stand: a second run that passes (an intermittent fault) never replaces it."""
    from screener.agent.screening.worker import first_is_final

    kat, _ = kat_env
    jobs, golden = kat.dirs
    specs = select_jobs(["tiny-gemm"], jobs_dir=jobs)
    fault = {"cpu": [DeviceFault(op="mm", call=1, element=5, bit=0, iteration=0)]}
    timed = run_burnin(["cpu"], specs, duration=1e-3, golden_dir=str(golden), jobs_dir=str(jobs),
                       faults=fault)
    assert timed.screen.iterations["cpu"] < 2 and timed.outcome == Outcome.SUSPECT
    assert first_is_final(timed, 2)
    clean = run_burnin(["cpu"], specs, duration=1e-3, golden_dir=str(golden), jobs_dir=str(jobs))
    assert clean.screen.iterations["cpu"] < 2 and clean.outcome == Outcome.PASS
    assert not first_is_final(clean, 2)  # too few repeats: the run by count follows
    assert first_is_final(clean, clean.screen.iterations["cpu"])
