"""`screener node status` for the fleet (issue 35.4, item 10): its columns line up whatever the
names' lengths (a name shorter than "NODE" pushed every later column out), and a partial
burn-in shows (the node stays in burnin, and the table said only "burnin"), from the local store
and from Node annotations alike."""

from __future__ import annotations

import json
import re

from cli_util import screener
from fakes.kubeapi import KubeAPI
from screener.lifecycle.records import Transition
from screener.stores.local import LocalStore
from screener.types import ANNOTATION_VERDICT, LABEL_STATE, NodeState as S

PARTIAL = {"time": 1000.0, "outcome": "pass", "kind": "partial", "screen": "burnin",
           "missing": ["the known-answer jobs ran 2 s of the required 3600 s"], "verdicts": []}


def columns(line: str, names: list[str]) -> list[int]:
    return [line.index(n) for n in names]


def test_the_fleet_table_lines_up_and_shows_a_partial_burn_in(tmp_path):
    db = tmp_path / "s.db"
    store = LocalStore(db)
    for name in ("a", "b1"):
        store.record(Transition(node=name, time=900.0, from_state=None, to_state=S.BURNIN,
                                reason="new node"))
    store.set_verdict("a", PARTIAL)
    store.close()
    r = screener("node", "status", "--db", str(db), "--store", "local")
    assert r.returncode == 0, r.stdout + r.stderr
    head, *rows = r.stdout.splitlines()
    heads = ["STATE", "SINCE", "LAST SCREEN", "REASON"]
    starts = columns(head, heads)
    assert head.startswith("NODE ")
    a = next(row for row in rows if row.startswith("a "))
    cells = [m.start() for m in re.finditer(r"(?<=  )\S", a)]
    assert cells == starts, (head, a)  # every cell starts under its header
    assert a[starts[2]:].startswith("burnin partial: pass"), a
    other = next(row for row in rows if row.startswith("b1 "))
    assert other[starts[2]:].startswith("- ") and other[starts[0]:].startswith("burnin"), other
    doc = json.loads(screener("node", "status", "--db", str(db), "--store", "local",
                              "--json").stdout)
    by = {n["node"]: n for n in doc["nodes"]}
    assert by["a"]["last_screen"]["kind"] == "partial" and by["a"]["last_screen"]["missing"]
    assert by["b1"]["last_screen"] is None
    one = screener("node", "status", "a", "--db", str(db), "--store", "local")
    assert "last verdict: pass (burnin partial: pass)" in one.stdout, one.stdout
    assert "missing for a full burn-in: the known-answer jobs ran 2 s" in one.stdout


def test_the_fleet_table_reads_a_partial_burn_in_from_the_node_annotation(tmp_path):
    with KubeAPI() as api:
        api.add_node("n1", labels={LABEL_STATE: "burnin"},
                     annotations={ANNOTATION_VERDICT: json.dumps(PARTIAL)})
        api.add_node("n2", labels={LABEL_STATE: "burnin"},
                     annotations={ANNOTATION_VERDICT: "{not json"})
        kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig")
        r = screener("node", "status", "--kubeconfig", str(kubeconfig), "--spool",
                     str(tmp_path / "spool.db"), "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    by = {n["node"]: n for n in json.loads(r.stdout)["nodes"]}
    assert by["n1"]["last_screen"] == {"screen": "burnin", "kind": "partial", "outcome": "pass",
                                       "time": 1000.0, "missing": PARTIAL["missing"]}
    assert by["n2"]["last_screen"] is None  # an annotation that does not parse shows as none
