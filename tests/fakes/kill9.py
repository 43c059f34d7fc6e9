"""The kill -9 campaign (issue 36.7): `screener daemon --once` killed at random moments of a
quarantine, restarted, and every node's transition checked whole or absent, never half, never
twice. Shared by tests/test_intent_journal.py (the CI slice) and benchmarks/bench_kill9.py.

The API server is the Kubernetes API test server (tests/fakes/kubeapi.py) with a tap on its writes
(`TappedAPI`): each write is applied and then its answer held for a random moment, and the
campaign kills the child while the k-th write of its pass is held (k at random: the write is
in, the child never learns it), or at a random time after the child started (before its first
write, between two, during the start-up). Each child is a real process running the real
console entry point (`screener daemon --once` through a fork server, tests/fakes/forkserver.py,
or spawned afresh with `python -m screener.cli`), killed with SIGKILL. After one or more kills
(a restart may be killed too, while it finishes the transition) a clean restart runs the pass to
its end, and the node is audited: label, taint, condition, history entry, Event and budget slot
all present and consistent (whole), or none of them (none); anything else is a half transition,
and a second Event, history entry or slot is a double.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from fakes.kubeapi import KubeAPI
from screener.audit.alarms import write_alarm_file
from screener.stores.kube import formats as kf
from screener.alarmfile import AlarmRecord
from screener.settings.lifecycle import DEFAULT_POLICY
from screener.types import (CONDITION_TYPE, LABEL_STATE, TAINT_STATE_KEY,
                            SuspectNode)

NAMESPACE = "screener-system"
ROOT = Path(__file__).resolve().parents[2]
ARGV = ["daemon", "--once", "--json"]


class TappedAPI(KubeAPI):
    """The test server, each write's answer held `hold` seconds (a random pick from the range)
    after it was applied; `on_write(n)` is told the write's number since the last reset()."""

    def __init__(self, *args: Any, hold: tuple[float, float] = (0.02, 0.12),
                 seed: int = 0, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.hold = hold
        self.writes = 0
        self.on_write: Optional[Callable[[int], None]] = None
        self._rng = random.Random(seed)
        self._tap = threading.Lock()

    def start(self) -> "TappedAPI":
        super().start()
        # A killed child's socket is gone when its held answer goes out: not worth a traceback.
        assert self._server is not None
        self._server.handle_error = lambda request, client_address: None  # type: ignore[method-assign]
        return self

    tapped = True  # kills can be timed to a write (a real server's campaign kills at random)

    def reset(self, on_write: Optional[Callable[[int], None]] = None) -> None:
        with self._tap:
            self.writes, self.on_write = 0, on_write

    def child_env(self, node: str, home: Path) -> dict[str, str]:
        """What a child needs besides the campaign's own settings (nothing, here)."""
        return {}

    def handle(self, method: str, path: str, query: dict[str, list[str]], headers: Any,
               body: bytes) -> Any:
        out = super().handle(method, path, query, headers, body)
        if method in ("POST", "PUT", "PATCH", "DELETE"):
            with self._tap:
                self.writes += 1
                n, hook = self.writes, self.on_write
                hold = self._rng.uniform(*self.hold)
            if hook is not None:
                hook(n)
            time.sleep(hold)
        return out


@dataclass
class Audit:
    """What a node carries of its quarantine."""

    label: Optional[str]
    taint: bool
    condition: Optional[str]
    entries: int  # history entries of the move to quarantined
    events: int  # Events of it
    slots: int  # budget slots naming the node

    @property
    def whole(self) -> bool:
        return (self.label == "quarantined" and self.taint and self.condition == "True"
                and self.entries == 1 and self.events == 1 and self.slots == 1)

    @property
    def none(self) -> bool:
        return (self.label == "healthy" and not self.taint and self.condition != "True"
                and self.entries == 0 and self.events == 0 and self.slots == 0)

    @property
    def double(self) -> bool:
        return self.entries > 1 or self.events > 1 or self.slots > 1


def audit(api: Any, node: str) -> Audit:
    """`api`: a TappedAPI, or a real server's view of the same (benchmarks/realserver.py)."""
    obj = api.node(node)
    taints = (obj.get("spec") or {}).get("taints") or []
    cond = next((c for c in (obj.get("status") or {}).get("conditions") or []
                 if c.get("type") == CONDITION_TYPE), None)
    cm = api.configmap(NAMESPACE, kf.history_configmap_name(node))
    entries = [e for e in kf.history_entries(cm) if e.get("to") == "quarantined"]
    if isinstance(api, KubeAPI):  # the test server: its own tables
        with api._lock:
            events = sum(1 for e in api.events
                         if (e.get("involvedObject") or {}).get("name") == node
                         and e.get("reason") == "RingReplayMismatch")
            slots = sum(1 for (ns, name), cm in api.configmaps.items()
                        if ns == NAMESPACE and name.startswith(kf.SLOT_PREFIX)
                        and (cm.get("data") or {}).get("node") == node)
    else:
        events = api.events_about(node, "RingReplayMismatch")
        slots = api.slots_naming(NAMESPACE, node)
    return Audit(label=(obj["metadata"].get("labels") or {}).get(LABEL_STATE),
                 taint=any(t.get("key") == TAINT_STATE_KEY and t.get("value") == "quarantined"
                           for t in taints),
                 condition=cond.get("status") if cond else None, entries=len(entries),
                 events=events, slots=slots)


class CampaignTooLong(Exception):
    """The campaign would take more nodes out than the budget allows."""


@dataclass
class Figures:
    """What a campaign did and found."""

    kills: int = 0
    missed: int = 0  # children that ended before their kill came
    nodes: int = 0
    half: int = 0  # half transitions after the restart
    doubles: int = 0
    half_after_kill: int = 0  # kills that left a half transition (for the restart to finish)
    uncovered: int = 0  # of those, with no intent on file: nothing would have finished them
    restart_status: dict[int, int] = field(default_factory=dict)
    bad: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"kills": self.kills, "missed": self.missed, "nodes": self.nodes,
                "half_transitions": self.half, "doubles": self.doubles,
                "half_after_kill": self.half_after_kill, "uncovered": self.uncovered,
                "restart_exit_codes": {str(k): v for k, v in sorted(self.restart_status.items())},
                "bad": self.bad[:10], "seconds": round(self.seconds, 1)}


class Spawner:
    """Children through the fork server (fast) or as fresh interpreters (the whole start-up)."""

    def __init__(self, fresh: bool = False) -> None:
        self.fresh = fresh
        self.server: Any = None
        self.proc: Optional[subprocess.Popen[bytes]] = None

    def __enter__(self) -> "Spawner":
        if not self.fresh:
            from fakes.forkserver import ForkServer

            self.server = ForkServer().start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.server is not None:
            self.server.stop()

    def spawn(self, env: dict[str, str], out: Path, err: Path) -> int:
        if self.server is not None:
            return int(self.server.spawn(ARGV, env, out, err))
        with open(out, "wb") as o, open(err, "wb") as e:
            self.proc = subprocess.Popen([sys.executable, "-m", "screener.cli", *ARGV], env=env,
                                         cwd=ROOT, stdout=o, stderr=e)
        return self.proc.pid

    def wait(self, timeout: float = 120.0) -> int:
        if self.server is not None:
            return int(self.server.wait())
        assert self.proc is not None
        return int(self.proc.wait(timeout=timeout))


def _running(pid: int) -> bool:
    """Whether the child is still at work (not ended: a zombie waits for the fork server)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


class Campaign:
    """Quarantines on fresh nodes of a fleet of `fleet` healthy ones, each killed `kills_per`
    (1 to that many, at random) times, then restarted cleanly and audited."""

    def __init__(self, api: Any, tmp: Path, *, seed: int, fleet: int = 400,
                 writes: int = 5) -> None:
        """api: a TappedAPI, or benchmarks/realserver.py's RealTarget (whose budget record is
        the server's already)."""
        self.api, self.tmp, self.rng = api, tmp, random.Random(seed)
        self.writes = writes  # a quarantine's writes: slot, Node, history, condition, Event
        self.kubeconfig = api.write_kubeconfig(tmp / "kubeconfig")
        for i in range(fleet):
            api.add_node(f"fleet-{i:05d}", labels={LABEL_STATE: "healthy"})
        # The budget counted already (a campaign's nodes are not its first ones).
        if api.tapped:
            import kubernetes.client

            with api.api_client() as client:
                kubernetes.client.CoreV1Api(client).create_namespaced_config_map(
                    NAMESPACE, kf.BudgetRecord(fleet=fleet, counted=time.time())
                    .configmap(NAMESPACE))
        # Each node keeps its quarantine, so a campaign gets as many as the budget holds; past it
        # a node is held in suspect by design, which an audit must not read as a half transition.
        record = api.configmap(NAMESPACE, kf.BUDGET_CONFIGMAP)
        counted = kf.BudgetRecord.from_configmap(record).fleet if record else 0
        self.room = DEFAULT_POLICY.budget_limit(counted)
        self.figures = Figures()

    def env(self, node: str) -> dict[str, str]:
        home = self.tmp / node
        config = home / "daemon.json"
        if not config.exists():
            (home / "alarms").mkdir(parents=True)
            config.write_text(json.dumps({
                "store": "kube", "kubeconfig": str(self.kubeconfig), "screens": False,
                "metrics_port": -1, "spool": str(home / "state" / "spool.db"), "tick_s": 0.5,
                "probes": {"kmsg_path": None, "disk_paths": [str(home)],
                           "min_free_disk_fraction": 0, "min_free_memory_fraction": 0}}))
        env = {k: v for k, v in os.environ.items() if k != "KUBERNETES_SERVICE_HOST"}
        env.update(NODE_NAME=node, SCREENER_ALARM_DIR=str(home / "alarms"),
                   XDG_STATE_HOME=str(home / "xdg"), SCREENER_CONFIG=str(config),
                   POD_NAMESPACE=NAMESPACE, PYTHONPATH=str(ROOT))
        env.update(self.api.child_env(node, home))
        return env

    def intents_on_file(self, node: str) -> int:
        folder = self.tmp / node / "state" / "intents"
        return len(list(folder.glob("*.json"))) if folder.is_dir() else 0

    def kill_once(self, spawner: Spawner, node: str, *, restart: bool) -> bool:
        """One child killed at a random moment; True when the kill landed before it ended."""
        env = self.env(node)
        home = self.tmp / node
        fired = threading.Event()
        at_write = self.rng.random() < 0.75 and self.api.tapped
        target = self.rng.randint(1, 3 if restart else self.writes)
        self.api.reset(on_write=(lambda n: fired.set() if n == target else None)
                       if at_write else None)
        pid = spawner.spawn(env, home / "out.txt", home / "err.txt")
        if at_write:
            deadline = time.monotonic() + 60.0
            while not fired.wait(0.02) and _running(pid) and time.monotonic() < deadline:
                pass
            time.sleep(self.rng.uniform(0.0, self.api.hold[0]))
        else:
            # A fresh interpreter on a real server takes a second or two to its first request.
            time.sleep(self.rng.uniform(0.0, 0.8 if self.api.tapped else 3.0))
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        status = spawner.wait()
        self.api.reset()
        if status != -signal.SIGKILL:
            self.figures.missed += 1
            return False
        self.figures.kills += 1
        state = audit(self.api, node)
        if not state.whole and not state.none:
            self.figures.half_after_kill += 1
            if not self.intents_on_file(node):
                self.figures.uncovered += 1
                self.figures.bad.append(f"{node}: half after a kill, no intent: {state}")
        return True

    def node(self, spawner: Spawner, index: int, kills_per: int) -> None:
        node = f"k9-{index:04d}"
        self.api.add_node(node, labels={LABEL_STATE: "healthy"})
        env = self.env(node)
        write_alarm_file(AlarmRecord(
            alarm_id=f"alarm-{index}", check="ring_replay", step=3, settled=True,
            suspect_ranks=(0,), suspect_nodes=(SuspectNode(node, node),), node=node,
            job="train"), Path(env["SCREENER_ALARM_DIR"]))
        for k in range(self.rng.randint(1, kills_per)):
            self.kill_once(spawner, node, restart=k > 0)
        home = self.tmp / node
        spawner.spawn(env, home / "out.txt", home / "err.txt")
        status = spawner.wait()
        self.figures.restart_status[status] = self.figures.restart_status.get(status, 0) + 1
        self.figures.nodes += 1
        state = audit(self.api, node)
        left = list(Path(env["SCREENER_ALARM_DIR"]).glob("*.json"))
        if not state.whole or left or self.intents_on_file(node):
            self.figures.half += 0 if state.whole else 1
            self.figures.bad.append(f"{node}: after the restart (exit {status}): {state}, "
                                    f"{len(left)} alarm file(s) left, "
                                    f"{self.intents_on_file(node)} intent(s) on file; "
                                    f"{(home / 'err.txt').read_text()[-1500:]}")
        if state.double:
            self.figures.doubles += 1

    def run(self, kills: int, *, kills_per: int = 2, fresh: bool = False) -> Figures:
        if kills > self.room:
            raise CampaignTooLong(f"{kills} kills need at least {kills} quarantines; the budget "
                                  f"holds {self.room}: count the budget for more nodes")
        t0 = time.monotonic()
        with Spawner(fresh=fresh) as spawner:
            index = 0
            while self.figures.kills < kills:
                if index >= self.room:
                    raise CampaignTooLong(
                        f"the budget holds {self.room} quarantines and {self.figures.kills} of "
                        f"{kills} kills landed in them: count the budget for more nodes")
                self.node(spawner, index, kills_per)
                index += 1
        self.figures.seconds = time.monotonic() - t0
        return self.figures
