"""The repair ladder (issue 24.3) in the daemon: real lifecycle, real LocalStore, and fake
`nvidia-smi` and `dcgmi` executables on the tools' PATH that print what NVIDIA documents
(`nvidia-smi -r`'s sentence, --query-compute-apps' CSV, dcgmi diag's result table)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from screener.types import NodeState, Reason
from fakes.daemon import NODE, DaemonRig, ScriptedRunner, outcome
from screener.types import Outcome

NVIDIA_SMI = r'''#!{python}
import os, pathlib, sys
d = pathlib.Path(os.environ["FAKE_GPU_DIR"])
args = sys.argv[1:]
with open(d / "calls", "a") as f:
    f.write("nvidia-smi " + " ".join(args) + "\n")
if args and args[0].startswith("--query-compute-apps="):
    apps = d / "apps"
    sys.stdout.write(apps.read_text() if apps.exists() else "")
    sys.exit(0)
if args[:1] == ["-r"]:
    bus = "00000000:%02X:00.0" % (7 + int(args[args.index("-i") + 1]))
    if (d / "reset_fails").exists():
        print("Unable to reset GPU %s because it's being used by some other process (e.g. CUDA "
              "application, graphics application like X server, monitoring application like "
              "other instance of nvidia-smi). Please first kill all processes using the device "
              "and retry the command or reboot the system to make GPU reset operational." % bus)
        sys.exit(255)
    print("GPU %s was successfully reset." % bus)
    print("All done.")
    sys.exit(0)
sys.exit(2)
'''

DCGMI = r'''#!{python}
import os, pathlib, sys
d = pathlib.Path(os.environ["FAKE_GPU_DIR"])
with open(d / "calls", "a") as f:
    f.write("dcgmi " + " ".join(sys.argv[1:]) + "\n")
memory = "Fail - GPU: 1" if (d / "diag_fails").exists() else "Pass - All"
print("""Successfully ran diagnostic for group.
+---------------------------+------------------------------------------------+
| Diagnostic                | Result                                         |
+===========================+================================================+
|-----  Deployment  --------+------------------------------------------------|
| Blacklist                 | Pass                                           |
| NVML Library              | Pass                                           |
| CUDA Main Library         | Pass                                           |
| Permissions and OS Blocks | Pass                                           |
| Persistence Mode          | Pass                                           |
| Environment Variables     | Pass                                           |
| Page Retirement/Row Remap | Pass                                           |
| Graphics Processes        | Pass                                           |
| Inforom                   | Pass                                           |
+-----  Integration  -------+------------------------------------------------+
| PCIe                      | Pass - All                                     |
+-----  Hardware  ----------+------------------------------------------------+
| GPU Memory                | %-47s|
+-----  Stress  ------------+------------------------------------------------+
| SM Stress                 | Pass - All                                     |
| Targeted Stress           | Pass - All                                     |
| Targeted Power            | Pass - All                                     |
| Memory Bandwidth          | Pass - All                                     |
+---------------------------+------------------------------------------------+""" % memory)
sys.exit(226 if "Fail" in memory else 0)
'''


def _tools(tmp: Path, *, dcgmi: bool = True) -> tuple[dict[str, str], Path]:
    """A bin folder with the fake tools, and the environment that puts only it on PATH."""
    bin_dir, state = tmp / "bin", tmp / "gpu"
    bin_dir.mkdir(parents=True)
    state.mkdir()
    scripts = {"nvidia-smi": NVIDIA_SMI, **({"dcgmi": DCGMI} if dcgmi else {})}
    for name, text in scripts.items():
        p = bin_dir / name
        p.write_text(text.replace("{python}", sys.executable, 1))
        p.chmod(0o755)
    return {"PATH": str(bin_dir), "FAKE_GPU_DIR": str(state)}, state


def _quarantined(tmp_path: Path, runner: ScriptedRunner, env: dict[str, str], **ladder):
    """A daemon with the ladder on, its node screened healthy, then quarantined by an alarm."""
    rig = DaemonRig(tmp_path, runner, idle_window_s=0.0,
                    ladder={"enabled": True, "min_interval_s": 600.0, **ladder},
                    daemon_kw={"tool_env": env})
    assert rig.tick().state == NodeState.HEALTHY
    rig.drop_alarm("a-1", settled=True)
    return rig


def _calls(state: Path) -> list[str]:
    p = state / "calls"
    return p.read_text().splitlines() if p.exists() else []


def test_an_idle_quarantined_node_is_corroborated_reset_and_rescreened(tmp_path):
    env, state = _tools(tmp_path)
    (state / "diag_fails").write_text("")
    rig = _quarantined(tmp_path, ScriptedRunner(outcome(Outcome.PASS), outcome(Outcome.PASS)), env)
    try:
        report = rig.tick(advance=60.0)  # the alarm quarantines; the idle probe climbs
        moves = [(t["from"], t["to"], t["code"]) for t in report.transitions]
        assert moves == [("healthy", "quarantined", "WeightFingerprintMismatch"),
                         ("quarantined", "burnin", Reason.REMEDIATED),
                         ("burnin", "healthy", "KnownAnswerPassed")]
        assert _calls(state) == ["dcgmi diag -r 2",
                                 "nvidia-smi --query-compute-apps=gpu_uuid,pid,process_name "
                                 "--format=csv,noheader",
                                 "nvidia-smi -r -i 0", "nvidia-smi -r -i 1"]
        diag = next(a for a in report.actions if a["action"] == "dcgm_diag")
        assert diag["result"] == "failed: GPU Memory" and diag["diag"]["passed"] is False
        # The durable record: the rung's transition carries the resets' output and DCGM's word.
        rung = next(t for t in rig.store.history(NODE) if t.code == Reason.REMEDIATED)
        ladder = rung.evidence["remediation"]["ladder"]
        assert ladder["rung"] == "gpu_reset" and ladder["gpus"] == [0, 1]
        assert "00000000:08:00.0 was successfully reset." in ladder["resets"][1]["output"]
        assert ladder["dcgm_diag"]["rows"]["GPU Memory"] == "Fail - GPU: 1"
        assert ladder["dcgm_diag"]["rows"]["PCIe"] == "Pass - All"
        assert rig.store.get_verdict(NODE)["kind"] == "full"  # the re-screen was a full burn-in
        json.dumps(report.to_dict())
    finally:
        rig.close()


def test_a_reset_that_fails_or_cannot_start_is_no_verdict_and_waits_its_interval(tmp_path):
    env, state = _tools(tmp_path, dcgmi=False)  # no DCGM here: no corroboration, no error
    (state / "apps").write_text("GPU-5c7c8a0e-0000-0000-0000-000000000001, 4242, python\n")
    rig = _quarantined(tmp_path, ScriptedRunner(outcome(Outcome.PASS)), env)
    try:
        report = rig.tick(advance=60.0)
        assert report.state == NodeState.QUARANTINED
        assert [a["result"] for a in report.actions if a["action"] == "gpu_reset"] == [
            "not started: processes on the GPUs: 4242 (python)"]
        assert not [c for c in _calls(state) if " -r " in c]  # never reset under a process
        # The process is gone, but the reset refuses: our side, not the hardware's.
        (state / "apps").unlink()
        report = rig.tick(advance=60.0)
        assert report.state == NodeState.QUARANTINED and not report.actions  # rate limit: 600 s
        (state / "reset_fails").write_text("")
        report = rig.tick(advance=600.0)
        failed = [a for a in report.actions if a["action"] == "gpu_reset"]
        assert failed and failed[0]["result"].startswith("failed: GPU 0 was not reset (exit 255)")
        assert report.state == NodeState.QUARANTINED and report.transitions == []
        assert [t.to_state for t in rig.store.history(NODE)][-1] == NodeState.QUARANTINED
        assert rig.metrics.errors.labels(NODE, "ladder")._value.get() == 1.0
    finally:
        rig.close()


def test_dry_run_resets_nothing_and_the_budget_stops_the_ladder(tmp_path):
    env, state = _tools(tmp_path)
    rig = _quarantined(tmp_path, ScriptedRunner(outcome(Outcome.PASS)), env, dry_run=True)
    try:
        report = rig.tick(advance=60.0)
        assert report.state == NodeState.QUARANTINED
        said = {a["action"]: a["result"] for a in report.actions}
        assert said["gpu_reset"] == "dry run: would run nvidia-smi -r -i 0; nvidia-smi -r -i 1"
        assert said["dcgm_diag"] == "dry run: would run dcgmi diag -r 2"
        assert not [c for c in _calls(state) if " -r " in c or c.startswith("dcgmi")]
    finally:
        rig.close()
    env2, state2 = _tools(tmp_path / "b")
    rig = _quarantined(tmp_path / "b", ScriptedRunner(outcome(Outcome.PASS)), env2, max_rungs=0)
    try:
        report = rig.tick(advance=60.0)
        assert report.state == NodeState.QUARANTINED
        assert "budget is spent (0 of 0 rungs in 30 days)" in report.actions[0]["result"]
        assert _calls(state2) == []
    finally:
        rig.close()
