"""screener launch around a real torchrun with three workers: the job's exit code is the workers'
verdict (75 beats 77 beats 76 beats anything else), learned from torchrun's own record of its
workers and from the codes run_guarded records, never torchrun's blanket 1.

Every case is a separate torchrun (rendezvous on a free port, --standalone) and they all run at
once: the cost is the launchers' torch import, paid in parallel.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from screener.launch import combine, is_torchrun
from screener.alarmfile import AlarmRecord

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent

# A worker that exits with its rank's code. "r" after a code: it first records the code the way
# run_guarded does (SCREENER_EXIT_DIR), and every recording worker waits until all recording
# workers have recorded, so the order in which torchrun sees them exit does not matter.
WORKER = r'''
import os, sys, time
from pathlib import Path
spec = sys.argv[1].split(",")[int(os.environ["RANK"])]
code, record = int(spec.rstrip("r")), spec.endswith("r")
sync = Path(sys.argv[2])
if record:
    d = Path(os.environ["SCREENER_EXIT_DIR"])
    (d / f"rank{os.environ['RANK']}.code").write_text(f"{code}\n")
    (sync / f"recorded{os.environ['RANK']}").write_text("")
    want = sum(s.endswith("r") for s in sys.argv[1].split(","))
    deadline = time.time() + 60
    while len(list(sync.glob("recorded*"))) < want and time.time() < deadline:
        time.sleep(0.01)
sys.exit(code)
'''

# A worker whose run_guarded sees a hardware error (75), then dies in its teardown with SIGABRT,
# as a process whose library aborts at exit would: torchrun sees -6, the verdict was 75.
GUARDED = r'''
import os, sys
from screener.audit import run_guarded
def main():
    if os.environ["RANK"] == "1":
        raise RuntimeError("CUDA error: uncorrectable ECC error encountered")
    return 0
code = run_guarded(main)
if code:
    os.abort()
sys.exit(code)
'''

CASES = {  # name: (worker codes by rank, expected launcher exit code)
    "hardware_beats_all": ("76r,77r,75r", 75),
    "peer_beats_numeric": ("0r,76r,77r", 77),
    "numeric": ("0,76,0", 76),  # from torchrun's record of its workers alone
    "other_failure": ("0,3,0", 3),
    "healthy": ("0,0,0", 0),
}


def _launch(cmd, tmp, name, alarms):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo",
           "NODE_NAME": f"node-{name}", "SCREENER_ALARM_DIR": str(alarms),
           "PYTHONPATH": str(ROOT)}
    env.pop("SCREENER_EXIT_DIR", None)
    return subprocess.Popen(cmd, cwd=tmp, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("launch")
    (tmp / "worker.py").write_text(WORKER)
    (tmp / "guarded.py").write_text(GUARDED)
    torchrun_opts = ["--nproc-per-node", "3", "--standalone", "--monitor-interval", "0.05"]
    procs = {}
    for name, (codes, _) in CASES.items():
        sync = tmp / f"sync-{name}"
        sync.mkdir()
        # half the cases through the CLI, half through python -m screener.launch
        if name in ("hardware_beats_all", "numeric"):
            cmd = [sys.executable, "-m", "screener.cli", "launch", "--", str(BIN / "torchrun"),
                   *torchrun_opts, "worker.py", codes, str(sync)]
        else:
            cmd = [sys.executable, "-m", "screener.launch", *torchrun_opts, "worker.py", codes,
                   str(sync)]
        procs[name] = _launch(cmd, tmp, name, tmp / f"alarms-{name}")
    procs["guarded"] = _launch([sys.executable, "-m", "screener.launch", *torchrun_opts,
                                "guarded.py"], tmp, "guarded", tmp / "alarms-guarded")
    procs["child"] = _launch([sys.executable, "-m", "screener.cli", "launch", "--",
                              sys.executable, "-c", "import sys; sys.exit(77)"], tmp, "child",
                             tmp / "alarms-child")
    out = {}
    try:
        for name, p in procs.items():
            text, _ = p.communicate(timeout=240)
            out[name] = (p.returncode, text)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
    out["alarms"] = sorted((tmp / "alarms-guarded").glob("*.json"))
    return out


pytestmark = pytest.mark.timeout(300)


@pytest.mark.slow
@pytest.mark.parametrize("name", CASES)
def test_torchrun_job_exits_with_the_workers_verdict(results, name):
    code, text = results[name]
    assert code == CASES[name][1], text[-3000:]
    if code:
        assert f"exit {code}" in text


@pytest.mark.slow
def test_a_verdict_recorded_before_a_teardown_abort_survives(results):
    code, text = results["guarded"]
    assert code == 75, text[-3000:]
    # torchrun saw the abort first (the other workers' codes follow when it waited for them)
    assert "worker exit codes [-6" in text, text[-3000:]


@pytest.mark.slow
def test_a_guarded_hardware_error_drops_an_alarm_for_its_own_node(results):
    (f,) = results["alarms"]
    rec = AlarmRecord.from_dict(json.loads(f.read_text()))
    assert (rec.check, rec.settled, rec.node, rec.suspect_ranks) == (
        "hardware_error", False, "node-guarded", ())
    assert [n.node for n in rec.suspect_nodes] == ["node-guarded"]
    assert "uncorrectable ECC" in rec.evidence["message"] and rec.evidence["rank"] == 1


@pytest.mark.slow
def test_any_command_passes_its_code_through(results):
    code, text = results["child"]
    assert code == 77, text


def test_priority_and_signals_in_the_pure_combination():
    assert combine([1, -15, -15], [75]) == 75
    assert combine([76, 77]) == 77
    assert combine([-6, 0]) == 134  # SIGABRT as a shell reports it
    assert combine([], [], 0) == 0
    assert is_torchrun(["torchrun", "x.py"]) == ["x.py"]
    assert is_torchrun([sys.executable, "-m", "torch.distributed.run", "-h"]) == ["-h"]
    assert is_torchrun(["python", "train.py"]) is None


def test_the_training_job_runs_torchrun_under_the_launcher_and_matches_its_codes():
    import yaml

    job = yaml.safe_load((ROOT / "examples" / "training-job.yaml").read_text())
    c = job["spec"]["template"]["spec"]["containers"][0]
    cmd = c["command"]
    assert cmd[:3] == ["screener", "launch", "--"] and is_torchrun(cmd[3:]) is not None
    rules = {r["action"]: r["onExitCodes"]["values"] for r in job["spec"]["podFailurePolicy"]["rules"]
             if "onExitCodes" in r and r["onExitCodes"]["containerName"] == c["name"]}
    assert 75 in rules["FailJob"] and rules["Ignore"] == [77]
    inits = [i["name"] for i in job["spec"]["template"]["spec"].get("initContainers", [])]
    assert all(r["onExitCodes"]["containerName"] in [c["name"], *inits]
               for r in job["spec"]["podFailurePolicy"]["rules"] if "onExitCodes" in r)
