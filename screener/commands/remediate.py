"""`screener hyperpod check|reboot|replace`, `screener correlate` and `screener plan`.

The steps after a node is quarantined: corroborate with the GPU's telemetry, run the provider's deep
health check, replace the node after review, and plan checkpoints so a job loses little when it
happens. The SageMaker client, the store, the Prometheus client, the clocks and sleep come from the
AppContext (screener.commands.context), which is how tests give a Stubber-wrapped client.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable, Sequence
from typing import Any, Optional

import click

from screener.commands._params import MAX_DAYS, Duration, FiniteFloat, positive
from screener.commands.context import AppContext, pass_app
from screener.commands.options import store_options
from screener.settings.stores import StoreChoice
from screener.errors import BadInputError
from screener.types import ExitCode, NodeState

log = logging.getLogger(__name__)



# --- shared plumbing ------------------------------------------------------------------------------

def _emit(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, sort_keys=True, default=str))


def _aws_options(f: Callable[..., Any]) -> Callable[..., Any]:
    f = click.option("--endpoint-url", default=None, envvar="SCREENER_SAGEMAKER_ENDPOINT",
                     help="SageMaker API endpoint (e.g. a VPC endpoint); default: the region's.")(f)
    f = click.option("--profile", default=None, help="AWS profile to use.")(f)
    f = click.option("--region", default=None, help="AWS region (default: from the AWS configuration).")(f)
    f = click.option("--cluster", envvar="SCREENER_HYPERPOD_CLUSTER", default="",
                     help="HyperPod cluster name or ARN [env SCREENER_HYPERPOD_CLUSTER].")(f)
    return f


def _client(app: AppContext, region: Optional[str], profile: Optional[str],
            endpoint_url: Optional[str]) -> Any:
    return app.sagemaker(region, profile=profile, endpoint_url=endpoint_url)


def _store_name(store: Any, node: Any) -> tuple[str, Optional[NodeState]]:
    """The name under which the store knows a HyperPod node, and its state there.

    The store is keyed by Kubernetes node name; a person may have typed the instance ID or the
    hostname instead, so try each form of the name.
    """
    candidates = [node.node, f"hyperpod-{node.instance_id}", node.instance_id, node.hostname]
    for name in dict.fromkeys(c for c in candidates if c):
        state = store.get_state(name)
        if state is not None:
            return name, state
    return node.node, None


# --- screener hyperpod ----------------------------------------------------------------------------

@click.group("hyperpod")
def hyperpod_group() -> None:
    """SageMaker HyperPod remediation: deep health check, reboot and replace of nodes.

    NODE is a Kubernetes node name (hyperpod-i-...), a providerID (aws:///<zone>/i-...), an
    instance ID (i-...) or a private DNS hostname (ip-...). Anything else is not a HyperPod
    instance (exit 2). Needs the IAM actions sagemaker:DescribeClusterNode, sagemaker:ListClusterNodes
    and, per command, sagemaker:StartClusterHealthCheck, sagemaker:BatchRebootClusterNodes or
    sagemaker:BatchReplaceClusterNodes. Throttled calls are retried with backoff.
    """


@hyperpod_group.command("check")
@click.argument("nodes", nargs=-1, required=True, metavar="NODE...")
@_aws_options
@click.option("--checks", default="InstanceStress,InstanceConnectivity", show_default=True,
              help="Comma-separated deep health checks: InstanceStress, InstanceConnectivity, "
                   "MultiNodeTrainingValidation.")
@click.option("--wait", is_flag=True, help="Poll until the check ends on every node and report.")
@click.option("--poll", "poll_s", type=FiniteFloat(1.0, 3600.0), default=30.0, show_default=True,
              help="Seconds between polls with --wait.")
@click.option("--timeout", "timeout_s", type=FiniteFloat(1.0, 7 * 86400.0), default=4 * 3600.0,
              show_default=True, help="Give up waiting after this many seconds (exit 3).")
@click.option("--dry-run", is_flag=True, help="Print the request without starting the check.")
@click.option("--record", is_flag=True,
              help="With --wait, record the result of a quarantined node in its lifecycle "
                   "(passed: burnin; failed: repair).")
@store_options(create=True)
@click.option("--json", "as_json", is_flag=True, help="Print JSON results on stdout.")
@pass_app
def check_cmd(app: AppContext, nodes: tuple[str, ...], cluster: str, region: Optional[str],
              profile: Optional[str], endpoint_url: Optional[str], checks: str, wait: bool,
              poll_s: float, timeout_s: float, dry_run: bool, record: bool,
              store_choice: StoreChoice, as_json: bool) -> None:
    """Start a SageMaker HyperPod deep health check on NODE... (grouped by instance group).

    While it runs HyperPod keeps the nodes out of scheduling; nodes that fail are rebooted or
    replaced by HyperPod's automatic node recovery if the cluster has it on. With --wait: exit 0
    when every node passed, 75 when any failed, 3 when any did not finish in time. A passing deep
    health check is triage, not proof: it never clears a node (only a known-answer screen does).
    """
    from screener.remediation import hyperpod

    if record and not wait:
        raise BadInputError("--record needs --wait (there is no result to record before the check ends)")
    check_list = [c.strip() for c in checks.split(",") if c.strip()]
    client = _client(app, region, profile, endpoint_url)
    resolved = hyperpod.resolve_nodes(client, cluster, list(nodes))
    started = hyperpod.start_health_check(client, resolved, check_list, dry_run=dry_run)
    out: dict[str, Any] = {"start": started.to_dict(), "results": []}
    if not as_json:
        verb = "would start" if dry_run else "started"
        click.echo(f"deep health check {','.join(check_list)} {verb} on cluster {started.cluster}:")
        for c in started.configurations:
            click.echo(f"  instance group {c['InstanceGroupName']}: {', '.join(c['InstanceIds'])}")
    code = ExitCode.PASS
    if wait and not dry_run:
        log.warning("waiting for the deep health check (poll every %gs, up to %gs)", poll_s, timeout_s)
        results = hyperpod.wait_for_health_check(client, resolved, poll_seconds=poll_s,
                                                 timeout_seconds=timeout_s, clock=app.monotonic,
                                                 sleep=app.sleep)
        out["results"] = [r.to_dict() for r in results]
        outcomes = {r.outcome for r in results}
        code = (ExitCode.HARDWARE_SUSPECT if "failed" in outcomes else
                ExitCode.INCONCLUSIVE if outcomes - {"passed"} else ExitCode.PASS)
        if record:
            out["recorded"] = _record_remediation(app, results, store_choice)
        if not as_json:
            for r in results:
                click.echo(f"  {r.node.node} ({r.node.instance_id}): {r.outcome}"
                           + (f" - {r.detail}" if r.detail else ""))
            for name, what in out.get("recorded", {}).items():
                click.echo(f"  {name}: {what}")
            if "passed" in outcomes:
                click.echo("a passed deep health check does not clear a node: only a passing "
                           "known-answer screen does")
    if as_json:
        _emit(out)
    sys.exit(int(code))


def _record_remediation(app: AppContext, results: Sequence[Any],
                        store_choice: StoreChoice) -> dict[str, str]:
    """Feed finished checks of quarantined nodes to the lifecycle and record its decision
    (apply_event: decided on the state it reads, recorded atomically)."""
    from screener.lifecycle.apply import apply_event
    from screener.lifecycle.machine import Remediation

    store = app.store(store_choice)
    now = app.clock()
    done: dict[str, str] = {}
    for r in results:
        if r.outcome not in ("passed", "failed"):
            continue
        name, state = _store_name(store, r.node)
        if state is None:
            done[name] = "unknown to screener: nothing recorded"
            continue
        event = Remediation(passed=r.outcome == "passed",
                            detail=f"SageMaker HyperPod deep health check {r.outcome}",
                            evidence={"hyperpod": r.to_dict()})
        decision = apply_event(store, name, event, now=now)
        last, after = decision.transition, decision.state
        done[name] = (f"{last.from_state.value if last.from_state else '(new)'} -> {after.value}"
                      if last is not None and after is not None else decision.note)
    return done


def _confirm_hint(yes: bool) -> str:
    return "" if yes else " (dry run: nothing was sent; add --yes to do it)"


@hyperpod_group.command("reboot")
@click.argument("nodes", nargs=-1, required=True, metavar="NODE...")
@_aws_options
@click.option("--yes", is_flag=True, help="Really reboot; without it, print what would happen.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON results on stdout.")
@pass_app
def reboot_cmd(app: AppContext, nodes: tuple[str, ...], cluster: str, region: Optional[str],
               profile: Optional[str], endpoint_url: Optional[str], yes: bool, as_json: bool) -> None:
    """Reboot NODE... through BatchRebootClusterNodes (a dry run unless --yes).

    Exit 0 when SageMaker accepted every node, 1 when it refused any (each refusal is listed).
    """
    from screener.remediation import hyperpod

    client = _client(app, region, profile, endpoint_url)
    resolved = hyperpod.resolve_nodes(client, cluster, list(nodes))
    result = hyperpod.reboot_nodes(client, resolved, dry_run=not yes)
    _report_batch(result, as_json, yes)
    sys.exit(int(ExitCode.SCREENER_ERROR if result.failed else ExitCode.PASS))


def _report_batch(result: Any, as_json: bool, yes: bool, extra: Optional[dict[str, Any]] = None) -> None:
    if as_json:
        _emit({**result.to_dict(), **(extra or {})})
        return
    verb = {"reboot": "reboot", "replace": "replace"}[result.action]
    click.echo(f"{'would ' if result.dry_run else ''}{verb} on cluster {result.cluster}"
               f"{_confirm_hint(yes)}:")
    for n in result.nodes:
        click.echo(f"  {n.node}: {n.instance_id} ({n.instance_group}, {n.instance_type}, {n.status})")
    for iid in result.successful:
        click.echo(f"  accepted: {iid}")
    for f in result.failed:
        click.echo(f"  refused: {f['NodeId']}: {f['ErrorCode']}: {f['Message']}")


@hyperpod_group.command("replace")
@click.argument("nodes", nargs=-1, required=True, metavar="NODE...")
@_aws_options
@click.option("--yes", is_flag=True, help="Really replace; without it, print what would happen.")
@click.option("--reason", default="", help="Why, for the node's history (default: a generic line).")
@click.option("--config", "config_path", type=click.Path(dir_okay=False, path_type=str),
              help="The daemon's config file, whose [lifecycle] quarantine budget caps how many "
                   "nodes are replaced at once (default $SCREENER_CONFIG; else the default "
                   "budget).")
@store_options(create=True)
@click.option("--json", "as_json", is_flag=True, help="Print JSON results on stdout.")
@pass_app
def replace_cmd(app: AppContext, nodes: tuple[str, ...], cluster: str, region: Optional[str],
                profile: Optional[str], endpoint_url: Optional[str], yes: bool, reason: str,
                config_path: Optional[str], store_choice: StoreChoice, as_json: bool) -> None:
    """Replace NODE... through BatchReplaceClusterNodes (a dry run unless --yes).

    Refuses (exit 2) a node that screener has not taken out of service (quarantined or repair), and
    more nodes at once than the quarantine budget allows. Each replaced node's history records the
    replacement and the node moves to repair. Replacement destroys the instance's root and
    secondary volumes: resume from a checkpoint on shared storage saved before the suspect window.
    Replacement is never automatic.
    """
    from screener.remediation import hyperpod
    from screener.lifecycle.apply import apply_event
    from screener.lifecycle.machine import Replaced
    from screener.settings.daemon import DaemonConfig

    # the budget the fleet's daemons keep (issue 37: this used the default 10 % whatever the
    # config said); read before any call, so a bad file is one line and nothing is asked
    policy = DaemonConfig.load(config_path, environ=app.environ).lifecycle
    client = _client(app, region, profile, endpoint_url)
    resolved = hyperpod.resolve_nodes(client, cluster, list(nodes))
    store = app.store(store_choice)
    names = {n.instance_id: _store_name(store, n) for n in resolved}
    budget = policy.budget_limit(len(store.all_states()))
    result = hyperpod.replace_nodes(client, resolved, state_of=lambda n: names[n.instance_id][1],
                                    budget=budget, dry_run=not yes)
    recorded: list[str] = []
    if not result.dry_run:
        now = app.clock()
        why = reason.strip() or "replaced after review"
        for n in resolved:
            if n.instance_id not in result.successful:
                continue
            name = names[n.instance_id][0]
            # A person's move to repair, decided on the state the store holds when it records
            # (the table's check, as for `node set`), not the one read before SageMaker's call.
            apply_event(store, name, Replaced(
                reason=f"{why}: SageMaker HyperPod BatchReplaceClusterNodes accepted instance "
                       f"{n.instance_id}",
                evidence={"hyperpod": {"action": "replace", **n.to_dict()}}), now=now,
                policy=policy)
            recorded.append(name)
    _report_batch(result, as_json, yes, {"budget": budget, "recorded": recorded})
    if not as_json:
        for name in recorded:
            click.echo(f"  history of {name}: replacement recorded, state repair")
    sys.exit(int(ExitCode.SCREENER_ERROR if result.failed else ExitCode.PASS))


# --- screener correlate ---------------------------------------------------------------------------

@click.command("correlate")
@click.argument("node")
@click.option("--prometheus", "url", required=True, envvar="SCREENER_PROMETHEUS_URL",
              help="Prometheus base URL holding dcgm-exporter metrics [env SCREENER_PROMETHEUS_URL].")
@click.option("--around", default="now", show_default=True,
              help="Time of the alarm: 'now', unix seconds or ISO 8601 (UTC if no zone).")
@click.option("--window", type=Duration(longest=30 * 86400.0), default="30m", show_default=True,
              help="How far before and after --around to look (e.g. 30m, 2h).")
@click.option("--match", "match", default=None, metavar="LABEL=VALUE",
              help="Select the node's series by this label instead of trying Hostname, node, "
                   "kubernetes_node and instance with the node name.")
@click.option("--header", "headers", multiple=True, metavar="NAME:VALUE",
              help="Extra HTTP header for Prometheus (e.g. Authorization); repeatable.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON results on stdout.")
@pass_app
def correlate_cmd(app: AppContext, node: str, url: str, around: str, window: float,
                  match: Optional[str], headers: tuple[str, ...], as_json: bool) -> None:
    """Correlate NODE's DCGM telemetry in Prometheus with an alarm: what changed around it.

    Reads Xid, ECC, row-remap, retired-page, NVLink/PCIe error counters, clock event (throttle)
    reasons, temperature, power and SM clock of each GPU. Exit 75 when a hardware counter
    corroborates a fault, 3 otherwise. It confirms, never clears: clean telemetry does not release
    a node, since silent data corruption raises no counter.
    """
    from screener.remediation import correlate as corr

    now = app.clock()
    t0 = corr.parse_time(around, now)
    half = window
    start, end = t0 - half, min(t0 + half, now)
    pair = None
    if match is not None:
        label, sep, value = match.partition("=")
        if not sep or not label.strip() or not value.strip():
            raise BadInputError(f"--match {match!r} is not LABEL=VALUE")
        pair = (label.strip(), value.strip())
    hdrs = {}
    for h in headers:
        name, sep, value = h.partition(":")
        if not sep or not name.strip():
            raise BadInputError(f"--header {h!r} is not NAME:VALUE")
        hdrs[name.strip()] = value.strip()
    client = app.prometheus(url, headers=hdrs)
    result = corr.correlate(client, node, start, end, match=pair)
    if as_json:
        _emit(result.to_dict())
    else:
        for line in corr.describe(result):
            click.echo(line)
    sys.exit(int(ExitCode.HARDWARE_SUSPECT if result.confirms else ExitCode.INCONCLUSIVE))


# --- screener plan --------------------------------------------------------------------------------

@click.command("plan")
@click.option("--checkpoint-minutes", type=positive(max=7 * 1440.0), required=True,
              help="Time to write one checkpoint, in minutes (the time training is blocked).")
@click.option("--mttf-hours", "job_mttf_hours", type=positive(max=1e6), default=None,
              help="The job's mean time between interruptions, in hours.")
@click.option("--node-mttf-hours", type=positive(max=1e8), default=None,
              help="Mean time between failures of one node, in hours (with --nodes).")
@click.option("--nodes", type=click.IntRange(1, 1_000_000), default=None,
              help="Nodes the job needs (with --node-mttf-hours or --history; default for "
                   "--history: every node in the store).")
@click.option("--history", is_flag=True,
              help="Measure the per-node failure rate from the store's own records.")
@click.option("--days", type=FiniteFloat(0.001, MAX_DAYS), default=30.0, show_default=True,
              help="How much history --history reads.")
@click.option("--restart-minutes", type=FiniteFloat(0.0, 7 * 1440.0), default=0.0,
              show_default=True, help="Time to detect, exclude, reschedule and reload after an "
                                      "interruption.")
@click.option("--interval-minutes", type=positive(max=1e6), default=None,
              help="Also evaluate this checkpoint interval (e.g. the one you use now).")
@store_options()
@click.option("--json", "as_json", is_flag=True, help="Print JSON results on stdout.")
@pass_app
def plan_cmd(app: AppContext, checkpoint_minutes: float, job_mttf_hours: Optional[float],
             node_mttf_hours: Optional[float], nodes: Optional[int], history: bool, days: float,
             restart_minutes: float, interval_minutes: Optional[float], store_choice: StoreChoice,
             as_json: bool) -> None:
    """Plan checkpoints: Young's interval sqrt(2*C*M) and the goodput it gives.

    Each interruption loses on average half an interval of work plus the restart time; each
    interval pays one checkpoint write. Give the job's MTTF as --mttf-hours, or a node's MTTF with
    --node-mttf-hours and --nodes (job MTTF = 1 / (nodes * per-node failure rate)), or --history to
    measure the failure rate from the store (failures of in-service nodes per node-hour).
    """
    from screener.lifecycle import recovery

    sources = sum(x for x in (job_mttf_hours is not None, node_mttf_hours is not None, history))
    if sources != 1:
        raise BadInputError("give exactly one of --mttf-hours, --node-mttf-hours (with --nodes) "
                            "or --history")
    source: dict[str, Any]
    if job_mttf_hours is not None:
        mttf_hours = job_mttf_hours
        source = {"kind": "given"}
        if mttf_hours <= 0:
            raise BadInputError(f"--mttf-hours {job_mttf_hours} must be > 0")
    elif node_mttf_hours is not None:
        if nodes is None:
            raise BadInputError("--node-mttf-hours needs --nodes")
        if node_mttf_hours <= 0:
            raise BadInputError(f"--node-mttf-hours {node_mttf_hours} must be > 0")
        mttf_hours = recovery.job_mttf_hours(nodes, 1.0 / node_mttf_hours)
        source = {"kind": "node_mttf", "node_mttf_hours": node_mttf_hours, "nodes": nodes}
    else:
        store = app.store(store_choice)
        now = app.clock()
        since = now - days * 86400.0
        states = store.all_states()
        first = {}
        for name in states:
            h = store.history(name)
            if h:
                first[name] = h[0].time
        rate = recovery.failure_rate(store.failures(since), now, days * 24.0, first_seen=first)
        n = nodes if nodes is not None else max(rate.nodes, 1)
        mttf_hours = recovery.job_mttf_hours(n, rate.per_node_hour)
        source = {"kind": "history", "nodes": n, **rate.to_dict()}
        # With no failure recorded the history gives only a lower bound on the MTTF (rule of
        # three: node-hours / 3). Over a short history that bound is minutes or less, and
        # Young's interval sqrt(2CM) from it is nonsense (a checkpoint every 0.6 min costing
        # "361.8% of wall time"): the model needs M > 2C, where the interval reaches M itself.
        if rate.upper_bound and mttf_hours * 60.0 <= 2.0 * checkpoint_minutes:
            click.echo(f"screener: plan --history: no failure recorded in "
                       f"{rate.node_hours:.3g} node-hours over {rate.nodes} node(s), so the "
                       f"history bounds the job's MTTF only from below, at "
                       f"{mttf_hours * 60.0:.3g} min: too short next to a "
                       f"{checkpoint_minutes:g} min checkpoint to plan from (needs over "
                       f"{2.0 * checkpoint_minutes:g} min); give --mttf-hours or "
                       "--node-mttf-hours, or plan again with more history", err=True)
            sys.exit(int(ExitCode.INCONCLUSIVE))
    p = recovery.plan(checkpoint_minutes, mttf_hours * 60.0, restart_minutes)
    out: dict[str, Any] = {**p.to_dict(), "mttf_hours": mttf_hours, "mttf_source": source}
    if interval_minutes is not None:
        out["given_interval"] = recovery.plan(checkpoint_minutes, mttf_hours * 60.0,
                                              restart_minutes, interval_minutes).to_dict()
    if as_json:
        _emit(out)
        sys.exit(int(ExitCode.PASS))
    if source["kind"] == "history":
        bound = " (upper bound: no failure recorded)" if source["upper_bound"] else ""
        click.echo(f"measured: {source['failures']} failure(s) in {source['node_hours']:.0f} "
                   f"node-hours over {source['nodes']} node(s), {source['per_node_hour']:.3g} per "
                   f"node-hour{bound}; job of {source['nodes'] if nodes is None else nodes} node(s)")
    # No failure seen: the MTTF is a lower bound, and the goodput at the interval planned from
    # it is one too (a longer true MTTF loses less per interruption).
    least = " at least" if source.get("upper_bound") else ""
    click.echo(f"job MTTF{least} {mttf_hours:.3g} h; checkpoint {checkpoint_minutes:g} min; "
               f"restart {restart_minutes:g} min"
               + ("" if restart_minutes else " (not given: assumed 0)"))
    click.echo(f"checkpoint every {p.interval_minutes:.1f} min (Young: sqrt(2 x "
               f"{checkpoint_minutes:g} x {p.mttf_minutes:.4g}))")
    click.echo(f"  each interruption loses {p.lost_per_interruption_minutes:.1f} min "
               f"({p.interruption_share:.1%} of wall time); checkpoints cost "
               f"{p.checkpoint_share:.1%}; goodput{least} {p.goodput:.1%}")
    if interval_minutes is not None:
        g = out["given_interval"]
        click.echo(f"at your interval of {interval_minutes:g} min: goodput {g['goodput']:.1%}")
    if checkpoint_minutes > 1.0:
        click.echo("  checkpoints take over a minute: asynchronous saves cut C and the interval")
    sys.exit(int(ExitCode.PASS))
