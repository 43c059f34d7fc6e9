"""The daemon's configuration: one frozen dataclass, from a TOML or JSON file and the environment.

Sources, later ones winning: the defaults below; the file named by --config or $SCREENER_CONFIG
(TOML when it ends in .toml, else JSON); then the environment. NODE_NAME and SCREENER_ALARM_DIR
are the names the rest of the project uses; every other scalar field can be set as
SCREENER_DAEMON_<FIELD> (e.g. SCREENER_DAEMON_SCREEN_INTERVAL_S=3600). An unknown key in the
file, or an unknown SCREENER_DAEMON_* variable, is an error: a typo must not silently leave a
default in force.

Nested tables are handed to their owners' own strict parsers: [probes] to
screener.settings.health.ProbeConfig, [lifecycle] to screener.settings.lifecycle.LifecyclePolicy, [hyperpod]
to screener.settings.hyperpod.HyperPodConfig (a module without boto3, so every table is validated at
load whether or not its feature is on; boto3 is imported only when a deep health check is on).
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping, Optional

from screener import boundedjson
from screener.settings import strict
from screener.errors import ConfigError
from screener.node_answer import SOCKET_NAME
from screener.settings.dra import DraConfig
from screener.settings.health import ProbeConfig
from screener.settings.hyperpod import HyperPodConfig
from screener.settings.ladder import LadderConfig
from screener.settings.lifecycle import LifecyclePolicy
from screener.settings.stores import KubeTimeouts, resolve_store_kind
from screener.types import ALARM_DIR_ENV, DEFAULT_ALARM_DIR, NODE_NAME_ENV, node_name

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - python 3.10
    import tomli as tomllib

CONFIG_ENV = "SCREENER_CONFIG"
ENV_PREFIX = "SCREENER_DAEMON_"
STORE_CHOICES = ("auto", "local", "kube")
# enforce: taint, cordon and remediate as the lifecycle says; observe: everything else (probes,
# screens, alarms, the state label, verdicts, events, metrics, history), but no taint and no
# remediation, for a first rollout (issue 24.2).
MODE_ENFORCE, MODE_OBSERVE = "enforce", "observe"
MODE_CHOICES = (MODE_ENFORCE, MODE_OBSERVE)


_STR_FIELDS = ("node", "alarm_dir", "store", "event_namespace", "own_pod", "metrics_host",
               "foreign_alarms", "health_socket", "nvrx_socket")
FOREIGN_CHOICES = ("reject", "leave")
_HOUR, _DAY = 3600.0, 86400.0
_YEAR = 365 * _DAY
# Every number's range: (low, high, low excluded, an integer). The upper bounds are far past any
# sensible setting; they keep every interval within what the loop's waits and the clock's
# arithmetic take (tick_s = 1e10 overflowed the loop's wait) and every count finite in time.
_NUMBERS: dict[str, tuple[float, float, bool, bool]] = {
    "tick_s": (0.0, _HOUR, True, False),
    "job_poll_s": (0.0, _HOUR, True, False),
    "untaint_retry_s": (0.0, 60.0, True, False),
    "probe_interval_s": (0.0, 7 * _DAY, True, False),
    "liveness_s": (0.0, 7 * _DAY, True, False),
    "screen_time_cap_s": (0.0, 7 * _DAY, True, False),
    "idle_window_s": (0.0, 30 * _DAY, False, False),
    "retry_inconclusive_s": (0.0, 30 * _DAY, False, False),
    "screen_interval_s": (0.0, _YEAR, False, False),
    "burnin_duration_s": (0.0, _YEAR, False, False),
    "adopt_min_age_s": (0.0, 10 * _YEAR, False, False),
    "adopt_created_before": (0.0, 1e10, False, False),  # a unix time (1e10: the year 2286)
    "idle_utilization_pct": (1, 100, False, True),
    "metrics_port": (-1, 65535, False, True),  # 0: any free port, -1: none
    "processed_keep": (0, 1_000_000, False, True),
    "rejected_keep": (0, 1_000_000, False, True),
    "aside_max_age_s": (0.0, 10 * _YEAR, True, False),
    "intake_pass_s": (0.0, _HOUR, True, False),
    "intake_pass_bytes": (1, 2**40, False, True),
    # a repeat is compared with the first, so at least 2
    "burnin_min_iterations": (2, 10_000, False, True),
    "quorum_nodes": (0, 10_000, False, True),
    "mtbi_days": (0.0, 3650.0, True, False),
}
_PATH_FIELDS = ("db", "kubeconfig", "spool", "jobs_dir", "golden_dir", "work_dir")  # None or a string


@dataclass(frozen=True)
class DaemonConfig:
    """Everything `screener daemon` needs to know; times in seconds.

    node: this node's name (NODE_NAME from the downward API; the hostname when unset).
    alarm_dir: where in-job checks drop alarm files (a hostPath shared with job pods).
    store: "local" (SQLite), "kube" (the Node objects) or "auto": kube when a kubeconfig is given
        (here or by $KUBECONFIG) or the daemon runs in a pod ($KUBERNETES_SERVICE_HOST), else
        local: a ~/.kube/config alone is no request to write to that cluster.
    db: the local store's SQLite file (default: the user's state directory).
    kubeconfig: a kubeconfig file for the kube store (default: in-cluster, then ~/.kube/config).
    spool: where the kube store keeps transitions it could not write yet.
    event_namespace: the namespace Node Events are created in.
    tick_s: how often the loop wakes (alarm intake runs on every tick).
    probe_interval_s: how often the health probes run (P).
    idle_window_s: how long the GPUs must have been idle before a screen may start (T).
    idle_utilization_pct: a GPU at or above this utilisation is busy.
    screen_interval_s: how often a healthy node is screened; burnin and suspect nodes at once.
    retry_inconclusive_s: after an inconclusive screen (a job landed, the time cap), wait this long
        before trying again.
    screen_time_cap_s: a screen taking longer is stopped and counts as inconclusive.
    job_poll_s: how often, during a screen, the daemon looks for a job landing on the node.
    untaint_retry_s: after a screen, the wait before another try at removing the screening taint
        when a try failed (five tries in all).
    jobs: known-answer job names to run (empty: all in jobs_dir).
    jobs_dir, golden_dir: where job specs and golden records live (None: the package defaults).
    devices: devices to screen (empty: every GPU, or the CPU without one).
    own_pod: the daemon's own pod name ($POD_NAME), never counted as a job on the node.
    metrics_host, metrics_port: the one HTTP port serving /metrics, /healthz and /readyz;
        port 0 picks a free port, -1 serves nothing.
    liveness_s: /healthz fails when the loop has not made progress for this long.
    health_socket: the Unix socket serving the node-local health answer (GET /node, the node's
        state and last verdict for launchers: screener.agent.health_answer); "" (the default)
        is health.sock in alarm_dir, which job pods already mount; "off" serves none. The HTTP
        port serves the same answer at /node.
    nvrx_socket: a second Unix socket answering NVRx's published node health check protocol
        (the nvhcd gRPC service: screener.agent.nvrx_health) for ft_launcher's
        --ft-node-health-check-endpoint; "" (the default) serves none. Needs screener[nvrx].
    processed_keep, rejected_keep: how many alarm files processed/ (applied) and rejected/ (bad or
        not for this node) keep, the oldest removed first; aside_max_age_s: files moved there
        longer ago than this go too.
    intake_pass_s, intake_pass_bytes: one intake pass stops after this much time or after reading
        this many bytes of alarm files (but always takes one file); the rest wait for the next
        tick, so a flood of files costs a bounded share of the loop.
    foreign_alarms: what the intake does with a file about another node, which can never apply
        here: "reject" moves it to rejected/ once; "leave" leaves it for the daemon of the node it
        names and never reads it again while it is unchanged (a folder several simulated nodes
        share, as in the fire drill).
    mode: "enforce" (the default) or "observe" ($SCREENER_DAEMON_MODE=observe): observe does
        everything enforce does but writes no taint (neither the state taint nor the screening
        one), never marks a node unschedulable and starts no remediation.
    screens: run idle-time known-answer screens at all (off: intake and probes only, as the fire
        drill and a probe-only deployment want).
    publish_digests: after a passing screen, publish its known-answer digests on the Node (kube)
        so burn-in of other nodes of the same platform can cross-check them.
    quorum_nodes: where a platform has no golden, how many other nodes of it must have reproduced
        the same result before it is the reference (screener.known_answer.verdict.quorum: a node
        that agrees passes, one that differs is suspect, the result is promoted to the platform's
        golden); 0 turns the fleet quorum off (no golden: inconclusive, as before).
    burnin_duration_s, burnin_min_iterations: a full burn-in (the only way a burnin node becomes
        healthy) keeps every job running this long, and at least this many times on every device.
    adopt: "auto" adopts a node with no state that already runs GPU pods, or whose Node object is
        at least adopt_min_age_s old (or older than adopt_created_before, a unix time, when set),
        as healthy-but-unscreened instead of putting it in burnin; "off" never adopts.
    mtbi_days: the window of the screener_node_incidents and screener_node_mtbi_seconds metrics
        (the mean time between the node's incidents in the last mtbi_days days; `node status
        --mtbi-days` has the same default).
    work_dir: where screen workers keep their folders (default: <state dir>/screens), so a
        restarted daemon can end what a killed one left running.
    probes, lifecycle, hyperpod: the nested tables (see the module docstring); ladder: the
        repair ladder for idle quarantined nodes (screener.settings.ladder.LadderConfig); dra:
        per-GPU DeviceTaintRules where the cluster uses DRA (screener.settings.dra.DraConfig;
        off by default, kube store only).
    """

    node: str = ""
    alarm_dir: str = DEFAULT_ALARM_DIR
    store: str = "auto"
    db: Optional[str] = None
    kubeconfig: Optional[str] = None
    spool: Optional[str] = None
    event_namespace: str = "default"
    tick_s: float = 5.0
    probe_interval_s: float = 60.0
    idle_window_s: float = 300.0
    idle_utilization_pct: int = 5
    screen_interval_s: float = 86400.0
    retry_inconclusive_s: float = 600.0
    screen_time_cap_s: float = 1800.0
    job_poll_s: float = 2.0
    untaint_retry_s: float = 1.0
    jobs: tuple[str, ...] = ()
    jobs_dir: Optional[str] = None
    golden_dir: Optional[str] = None
    devices: tuple[str, ...] = ()
    own_pod: str = ""
    metrics_host: str = "0.0.0.0"
    metrics_port: int = 9500
    liveness_s: float = 300.0
    health_socket: str = ""
    nvrx_socket: str = ""
    processed_keep: int = 1000
    rejected_keep: int = 1000
    aside_max_age_s: float = 14 * _DAY
    intake_pass_s: float = 2.0
    intake_pass_bytes: int = 16 * 2**20
    foreign_alarms: str = "reject"
    mode: str = MODE_ENFORCE
    screens: bool = True
    publish_digests: bool = True
    burnin_duration_s: float = 3600.0
    burnin_min_iterations: int = 2
    quorum_nodes: int = 3
    adopt: str = "auto"
    adopt_min_age_s: float = 3600.0
    adopt_created_before: float = 0.0
    work_dir: Optional[str] = None
    mtbi_days: float = 90.0
    probes: ProbeConfig = field(default_factory=ProbeConfig)
    lifecycle: LifecyclePolicy = field(default_factory=LifecyclePolicy)
    hyperpod: HyperPodConfig = field(default_factory=HyperPodConfig)
    ladder: LadderConfig = field(default_factory=LadderConfig)
    dra: DraConfig = field(default_factory=DraConfig)
    kube_timeouts: KubeTimeouts = field(default_factory=KubeTimeouts)

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> ConfigError:
            return ConfigError(f"daemon config {name}={getattr(self, name)!r}: {why}")

        for name in _STR_FIELDS:
            v = getattr(self, name)
            if not isinstance(v, str) or len(v) > 4096 or "\x00" in v:
                raise bad(name, "must be a string")
        for name in _PATH_FIELDS:
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v or "\x00" in v):
                raise bad(name, "must be a path (a non-empty string)")
        if self.store not in STORE_CHOICES:
            raise bad("store", f"must be one of {', '.join(STORE_CHOICES)}")
        if self.foreign_alarms not in FOREIGN_CHOICES:
            raise bad("foreign_alarms", f"must be one of {', '.join(FOREIGN_CHOICES)}")
        if self.mode not in MODE_CHOICES:
            raise bad("mode", f"must be one of {', '.join(MODE_CHOICES)}")
        if self.adopt not in ("auto", "off"):
            raise bad("adopt", "must be auto or off")
        for name, (low, high, low_open, integer) in _NUMBERS.items():
            strict.require_number("daemon", name, getattr(self, name), low, high,
                                   integer=integer, low_open=low_open,
                                   unit="days" if name == "mtbi_days" else
                                   "" if integer or name == "adopt_created_before"
                                   else "seconds")
        for name in ("jobs", "devices"):
            v = getattr(self, name)
            if not isinstance(v, (list, tuple)) or not all(isinstance(x, str) and x for x in v):
                raise bad(name, "must be a list of names")
            object.__setattr__(self, name, tuple(v))
        for name in ("publish_digests", "screens"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "must be true or false")
        if not isinstance(self.hyperpod, HyperPodConfig):
            raise bad("hyperpod", "must be a table")
        if not isinstance(self.ladder, LadderConfig):
            raise bad("ladder", "must be a table")
        if not isinstance(self.dra, DraConfig):
            raise bad("dra", "must be a table (enabled, driver, taint_key)")
        if not isinstance(self.kube_timeouts, KubeTimeouts):
            raise bad("kube_timeouts", "must be a table (connect_s, read_s, call_s, "
                                       "unreachable_s, stop_s)")
        if not self.alarm_dir:
            raise bad("alarm_dir", "must be a directory")
        for name in ("health_socket", "nvrx_socket"):
            if getattr(self, name) not in ("", "off") and not os.path.isabs(getattr(self, name)):
                raise bad(name, 'must be an absolute path, "" or "off"')
        if not self.metrics_host or any(c.isspace() for c in self.metrics_host):
            raise bad("metrics_host", "must be an address to bind (the pod IP in a cluster)")

    # --- building -------------------------------------------------------------------------------

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], *,
                     source: Optional[str] = None) -> "DaemonConfig":
        """Build from a parsed file; unknown keys (also in [probes] and [lifecycle]) are an error.
        `source`, the file the table came from, starts every error message when given."""
        try:
            values = dict(data) if isinstance(data, Mapping) else data
            if isinstance(values, dict):
                if "probes" in values and not isinstance(values["probes"], ProbeConfig):
                    values["probes"] = ProbeConfig.from_mapping(values["probes"])
                if "lifecycle" in values and not isinstance(values["lifecycle"], LifecyclePolicy):
                    values["lifecycle"] = LifecyclePolicy.from_mapping(values["lifecycle"])
                # Validated now, whether or not the feature is on: a misspelt key is an error.
                if isinstance(values.get("hyperpod"), Mapping):
                    values["hyperpod"] = HyperPodConfig.from_mapping(values["hyperpod"])
                if isinstance(values.get("ladder"), Mapping):
                    values["ladder"] = LadderConfig.from_mapping(values["ladder"])
                if isinstance(values.get("dra"), Mapping):
                    values["dra"] = DraConfig.from_mapping(values["dra"])
                if isinstance(values.get("kube_timeouts"), Mapping):
                    values["kube_timeouts"] = KubeTimeouts.from_mapping(values["kube_timeouts"])
            return strict.from_mapping(cls, values, "daemon")
        except ConfigError as e:
            if source is None:
                raise
            raise ConfigError(f"{source}: {e}") from None

    @classmethod
    def load(cls, path: Optional[str | os.PathLike[str]] = None,
             environ: Optional[Mapping[str, str]] = None,
             overrides: Optional[Mapping[str, Any]] = None) -> "DaemonConfig":
        """Defaults, then the file (path, else $SCREENER_CONFIG), then the environment, then
        `overrides` (command-line options)."""
        env = os.environ if environ is None else environ
        data: dict[str, Any] = {}
        path = path or env.get(CONFIG_ENV) or None
        source = None
        if path:
            data = read_file(path)
            source = str(path)
        data.update(env_values(env))
        data.update({k: v for k, v in (overrides or {}).items() if v is not None})
        if not data.get("node"):
            data["node"] = node_name(env)
        return cls.from_mapping(data, source=source)

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["probes"] = self.probes.to_dict()
        d["lifecycle"] = dataclasses.asdict(self.lifecycle)
        d["hyperpod"] = dataclasses.asdict(self.hyperpod)
        d["hyperpod"]["checks"] = list(self.hyperpod.checks)
        d["ladder"] = dataclasses.asdict(self.ladder)
        d["ladder"]["reboot_command"] = list(self.ladder.reboot_command)
        d["dra"] = dataclasses.asdict(self.dra)
        d["kube_timeouts"] = dataclasses.asdict(self.kube_timeouts)
        d["jobs"], d["devices"] = list(self.jobs), list(self.devices)
        return d

    def health_socket_path(self) -> Optional[str]:
        """Where the health answer's socket is (None: off); see the class docstring."""
        if self.health_socket == "off":
            return None
        return self.health_socket or str(Path(self.alarm_dir) / SOCKET_NAME)

    def resolved_store(self, environ: Optional[Mapping[str, str]] = None) -> str:
        """"local" or "kube": what "auto" means here (see the class docstring). The daemon
        writes node states, so outside a pod a ~/.kube/config alone does not make it the
        cluster's (screener.settings.stores)."""
        return resolve_store_kind(self.store, self.kubeconfig, environ, writes=True)


MAX_CONFIG_BYTES = 1024 * 1024


def read_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Parse a TOML (*.toml) or JSON config file; bad syntax is a ConfigError naming the file.

    The file must be a regular file under MAX_CONFIG_BYTES; JSON is parsed within the bounds of
    screener.boundedjson (no NaN, no infinity, no huge integer, bounded nesting), TOML with the
    same nesting bound.
    """
    p = Path(path)
    try:
        raw = boundedjson.read_regular(p, MAX_CONFIG_BYTES)
    except OSError as e:
        raise ConfigError(f"{p}: cannot read the config file: {e.strerror or e}") from e
    except ValueError as e:
        raise ConfigError(f"{p}: cannot read the config file: {e}") from None
    kind = "TOML" if p.suffix == ".toml" else "JSON"
    try:
        if kind == "TOML":
            data = tomllib.loads(raw.decode())
            if boundedjson.depth(data) > boundedjson.MAX_DEPTH:
                raise ValueError(f"nested deeper than {boundedjson.MAX_DEPTH} levels")
        else:
            data = boundedjson.loads(raw, max_bytes=MAX_CONFIG_BYTES)
    except RecursionError:
        raise ConfigError(f"{p}: not valid {kind}: nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as e:  # TOMLDecodeError and JSONDecodeError are ValueErrors
        raise ConfigError(f"{p}: not valid {kind}: {str(e).splitlines()[0] if str(e) else e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: the config must be a table/object at the top level")
    return data


_SCALAR_FIELDS = {f.name: f for f in fields(DaemonConfig) if f.name not in ("probes", "lifecycle",
                                                                           "hyperpod", "ladder",
                                                                           "dra")}


def _default_of(f: "dataclasses.Field[Any]") -> Any:
    """A dataclass field's default value (its default, or a fresh one from its factory)."""
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    raise TypeError(f"DaemonConfig.{f.name} has no default")


def _parse_env(name: str, text: str, default: Any) -> Any:
    if isinstance(default, bool):
        low = text.strip().lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"${name}={text!r}: expected true or false")
    if isinstance(default, tuple):
        return tuple(x.strip() for x in text.split(",") if x.strip())
    if isinstance(default, int):
        try:
            return int(text)
        except ValueError:
            raise ConfigError(f"${name}={text!r}: expected an integer") from None
    if isinstance(default, float):
        try:
            value = float(text)
        except ValueError:
            raise ConfigError(f"${name}={text!r}: expected a number") from None
        if not math.isfinite(value):
            raise ConfigError(f"${name}={text!r}: expected a finite number")
        return value
    return text or None if default is None else text


def env_values(env: Mapping[str, str]) -> dict[str, Any]:
    """The settings the environment gives (see the module docstring)."""
    out: dict[str, Any] = {}
    if env.get(NODE_NAME_ENV, "").strip():  # blank: left to load(), which falls back to node_name()
        out["node"] = env[NODE_NAME_ENV].strip()
    if env.get(ALARM_DIR_ENV):
        out["alarm_dir"] = env[ALARM_DIR_ENV]
    if env.get("POD_NAME"):
        out["own_pod"] = env["POD_NAME"]
    defaults = DaemonConfig.__dataclass_fields__
    for name, text in env.items():
        if not name.startswith(ENV_PREFIX):
            continue
        key = name[len(ENV_PREFIX):].lower()
        if key not in _SCALAR_FIELDS:
            raise ConfigError(f"${name}: unknown setting {key!r}; known: "
                              f"{', '.join(sorted(_SCALAR_FIELDS))}")
        f = defaults[key]
        out[key] = _parse_env(name, text, _default_of(f))
    return out
