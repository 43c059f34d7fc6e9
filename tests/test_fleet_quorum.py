"""A platform with no golden is judged by a quorum of other nodes (issue 33.3), and then by the golden
the quorum promoted.

The jobs run for real in process (milliseconds a run), faulty devices through the real fault
injector; the judgment, the promotion and the stores are the product's; the fleet's other nodes
are what they publish (the candidates), read from a real LocalStore shared by several nodes and a
real KubeStore talking HTTP to the Kubernetes API test server. The daemon's rolling upgrade is
tests/test_rolling_upgrade.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

import kubernetes.client
import pytest

from fakes.kubeapi import KubeAPI
from screener.determinism import preserved
from screener.known_answer.engine import golden, promotion
from screener.known_answer.engine.screen import judge_runs
from screener.known_answer.engine import workloads as w
from screener.known_answer.engine.faults import FaultSpec, inject
from screener.known_answer.verdict.quorum import FleetView, candidates_of
from screener.known_answer.verdict.results import JobResult
from screener.known_answer.verdict.runs import DeviceRun
from screener.stores.kube import KubeStore
from screener.stores.local import LocalStore
from screener.types import ANNOTATION_CANDIDATES, KnownAnswerReason, Outcome

ROOT = Path(__file__).resolve().parents[1]
PH = "00000000000000aa"  # the new platform: no golden anywhere
JOB = "gemm-fp32"
NS = "screener-system"


@pytest.fixture(autouse=True)
def _restore_process_settings():
    with preserved():
        yield


@pytest.fixture(scope="module")
def spec() -> w.JobSpec:
    return next(s for s in w.load_jobs(ROOT / "jobs") if s.name == JOB)


@pytest.fixture(scope="module")
def clean(spec) -> JobResult:
    with preserved():
        return w.run_job(spec, "cpu")


def _bad(spec: w.JobSpec, *, call: int = 0, persistent: bool = True) -> JobResult:
    inj = inject(FaultSpec("mm", call=call, element=7, bit=3, persistent=persistent))
    r = w.run_job(spec, "cpu", injector=inj)
    assert inj.fired
    return r


def _device(name: str, results: Sequence[JobResult]) -> DeviceRun:
    run = DeviceRun(name, platform={"name": "test"}, platform_hash=PH)
    for i, r in enumerate(results):
        run.add(i, r)
    run.iterations = len(results)
    return run


def _fleet(digests: dict[str, str], *, node: str = "me", need: int = 3,
           spec_hash: Any = None, promoted: Any = None) -> FleetView:
    return FleetView(node, need, {n: {PH: {JOB: {"digest": d, "spec_hash": spec_hash}}}
                                  for n, d in digests.items()}, promoted or {})


def _judge(spec, runs: dict[str, DeviceRun], fleet: FleetView, tmp_path: Path):
    empty = tmp_path / "golden"
    empty.mkdir(exist_ok=True)
    return judge_runs(runs, [spec], str(empty), seconds=0.0, fleet=fleet)


# --- the quorum itself ------------------------------------------------------------------------


def test_a_quorum_needs_enough_other_nodes_and_a_strict_majority_of_those_that_published():
    f = _fleet({"a": "x", "b": "x"})
    q = f.quorum_for(PH, JOB, None)
    assert q.waiting and q.nodes == ("a", "b") and q.reporting == 2
    assert "2 of the 3" in q.describe()
    q = _fleet({"a": "x", "b": "x", "c": "x"}).quorum_for(PH, JOB, None)
    assert q.digest == "x" and q.nodes == ("a", "b", "c")
    # three agree but three others say otherwise: no strict majority, nobody is right yet
    q = _fleet({"a": "x", "b": "x", "c": "x", "d": "y", "e": "y", "f": "z"}).quorum_for(PH, JOB, None)
    assert q.waiting and q.reporting == 6 and "disagree" in q.describe()
    # four of six is a strict majority
    q = _fleet({"a": "x", "b": "x", "c": "x", "d": "x", "e": "y", "f": "z"}).quorum_for(PH, JOB, None)
    assert q.digest == "x"


def test_the_node_itself_and_results_of_another_spec_are_no_votes():
    f = _fleet({"me": "x", "a": "x", "b": "x"})
    assert f.quorum_for(PH, JOB, None).waiting  # "me" never counts for itself
    f = _fleet({"a": "x", "b": "x", "c": "x"}, spec_hash="old")
    assert f.quorum_for(PH, JOB, "new").waiting and f.quorum_for(PH, JOB, "old").digest == "x"
    assert _fleet({"a": "x", "b": "x", "c": "x"}).quorum_for("00000000000000bb", JOB, None).waiting


def test_a_fleet_view_from_hostile_json_drops_what_is_not_a_vote():
    f = FleetView.from_dict({"node": "me", "need": True, "candidates": {
        "a": {PH: {JOB: {"digest": "x"}}}, "b": {PH: {JOB: {"digest": 5}}}, "c": [1],
        "d": {PH: {JOB: "x"}}, "e": {PH: {JOB: {"digest": "x", "spec_hash": {"no": 1}}}}},
        "promoted": {PH: {JOB: 7, "other": "text"}}})
    assert f.need == 3  # a bool is no count
    assert set(f.candidates) == {"a", "e"} and f.candidates["e"][PH][JOB]["spec_hash"] is None
    assert f.promoted == {PH: {"other": "text"}}
    assert FleetView.from_dict(f.to_dict()) == f


# --- the judgment with a quorum -----------------------------------------------------------------


def test_with_a_quorum_a_device_that_reproduces_it_passes_and_promotes_its_result(spec, clean,
                                                                                     tmp_path):
    fleet = _fleet({"a": clean.digest, "b": clean.digest, "c": clean.digest, "d": "other"})
    res = _judge(spec, {"cpu": _device("cpu", [clean, clean])}, fleet, tmp_path)
    v = res.verdict("cpu")
    assert v.outcome == Outcome.PASS, v.evidence
    assert v.evidence["jobs"][JOB]["quorum"]["nodes"] == ["a", "b", "c"]
    text = res.promote[PH][JOB]
    record = promotion.load(res.promote, spec, PH)
    assert record is not None and record.digest == clean.digest
    assert record.recorded["source"] == "quorum" and record.recorded["promoted_by"] == "me"
    assert record.recorded["quorum"]["agreeing"] == 3
    assert json.loads(text)["digest"] == clean.digest
    # what the node tells the fleet after it
    assert candidates_of(res.to_dict()) == {PH: {JOB: {"digest": clean.digest,
                                                       "spec_hash": clean.spec_hash}}}


def test_with_a_quorum_a_persistently_wrong_device_is_suspect_naming_the_quorum(spec, clean,
                                                                                 tmp_path):
    bad = _bad(spec)
    fleet = _fleet({"a": clean.digest, "b": clean.digest, "c": clean.digest})
    res = _judge(spec, {"cpu": _device("cpu", [bad, bad])}, fleet, tmp_path)
    v = res.verdict("cpu")
    assert v.outcome == Outcome.SUSPECT and v.reason == KnownAnswerReason.QUORUM_MISMATCH
    assert v.expected == clean.digest and v.observed == bad.digest
    assert "3 of 3 other node(s)" in v.evidence["detail"]
    assert not res.promote and candidates_of(res.to_dict()) == {}  # a suspect device tells nothing


def test_with_a_quorum_a_device_that_disagrees_with_itself_is_suspect_never_our_bug(spec, clean,
                                                                                     tmp_path):
    # 4 of 5 runs agree: without a reference this was "a screener bug" (exit 1)
    flaky = _bad(spec, persistent=False)
    fleet = _fleet({"a": clean.digest, "b": clean.digest, "c": clean.digest})
    res = _judge(spec, {"cpu": _device("cpu", [clean, clean, flaky, clean, clean])}, fleet,
                 tmp_path)
    v = res.verdict("cpu")
    assert v.outcome == Outcome.SUSPECT and v.reason == KnownAnswerReason.SELF_MISMATCH
    assert "1 of 5 runs differ from the quorum" in v.evidence["detail"]
    assert int(res.exit_code) == 75 and not res.promote


def test_without_a_quorum_the_platform_visibly_waits_and_its_result_is_a_candidate(spec, clean,
                                                                                    tmp_path):
    fleet = _fleet({"a": clean.digest, "b": clean.digest})
    res = _judge(spec, {"cpu": _device("cpu", [clean, clean])}, fleet, tmp_path)
    v = res.verdict("cpu")
    assert v.outcome == Outcome.INCONCLUSIVE and v.reason == KnownAnswerReason.AWAITING_QUORUM
    assert "2 of the 3 other node(s)" in v.evidence["detail"]
    assert "screener golden record" in v.evidence["command"]
    assert candidates_of(res.to_dict())[PH][JOB]["digest"] == clean.digest
    # one run is no candidate: only a result the device reproduced counts towards a quorum
    res1 = _judge(spec, {"cpu": _device("cpu", [clean])}, fleet, tmp_path)
    assert res1.verdict("cpu").reason == KnownAnswerReason.AWAITING_QUORUM
    assert candidates_of(res1.to_dict()) == {}


def test_this_nodes_memory_never_overrides_a_quorum(spec, clean, tmp_path):
    bad = _bad(spec)
    # the node's memory was poisoned by a persistently bad lane: it says bad.digest
    known = {PH: {JOB: {"digest": bad.digest, "spec_hash": clean.spec_hash}}}
    fleet = _fleet({"a": clean.digest, "b": clean.digest, "c": clean.digest})
    empty = tmp_path / "g"
    empty.mkdir()
    res = judge_runs({"cpu": _device("cpu", [clean, clean])}, [spec], str(empty),
                         seconds=0.0, known=known, fleet=fleet)
    assert res.verdict("cpu").outcome == Outcome.PASS
    res = judge_runs({"cpu": _device("cpu", [bad, bad])}, [spec], str(empty), seconds=0.0,
                         known=known, fleet=fleet)
    assert res.verdict("cpu").reason == KnownAnswerReason.QUORUM_MISMATCH


def test_a_promoted_golden_is_a_golden_and_a_broken_one_is_left_out(spec, clean, tmp_path):
    fleet = _fleet({"a": clean.digest, "b": clean.digest, "c": clean.digest})
    promoted = _judge(spec, {"cpu": _device("cpu", [clean, clean])}, fleet, tmp_path).promote
    bad = _bad(spec)
    # with the promoted record and no candidates at all: a golden mismatch, with step and tensor
    res = _judge(spec, {"cpu": _device("cpu", [bad, bad])}, FleetView("me", 3, {}, promoted),
                 tmp_path)
    v = res.verdict("cpu")
    assert v.reason == KnownAnswerReason.GOLDEN_MISMATCH and v.step is not None and v.tensor
    assert v.evidence["detail"] == promotion.store_path(JOB, PH)
    # a record edited in the store fails its checksum: left out, the quorum decides
    text = promoted[PH][JOB].replace('"repeats": 2', '"repeats": 3')
    assert text != promoted[PH][JOB]
    res = _judge(spec, {"cpu": _device("cpu", [bad, bad])},
                 _fleet({"a": clean.digest, "b": clean.digest, "c": clean.digest},
                        promoted={PH: {JOB: text}}), tmp_path)
    assert res.verdict("cpu").reason == KnownAnswerReason.QUORUM_MISMATCH
    # and with nothing else: waiting, never a verdict on the broken record
    res = _judge(spec, {"cpu": _device("cpu", [bad, bad])},
                 FleetView("me", 3, {}, {PH: {JOB: text}}), tmp_path)
    assert res.verdict("cpu").reason == KnownAnswerReason.AWAITING_QUORUM


def test_a_folder_golden_comes_before_a_promoted_one(spec, clean, tmp_path):
    bad = _bad(spec)
    # a person recorded bad bits on a node they trusted; the fleet promoted the clean ones
    folder = tmp_path / "person"
    golden.write(golden.record_from_results(spec, {"name": "test"}, PH, [("x", bad)], repeats=1),
                 folder)
    fleet = _fleet({"a": clean.digest, "b": clean.digest, "c": clean.digest})
    promoted = _judge(spec, {"cpu": _device("cpu", [clean, clean])}, fleet, tmp_path).promote
    assert promoted
    res = judge_runs({"cpu": _device("cpu", [bad, bad])}, [spec], str(folder), seconds=0.0,
                         fleet=FleetView("me", 3, {}, promoted))
    assert res.verdict("cpu").outcome == Outcome.PASS
    assert res.verdict("cpu").evidence["jobs"][JOB]["golden"].startswith(str(folder))


# --- the stores -------------------------------------------------------------------------------------


def _check_store(a: Any, b: Any, clean: JobResult) -> None:
    """Two nodes' stores onto one fleet: candidates merge per node, promotion is add-only."""
    cands = {PH: {JOB: {"digest": clean.digest, "spec_hash": clean.spec_hash}}}
    a.publish_candidates("node-a", cands)
    b.publish_candidates("node-b", {PH: {JOB: {"digest": "zz", "spec_hash": None}},
                                    "00000000000000bb": {"conv-fp32": {"digest": "c1",
                                                                      "spec_hash": "s"}}})
    seen = b.fleet_candidates()
    assert seen["node-a"] == cands
    assert seen["node-b"][PH][JOB]["digest"] == "zz" and "00000000000000bb" in seen["node-b"]
    # a later screen replaces the node's entry for that job, keeps its other platforms
    b.publish_candidates("node-b", cands)
    seen = a.fleet_candidates()
    assert seen["node-b"][PH] == cands[PH] and "00000000000000bb" in seen["node-b"]
    assert a.promote_golden(PH, JOB, "first") is None
    assert b.promote_golden(PH, JOB, "second") == "first"  # add-only: the first stays
    assert b.promote_golden(PH, "conv-fp32", "third") is None
    assert a.promoted_goldens() == {PH: {JOB: "first", "conv-fp32": "third"}}


def test_the_local_store_shared_by_nodes_keeps_the_fleet(tmp_path, clean):
    path = tmp_path / "fleet.db"
    with LocalStore(path) as a, LocalStore(path) as b:
        _check_store(a, b, clean)
    with LocalStore(path, read_only=True) as r:
        assert set(r.fleet_candidates()) == {"node-a", "node-b"}


def test_a_local_store_of_a_screener_before_the_quorum_reads_as_an_empty_fleet(tmp_path):
    path = tmp_path / "old.db"
    with LocalStore(path) as s:
        s._db.execute("DROP TABLE kat_candidates")
        s._db.execute("DROP TABLE kat_promoted")
    with LocalStore(path, read_only=True) as r:
        assert r.fleet_candidates() == {} and r.promoted_goldens() == {}
    with LocalStore(path) as s:  # opened for writing: the tables are added
        s.publish_candidates("n", {PH: {JOB: {"digest": "x", "spec_hash": None}}})
        assert s.fleet_candidates() == {"n": {PH: {JOB: {"digest": "x", "spec_hash": None}}}}


def _kube(api: KubeAPI, node: str) -> KubeStore:
    cfg = kubernetes.client.Configuration()
    cfg.host, cfg.retries = api.url, False
    return KubeStore(kubernetes.client.ApiClient(cfg), namespace=NS, instance=node)


def test_the_kube_store_keeps_candidates_on_the_node_and_goldens_in_configmaps(clean):
    with KubeAPI() as api:
        for n in ("node-a", "node-b", "node-c"):
            api.add_node(n)
        api.mutate("node-c", lambda o: o["metadata"].setdefault("annotations", {}).update(
            {ANNOTATION_CANDIDATES: "{not json"}))
        a, b = _kube(api, "node-a"), _kube(api, "node-b")
        try:
            _check_store(a, b, clean)
            # one object per platform, labelled for one list; candidates on each node's own Node
            cm = api.configmap(NS, f"screener-quorum-{PH}")
            assert cm is not None and set(cm["data"]) == {f"{JOB}.json", "conv-fp32.json"}
            assert cm["metadata"]["labels"]["screener.io/quorum"] == "true"
            raw = api.node("node-a")["metadata"]["annotations"][ANNOTATION_CANDIDATES]
            assert json.loads(raw)[PH][JOB]["digest"] == clean.digest
            assert "node-c" not in a.fleet_candidates()  # a broken annotation is no vote
            with pytest.raises(ValueError):
                a.promote_golden("../../etc", JOB, "x")
        finally:
            a.close()
            b.close()


def test_golden_list_fleet_shows_the_promoted_goldens_with_their_provenance(spec, clean,
                                                                             tmp_path):
    from cli_util import screener

    fleet = _fleet({"a": clean.digest, "b": clean.digest, "c": clean.digest})
    promote = _judge(spec, {"cpu": _device("cpu", [clean, clean])}, fleet, tmp_path).promote
    db = tmp_path / "fleet.db"
    with LocalStore(db) as s:
        s.promote_golden(PH, JOB, promote[PH][JOB])
        s.promote_golden(PH, "conv-fp32", "{broken")
    empty = tmp_path / "none"
    empty.mkdir()
    ran = screener("golden", "list", str(empty), "--fleet", "--store", "local", "--db", str(db),
                   "--json")
    assert ran.returncode == 2  # the broken record is a problem, said in one line
    out = json.loads(ran.stdout)
    (row,) = out["records"]
    assert row["source"] == "quorum" and row["platform_hash"] == PH
    assert row["provenance"]["nodes"] == ["a", "b", "c"] and row["provenance"]["promoted_by"] == "me"
    assert len(out["problems"]) == 1 and "conv-fp32" in out["problems"][0]
    text = screener("golden", "list", str(empty), "--fleet", "--store", "local", "--db", str(db))
    assert "promoted from a quorum of 3 node(s) (a, b, c) by me" in text.stdout
    assert "Traceback" not in text.stderr
    # without --fleet no store is read
    plain = screener("golden", "list", str(empty), "--json", "--db", str(tmp_path / "absent.db"))
    assert plain.returncode == 0 and json.loads(plain.stdout)["records"] == []


def test_one_other_node_that_reproduced_the_job_makes_a_self_mismatch_suspect(spec, clean,
                                                                               tmp_path):
    """Issue 33.4: a device that disagrees with itself is suspect wherever something shows the
    job deterministic on its platform, another node that reproduced it included, even with no
    quorum yet; with no other node at all it stays inconclusive."""
    flaky = _bad(spec, persistent=False)
    runs = {"cpu": _device("cpu", [clean, flaky, clean])}
    alone = _judge(spec, runs, _fleet({}), tmp_path).verdict("cpu")
    assert alone.outcome == Outcome.INCONCLUSIVE and alone.reason == KnownAnswerReason.SELF_MISMATCH
    one = _judge(spec, runs, _fleet({"a": clean.digest}), tmp_path).verdict("cpu")
    assert one.outcome == Outcome.SUSPECT and one.reason == KnownAnswerReason.SELF_MISMATCH
    assert "1 other node(s) of the platform reproduced it (e.g. a" in one.evidence["detail"]
