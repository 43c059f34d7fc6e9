"""A rolling upgrade, simulated (issue 33.5): nodes move one by one to a platform with no golden.

Every node is a real Daemon (fake clock, real lifecycle) on a real store shared by the fleet: one
SQLite file (nodes sharing one database), or a KubeStore per node talking HTTP to the Kubernetes
API test server. What stands in for the screen worker is the device boundary only: each node's
two GPUs give the results of the real job run in process (a planted bad node gives the results of
a persistently faulty unit), judged by the product's own judge_runs with the fleet view the
daemon handed over, exactly as the worker process does. The 20-node run (and its figures) is
benchmarks/bench_rolling_upgrade.py; here 6 nodes, one of them bad.

What must hold: every healthy node ends healthy without a person, the bad one ends suspect (and
its confirming screen quarantines it),
nothing waits forever (the waiting platform is visible in the verdict and the metric), and the
first quorum's answer is promoted once to the platform's golden, with its provenance.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import kubernetes.client
import pytest

from fakes.daemon import DaemonRig, as_full_burnin
from fakes.kubeapi import KubeAPI
from screener.agent.screening.window import ScreenOutcome, ScreenRequest
from screener.determinism import preserved
from screener.known_answer.engine import golden as golden_mod
from screener.known_answer.engine.screen import judge_runs
from screener.known_answer.engine import workloads as w
from screener.known_answer.engine.faults import FaultSpec, inject
from screener.known_answer.verdict.quorum import FleetView
from screener.known_answer.verdict.results import JobResult
from screener.known_answer.verdict.runs import DeviceRun
from screener.stores.kube import KubeStore
from screener.stores.local import LocalStore
from screener.types import CONDITION_TYPE, KnownAnswerReason, NodeState

ROOT = Path(__file__).resolve().parents[1]
JOB = "gemm-fp32"
NEW = "00000000000000cd"  # the platform every node moves to: no golden anywhere
NS = "screener-system"


@pytest.fixture(autouse=True)
def _restore_process_settings():
    with preserved():
        yield


@pytest.fixture(scope="module")
def spec() -> w.JobSpec:
    return next(s for s in w.load_jobs(ROOT / "jobs") if s.name == JOB)


@pytest.fixture(scope="module")
def answers(spec) -> dict[str, JobResult]:
    with preserved():
        clean = w.run_job(spec, "cpu")
        inj = inject(FaultSpec("mm", call=0, element=11, bit=2, persistent=True))
        bad = w.run_job(spec, "cpu", injector=inj)
    assert inj.fired and bad.digest != clean.digest
    return {"clean": clean, "bad": bad}


class DeviceBoundary:
    """The screen runner of one node: its GPUs' results, judged as the worker judges them."""

    def __init__(self, spec: w.JobSpec, result: JobResult, golden_dir: Path,
                 phash: str = NEW) -> None:
        self.spec, self.result, self.golden_dir, self.phash = spec, result, golden_dir, phash
        self.requests: list[ScreenRequest] = []

    def __call__(self, request: ScreenRequest) -> ScreenOutcome:
        self.requests.append(request)
        runs_per_job = 2 if request.kind == "full" else max(1, request.repeat or 1)
        runs = {}
        for dev in ("cuda:0", "cuda:1"):
            run = DeviceRun(dev, platform={"name": "upgraded"}, platform_hash=self.phash)
            for i in range(runs_per_job):
                run.add(i, self.result)
            run.iterations = runs_per_job
            runs[dev] = run
        fleet = FleetView.from_dict(request.fleet) if request.fleet is not None else None
        res = judge_runs(runs, [self.spec], str(self.golden_dir), seconds=5.0, fleet=fleet)
        out = ScreenOutcome.from_screen_dict(json.loads(json.dumps(res.to_dict(), default=str)))
        return as_full_burnin(out) if request.kind == "full" else out


def _fleet(tmp_path: Path, spec: w.JobSpec, answers: dict[str, JobResult], n: int, bad: int,
           store_for: Callable[[str, Path], Any], *, phash: str = NEW,
           **config: Any) -> list[tuple[str, DaemonRig, DeviceBoundary]]:
    goldens = tmp_path / "golden"
    goldens.mkdir(exist_ok=True)
    nodes = []
    for k in range(n):
        name = f"gpu-{k:02d}"
        folder = tmp_path / name
        folder.mkdir()
        runner = DeviceBoundary(spec, answers["bad" if k == bad else "clean"], goldens, phash)
        store = store_for(name, folder)
        rig = DaemonRig(folder, runner, store=store,
                        taint=store if isinstance(store, KubeStore) else None, node=name,
                        idle_window_s=0.0, golden_dir=str(goldens), jobs=[JOB],
                        quorum_nodes=3, **config)
        nodes.append((name, rig, runner))
    return nodes


def _roll(nodes: list[tuple[str, DaemonRig, DeviceBoundary]], bad: int,
          after_first: Callable[[], None] = lambda: None) -> dict[str, Any]:
    """Nodes come up on the new platform one by one, then the waiting ones retry."""
    for name, rig, _ in nodes:
        rig.tick()
    after_first()
    first = {name: rig.store.get_state(name) for name, rig, _ in nodes}
    waiting_seen = [name for name, rig, _ in nodes
                    if rig.metrics.awaiting_quorum.labels(rig.metrics.node, NEW)._value.get() > 0]
    for _ in range(3):  # retry_inconclusive_s is 600 s
        for name, rig, _ in nodes:
            rig.tick(advance=601.0)
    return {"first": first, "waiting_seen": waiting_seen}


def _check(nodes: list[tuple[str, DaemonRig, DeviceBoundary]], bad: int, seen: dict[str, Any],
           promoted: dict[str, dict[str, str]]) -> None:
    states = {name: rig.store.get_state(name) for name, rig, _ in nodes}
    bad_name = nodes[bad][0]
    # suspect, then quarantined by its confirming screen: out of service either way
    assert states[bad_name] in (NodeState.SUSPECT, NodeState.QUARANTINED), states
    assert NodeState.SUSPECT in [t.to_state for t in nodes[bad][1].store.history(bad_name)]
    assert all(s == NodeState.HEALTHY for n, s in states.items() if n != bad_name), states
    # the first nodes waited, visibly, instead of passing on their own or sitting silently
    assert seen["first"]["gpu-00"] == NodeState.BURNIN
    assert "gpu-00" in seen["waiting_seen"]
    verdict = nodes[0][1].store.get_verdict("gpu-00")
    assert verdict["outcome"] == "pass"
    # the quorum's answer was promoted once, with where it came from
    assert list(promoted) == [NEW] and list(promoted[NEW]) == [JOB]
    rec = golden_mod.parse(f"x/{JOB}.{NEW}.json", promoted[NEW][JOB])
    assert rec.recorded["source"] == "quorum" and rec.recorded["quorum"]["agreeing"] >= 3
    assert bad_name not in rec.recorded["quorum"]["nodes"]
    # the bad node's last verdict names what it differs from
    bad_rig = nodes[bad][1]
    reasons = {v["reason"] for v in bad_rig.store.get_verdict(bad_name)["verdicts"]}
    assert reasons & {KnownAnswerReason.GOLDEN_MISMATCH.value,
                      KnownAnswerReason.QUORUM_MISMATCH.value}, reasons
    # a screen after a waiting one repeats its jobs, so its results can count
    assert any(r.repeat == 2 for r in nodes[0][2].requests if r.kind != "full") or \
        all(r.kind == "full" for r in nodes[0][2].requests)


def test_a_rolling_upgrade_on_one_shared_sqlite_store_settles_without_a_person(tmp_path, spec,
                                                                               answers):
    shared = tmp_path / "fleet.db"
    nodes = _fleet(tmp_path, spec, answers, 6, 1, lambda name, folder: LocalStore(shared))
    try:
        seen = _roll(nodes, 1)
        _check(nodes, 1, seen, nodes[0][1].store.promoted_goldens())
    finally:
        for _, rig, _ in nodes:
            rig.close()


def test_a_rolling_upgrade_on_the_kubernetes_store_settles_without_a_person(tmp_path, spec,
                                                                            answers):
    with KubeAPI() as api:
        def store_for(name: str, folder: Path) -> KubeStore:
            api.add_node(name)
            cfg = kubernetes.client.Configuration()
            cfg.host, cfg.retries = api.url, False
            return KubeStore(kubernetes.client.ApiClient(cfg), namespace=NS, instance=name)

        def reason(name: str) -> str:
            conds = api.node(name).get("status", {}).get("conditions") or []
            return next((c["reason"] for c in conds if c["type"] == CONDITION_TYPE), "")

        waited: dict[str, str] = {}
        nodes = _fleet(tmp_path, spec, answers, 6, 1, store_for)
        try:
            seen = _roll(nodes, 1, lambda: waited.update({n: reason(n) for n, _, _ in nodes}))
            # what `kubectl describe node` showed while the platform waited, and after
            assert waited["gpu-00"] == "AwaitingQuorum" and waited["gpu-05"] != "AwaitingQuorum"
            assert "AwaitingQuorum" not in {reason(n) for n, _, _ in nodes}
            _check(nodes, 1, seen, nodes[0][1].store.promoted_goldens())
            cm = api.configmap(NS, f"screener-quorum-{NEW}")
            assert cm is not None and list(cm["data"]) == [f"{JOB}.json"]
        finally:
            for _, rig, _ in nodes:
                rig.close()


def test_healthy_nodes_that_upgrade_stay_healthy_wait_visibly_and_settle_by_quorum(tmp_path, spec,
                                                                                   answers):
    """Healthy on the old platform (its golden in the folder), every node moves to the new one.
    A quick screen runs each job once, which can count towards no quorum: the next screen of a
    waiting node repeats its jobs and reads the fleet's candidates, and the fourth node to
    reproduce the same result finds three others that did."""
    old = "00000000000000ab"
    folder = tmp_path / "golden"
    folder.mkdir()
    golden_mod.write(golden_mod.record_from_results(spec, {"name": "old"}, old,
                                                    [("x", answers["clean"])], repeats=1), folder)
    shared = tmp_path / "fleet.db"
    nodes = _fleet(tmp_path, spec, answers, 4, -1, lambda name, f: LocalStore(shared),
                   phash=old, screen_interval_s=1000.0)
    try:
        for name, rig, _ in nodes:
            rig.tick()
            assert rig.store.get_state(name) == NodeState.HEALTHY
        for _, _, runner in nodes:
            runner.phash = NEW  # the upgrade: a new platform key, with no golden
        rounds = []
        for advance in (1001.0, 601.0, 601.0):
            for name, rig, _ in nodes:
                rig.tick(advance=advance)
            rounds.append({name: rig.store.get_verdict(name)["verdicts"][0]["reason"]
                           for name, rig, _ in nodes})
        assert set(rounds[0].values()) == {KnownAnswerReason.AWAITING_QUORUM.value}, rounds
        # the second round repeats the jobs: gpu-03 finds the three before it, and passes
        assert rounds[1] == {"gpu-00": "awaiting_quorum", "gpu-01": "awaiting_quorum",
                             "gpu-02": "awaiting_quorum", "gpu-03": ""}, rounds
        assert set(rounds[2].values()) == {""}, rounds  # judged by the promoted golden
        for name, rig, runner in nodes:
            assert rig.store.get_state(name) == NodeState.HEALTHY  # never left service
            quick = [r for r in runner.requests if r.kind != "full"]
            assert quick[0].repeat is None and quick[1].repeat == 2, name
            assert quick[1].fleet is not None
            gauge = rig.metrics.awaiting_quorum.labels(rig.metrics.node, NEW)._value.get()
            assert gauge == 0  # settled: the series says so
        assert list(nodes[0][1].store.promoted_goldens()[NEW]) == [JOB]
    finally:
        for _, rig, _ in nodes:
            rig.close()
