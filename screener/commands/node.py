"""`screener node status|history|set` and `screener lemons`: read and steer the node lifecycle.

Thin: parse options, get the store from the AppContext (screener.commands.context), call the
lifecycle, print. Results go
to stdout (`--json` for machines), logs to stderr.
"""

from __future__ import annotations

import datetime as _dt
import getpass
import json
import sys
from typing import Any, Optional

import click

from screener.commands._params import MAX_DAYS, MAX_FAILURES, positive
from screener.commands.context import AppContext, pass_app
from screener.commands.options import with_store
from screener.types import ExitCode, NodeState, shown

def _when(ts: Optional[float]) -> str:
    if ts is None:
        return "-"
    return _dt.datetime.fromtimestamp(ts, tz=_dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%SZ")


def _emit(obj: Any) -> None:
    click.echo(json.dumps(obj, indent=2, sort_keys=True))  # ASCII: every other character escaped


def _say(line: str, *, err: bool = False) -> None:
    """One line for people: stored text (a reason, a job, a node name from an old record or a
    store another writer filled) printed with what is not printable escaped, so no record can
    reorder or break a line, or end the command in a UnicodeEncodeError (issue 36.6)."""
    click.echo(shown(line), err=err)


@click.group("node")
def node_group() -> None:
    """Show and steer node lifecycle states (burnin, healthy, suspect, quarantined, repair).

    Placement: jobs should require the node label screener.io/state In (healthy); every other
    state also carries the taint screener.io/state=<state>:NoSchedule.
    """


@node_group.command("status")
@click.argument("node", required=False)
@click.option("--json", "as_json", is_flag=True, help="Print JSON on stdout.")
@click.option("--mtbi-days", type=positive(max=MAX_DAYS), default=90.0, show_default=True,
              help="Window of MTBI: the mean time between a node's incidents (failure "
                   "transitions) in the last DAYS days; '-' with fewer than two.")
@click.option("--mtbi", "fleet_mtbi", is_flag=True,
              help="For the fleet, add the MTBI column (one more paginated read: every node's "
                   "history; a single NODE always shows it).")
@with_store
@pass_app
def status_cmd(app: AppContext, node: Optional[str], as_json: bool, mtbi_days: float,
               fleet_mtbi: bool, store: Any) -> int:
    """Show the state of NODE, or of every known node, with the last transition and the time
    between its incidents (MTBI).

    A node the store has never seen shows as 'unknown' (it starts in burnin when first screened).
    """
    from screener.lifecycle.incidents import format_mtbi, mtbi_by_node
    from screener.stores.common import last_screen

    since = app.clock() - mtbi_days * 86400
    if node:
        state = store.get_state(node)
        hist = store.history(node) if state is not None else []
        mtbi = mtbi_by_node(t for t in hist if t.failure and t.time >= since)
        last = hist[-1] if hist else None
        verdict = store.get_verdict(node)
        result = {"node": node, "state": state.value if state else None,
                  "since": last.time if last else None,
                  "last_transition": last.to_dict() if last else None, "verdict": verdict,
                  "incidents": mtbi.get(node, {}).get("incidents", 0),
                  "mtbi_s": mtbi.get(node, {}).get("mtbi_s"), "mtbi_days": mtbi_days}
        if as_json:
            _emit(result)
        else:
            _say(f"{node}: {state.value if state else 'unknown (never screened)'}")
            if last:
                _say(f"  since {_when(last.time)} ({_from_to(last)} by {last.actor})")
                _say(f"  reason: {last.reason}")
                if last.rollback:
                    _say(f"  rollback to: {_rollback_text(last.rollback)}")
                if last.actions:
                    _say(f"  actions: {', '.join(last.actions)}")
            _say(f"  incidents in {mtbi_days:g} days: {result['incidents']}, "
                 f"MTBI {format_mtbi(result['mtbi_s'])}")
            if verdict:
                _say(f"  last verdict: {verdict.get('outcome', '?')} "
                     f"{verdict.get('reason', '')}".rstrip()
                     + (f" ({_screen_text(last_screen(verdict))})"
                        if verdict.get("kind") == "partial" else ""))
                for m in (last_screen(verdict) or {}).get("missing", []):
                    _say(f"    missing for a full burn-in: {m}")
        return int(ExitCode.PASS)

    # One read of the fleet (SQLite: one query; Kubernetes: one paginated list of Node metadata,
    # whose summary annotation holds the last transition), not one read per node.
    rows = store.summaries()
    # The fleet's failures in the window, the lemon rule's own read: only when asked, since the
    # plain fleet view is one paginated list of Node metadata.
    mtbi = mtbi_by_node(store.failures(since)) if fleet_mtbi else {}
    for r in rows if fleet_mtbi else ():
        r["incidents"] = mtbi.get(r["node"], {}).get("incidents", 0)
        r["mtbi_s"] = mtbi.get(r["node"], {}).get("mtbi_s")
    if as_json:
        counts = {s.value: sum(1 for r in rows if r["state"] == s.value) for s in NodeState}
        _emit({"nodes": rows, "counts": counts})
    elif not rows:
        _say("no nodes known to this store", err=True)
    else:
        # Each column as wide as its header or its widest value (a name shorter than "NODE"
        # pushed every later column out of line).
        screens = [shown(_screen_text(r.get("last_screen"))) for r in rows]
        rows = [{**r, "node": shown(r["node"]), "state": shown(r["state"]),
                 "reason": shown(r["reason"])} for r in rows]  # widths as printed
        width = max([len("NODE")] + [len(r["node"]) for r in rows])
        swidth = max([len("LAST SCREEN")] + [len(t) for t in screens])
        head = f"{'MTBI':>8}  " if fleet_mtbi else ""
        _say(f"{'NODE':<{width}}  {'STATE':<11}  {'SINCE':<20}  {head}"
             f"{'LAST SCREEN':<{swidth}}  REASON")
        for r, screen in zip(rows, screens):
            column = f"{format_mtbi(r['mtbi_s']):>8}  " if fleet_mtbi else ""
            _say(f"{r['node']:<{width}}  {r['state']:<11}  {_when(r['since']):<20}  "
                 f"{column}{screen:<{swidth}}  {r['reason']}".rstrip())
    return int(ExitCode.PASS)


def _screen_text(screen: Any) -> str:
    """A node's last screen in a few words: `burnin partial: pass` (a burn-in short of a full
    one: the node stays in burnin), `burnin full: pass`, `kat: suspect`; '-' for none."""
    if not screen:
        return "-"
    what = " ".join(str(screen[k]) for k in ("screen", "kind") if screen.get(k)) or "screen"
    return f"{what}: {screen.get('outcome') or '?'}"


@node_group.command("history")
@click.argument("node")
@click.option("--days", type=positive(max=MAX_DAYS), default=None,
              help="Only transitions of the last DAYS days.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON on stdout.")
@with_store
@pass_app
def history_cmd(app: AppContext, node: str, days: Optional[float], as_json: bool,
                store: Any) -> int:
    """List NODE's transitions, oldest first: time, from, to, actor, reason, rollback hint."""
    since = app.clock() - days * 86400 if days else None
    hist = store.history(node, since=since)
    if as_json:
        _emit({"node": node, "transitions": [t.to_dict() for t in hist]})
        return int(ExitCode.PASS)
    if not hist:
        _say(f"{node}: no transitions recorded", err=True)
    for t in hist:
        line = f"{_when(t.time)}  {_from_to(t):<24} {t.actor:<8} {t.code or '-':<26} {t.reason}"
        if t.failure:
            line += "  [failure]"
        _say(line)
        if t.rollback and t.to_state in (NodeState.SUSPECT, NodeState.QUARANTINED, NodeState.REPAIR):
            _say(f"{'':20}  rollback to: {_rollback_text(t.rollback)}")
    return int(ExitCode.PASS)


@node_group.command("set")
@click.argument("node")
@click.argument("state", type=click.Choice([s.value for s in NodeState]))
@click.option("--reason", required=True, help="Why (recorded in the history and the Event).")
@click.option("--json", "as_json", is_flag=True, help="Print the recorded transition as JSON.")
@with_store(create=True)
@pass_app
def set_cmd(app: AppContext, node: str, state: str, reason: str, as_json: bool,
            store: Any) -> int:
    """Record a person's decision: move NODE to STATE (actor "human").

    The transition table still applies: a node becomes healthy only by passing a known-answer
    screen (set it to burnin to screen it), and repair is left only to burnin, for example after a
    GPU was replaced: screener node set gpu-7 burnin --reason "GPU 3 replaced, ticket 1234".
    """
    from screener.lifecycle.machine import HumanCommand
    from screener.lifecycle.apply import apply_event

    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = ""
    decision = apply_event(store, node, HumanCommand(NodeState(state), reason, user=user),
                           now=app.clock())
    t = decision.transition
    assert t is not None  # a HumanCommand either transitions or raises TransitionRefused
    if as_json:
        _emit(t.to_dict())
    else:
        _say(f"{node}: {_from_to(t)} ({t.reason})")
        if t.actions:
            _say(f"  next: {', '.join(t.actions)}")
    return int(ExitCode.PASS)


@click.command("lemons")
@click.option("--days", type=positive(max=MAX_DAYS), default=30.0, show_default=True,
              help="Window to count failures in.")
@click.option("--min-failures", type=click.IntRange(1, MAX_FAILURES), default=3, show_default=True,
              help="Failures within the window that make a lemon.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON on stdout.")
@with_store
@pass_app
def lemons_cmd(app: AppContext, days: float, min_failures: int, as_json: bool,
               store: Any) -> int:
    """List nodes, and GPUs by serial across nodes, with at least --min-failures confirmed failures
    in the last --days days: the repeat offenders that go to repair even when diagnostics pass."""
    from screener.lifecycle.records import lemon_counts

    failures = store.failures(app.clock() - days * 86400)
    by_node, by_serial = lemon_counts(failures)
    # One pass over the failures for the details too: linear in their number, not per lemon.
    last_failure: dict[str, float] = {}
    serial_nodes: dict[str, set[str]] = {}
    for t in failures:
        last_failure[t.node] = max(t.time, last_failure.get(t.node, t.time))
        for s in t.gpu_serials:
            serial_nodes.setdefault(s, set()).add(t.node)
    states = store.all_states() if any(c >= min_failures for c in by_node.values()) else {}
    nodes: list[dict[str, Any]] = [
        {"node": n, "failures": c, "state": states[n].value if n in states else None,
         "last_failure": last_failure[n]}
        for n, c in sorted(by_node.items(), key=lambda kv: (-kv[1], kv[0])) if c >= min_failures]
    gpus: list[dict[str, Any]] = [
        {"serial": s, "failures": c, "nodes": sorted(serial_nodes.get(s, ()))}
        for s, c in sorted(by_serial.items(), key=lambda kv: (-kv[1], kv[0])) if c >= min_failures]
    if as_json:
        _emit({"window_days": days, "min_failures": min_failures, "nodes": nodes, "gpus": gpus})
        return int(ExitCode.PASS)
    if not nodes and not gpus:
        _say(f"no node or GPU with {min_failures}+ failures in {days:g} days", err=True)
    for n in nodes:
        _say(f"node {n['node']}: {n['failures']} failures, now {n['state'] or 'unknown'}, "
             f"last {_when(n['last_failure'])}")
    for g in gpus:
        _say(f"gpu {g['serial']}: {g['failures']} failures on {', '.join(g['nodes'])}")
    return int(ExitCode.PASS)


def _from_to(t: Any) -> str:
    return f"{t.from_state.value if t.from_state else '(new)'} -> {t.to_state.value}"


def _rollback_text(rb: dict[str, Any]) -> str:
    parts = [_when(rb.get("time"))]
    if rb.get("step") is not None:
        parts.append(f"step {rb['step']}")
    if rb.get("job"):
        parts.append(f"job {rb['job']}")
    return ", ".join(parts)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(node_group())
