"""The alarm file has one home (issue 37.5): screener.alarmfile holds the check names, the record,
the bounds and the write; the audit writes by it and the intake reads by it."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from screener import alarmfile
from screener.agent.daemon.intake import AlarmIntake
from screener.audit.alarms import SDCAlarm
from screener.types import SuspectNode

ROOT = Path(__file__).resolve().parents[1]
NAMES = set(alarmfile.CHECKS)


def _record(check: str, alarm_id: str = "a1") -> alarmfile.AlarmRecord:
    return alarmfile.AlarmRecord(alarm_id=alarm_id, check=check, step=3, settled=False,
                                 suspect_ranks=(), suspect_nodes=(SuspectNode("n1", "h1"),),
                                 node="n1", job="j", created=0.0, evidence={})


def _sources():
    for p in sorted((ROOT / "screener").rglob("*.py")):
        yield p.relative_to(ROOT).as_posix(), ast.parse(p.read_text())


def test_no_other_module_lists_the_check_names():
    """A tuple, list, set or dict naming two or more checks is a second list that can go stale."""
    lists = []
    for rel, tree in _sources():
        if rel == "screener/alarmfile.py":
            continue
        for node in ast.walk(tree):
            items = node.keys if isinstance(node, ast.Dict) else \
                node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else []
            named = {i.value for i in items if isinstance(i, ast.Constant) and i.value in NAMES}
            if len(named) >= 2:
                lists.append(f"{rel}:{node.lineno}")
    assert lists == [], f"the check names are listed outside screener.alarmfile: {lists}"


def test_every_check_the_audit_raises_is_the_contracts():
    raised = set()
    for rel, tree in _sources():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                    and node.func.id == "SDCAlarm" and node.args \
                    and isinstance(node.args[0], ast.Constant):
                raised.add(node.args[0].value)
    assert raised and raised <= set(alarmfile.SDC_CHECKS) <= NAMES
    with pytest.raises(ValueError, match="unknown check"):
        SDCAlarm("weight", 1)


def test_intake_accepts_exactly_the_contracts_checks(tmp_path):
    for i, check in enumerate(sorted(NAMES) + ["weight", "Ring_replay"]):
        alarmfile.write_alarm_file(_record(check, f"a{i}"), tmp_path)
    applied = []
    result = AlarmIntake(tmp_path, "n1", applied.append).run()
    assert sorted(r.check for r in applied) == sorted(NAMES)
    assert set(result.rejected) == {f"a{len(NAMES)}.json", f"a{len(NAMES) + 1}.json"}


def test_the_file_is_the_records_json_and_old_paths_still_work(tmp_path):
    rec = _record(alarmfile.PREFLIGHT)
    path = alarmfile.write_alarm_file(rec, tmp_path / "new")
    assert path.name == "a1.json"
    assert path.read_bytes() == json.dumps(rec.to_dict(), sort_keys=True).encode()
    assert alarmfile.validate(json.loads(path.read_bytes()), now=1e9) == rec
    import screener.agent.daemon.intake as intake
    import screener.atomicfile as atomicfile
    import screener.audit.alarms as alarms
    import screener.types as types
    # the old paths still work, with a deprecation line naming the new one
    with pytest.warns(DeprecationWarning, match="import AlarmRecord from screener.alarmfile"):
        assert types.AlarmRecord is alarmfile.AlarmRecord
    with pytest.warns(DeprecationWarning, match="import CHECKS from screener.alarmfile"):
        assert types.ALARM_CHECK_REASONS is alarmfile.CHECKS
    assert alarms.write_atomic is atomicfile.write_atomic
    assert alarms.CHECKS == alarmfile.SDC_CHECKS
    assert intake.validate is alarmfile.validate
    with pytest.raises(AttributeError):
        types.NoSuchName  # noqa: B018

