"""The repair ladder (issue 24.3) in the daemon: real lifecycle, real LocalStore, and the fake
`nvidia-smi` and `dcgmi` executables of tests/fakes/nvidia_tools.py on the tools' PATH, which print
the real tools' output (`nvidia-smi -r`'s sentence and refusals, --query-compute-apps' CSV, dcgmi
diag's DCGM 3.x and 4.x tables; sources in tests/data/gpu_tools/SOURCES.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fakes.daemon import NODE, DaemonRig, ScriptedRunner, outcome
from fakes.nvidia_tools import install_tools, tool_calls
from screener.types import NodeState, Outcome, Reason


def _quarantined(tmp_path: Path, runner: ScriptedRunner, env: dict[str, str], **ladder):
    """A daemon with the ladder on, its node screened healthy, then quarantined by an alarm."""
    rig = DaemonRig(tmp_path, runner, idle_window_s=0.0,
                    ladder={"enabled": True, "min_interval_s": 600.0, **ladder},
                    env=env)
    assert rig.tick().state == NodeState.HEALTHY
    rig.drop_alarm("a-1", settled=True)
    return rig


# What dcgmi diag's table says when GPU 1 fails its memory test, in each DCGM's layout.
DIAG = {"4": ("memory", "Fail; GPU0: Pass; GPU1: Fail", "pcie", "Pass; GPU0: Pass; GPU1: Pass"),
        "3": ("GPU Memory", "Pass - GPU: 0; Fail - GPU: 1", "PCIe", "Pass - All")}


@pytest.mark.parametrize("dcgm", ["4", "3"])
def test_an_idle_quarantined_node_is_corroborated_reset_and_rescreened(tmp_path, dcgm):
    env, state = install_tools(tmp_path)
    (state / "diag_fails").write_text("1")
    (state / "dcgm_version").write_text(dcgm)
    memory, memory_rows, pcie, pcie_rows = DIAG[dcgm]
    rig = _quarantined(tmp_path, ScriptedRunner(outcome(Outcome.PASS), outcome(Outcome.PASS)), env)
    try:
        report = rig.tick(advance=60.0)  # the alarm quarantines; the idle probe climbs
        moves = [(t["from"], t["to"], t["code"]) for t in report.transitions]
        assert moves == [("healthy", "quarantined", "WeightFingerprintMismatch"),
                         ("quarantined", "burnin", Reason.REMEDIATED),
                         ("burnin", "healthy", "KnownAnswerPassed")]
        assert tool_calls(state) == ["dcgmi diag -r 2",
                                 "nvidia-smi --query-compute-apps=gpu_uuid,pid,process_name "
                                 "--format=csv,noheader",
                                 "nvidia-smi -r -i 0", "nvidia-smi -r -i 1"]
        diag = next(a for a in report.actions if a["action"] == "dcgm_diag")
        assert diag["result"] == f"failed: {memory}" and diag["diag"]["passed"] is False
        # The durable record: the rung's transition carries the resets' output and DCGM's word.
        rung = next(t for t in rig.store.history(NODE) if t.code == Reason.REMEDIATED)
        ladder = rung.evidence["remediation"]["ladder"]
        assert ladder["rung"] == "gpu_reset" and ladder["gpus"] == [0, 1]
        assert "00000000:08:00.0 was successfully reset." in ladder["resets"][1]["output"]
        assert ladder["dcgm_diag"]["rows"][memory] == memory_rows
        assert ladder["dcgm_diag"]["rows"][pcie] == pcie_rows
        assert ladder["dcgm_diag"]["version"] == ("4.4.2" if dcgm == "4" else "3.3.9")
        assert ladder["dcgm_diag"]["tool"]["returncode"] == 226  # DCGM_ST_NVVS_ERROR
        assert rig.store.get_verdict(NODE)["kind"] == "full"  # the re-screen was a full burn-in
        json.dumps(report.to_dict())
    finally:
        rig.close()


def test_a_reset_that_fails_or_cannot_start_is_no_verdict_and_waits_its_interval(tmp_path):
    env, state = install_tools(tmp_path, dcgmi=False)  # no DCGM here: no corroboration, no error
    (state / "apps").write_text("GPU-5c7c8a0e-0000-0000-0000-000000000001, 4242, python\n")
    rig = _quarantined(tmp_path, ScriptedRunner(outcome(Outcome.PASS)), env)
    try:
        report = rig.tick(advance=60.0)
        assert report.state == NodeState.QUARANTINED
        assert [a["result"] for a in report.actions if a["action"] == "gpu_reset"] == [
            "not started: processes on the GPUs: 4242 (python)"]
        assert not [c for c in tool_calls(state) if " -r " in c]  # never reset under a process
        # The process is gone, but the reset refuses: our side, not the hardware's.
        (state / "apps").unlink()
        report = rig.tick(advance=60.0)
        assert report.state == NodeState.QUARANTINED and not report.actions  # rate limit: 600 s
        (state / "reset_fails").write_text("")
        report = rig.tick(advance=600.0)
        failed = [a for a in report.actions if a["action"] == "gpu_reset"]
        assert failed and failed[0]["result"].startswith(
            "failed: GPU 0 was not reset (exit 255): In use by another client")
        assert report.state == NodeState.QUARANTINED and report.transitions == []
        assert [t.to_state for t in rig.store.history(NODE)][-1] == NodeState.QUARANTINED
        assert rig.metrics.errors.labels(NODE, "ladder")._value.get() == 1.0
    finally:
        rig.close()


def test_dry_run_resets_nothing_and_the_budget_stops_the_ladder(tmp_path):
    env, state = install_tools(tmp_path)
    rig = _quarantined(tmp_path, ScriptedRunner(outcome(Outcome.PASS)), env, dry_run=True)
    try:
        report = rig.tick(advance=60.0)
        assert report.state == NodeState.QUARANTINED
        said = {a["action"]: a["result"] for a in report.actions}
        assert said["gpu_reset"] == "dry run: would run nvidia-smi -r -i 0; nvidia-smi -r -i 1"
        assert said["dcgm_diag"] == "dry run: would run dcgmi diag -r 2"
        assert not [c for c in tool_calls(state) if " -r " in c or c.startswith("dcgmi")]
    finally:
        rig.close()
    env2, state2 = install_tools(tmp_path / "b")
    rig = _quarantined(tmp_path / "b", ScriptedRunner(outcome(Outcome.PASS)), env2, max_rungs=0)
    try:
        report = rig.tick(advance=60.0)
        assert report.state == NodeState.QUARANTINED
        assert "budget is spent (0 of 0 rungs in 30 days)" in report.actions[0]["result"]
        assert tool_calls(state2) == []
    finally:
        rig.close()
