"""What `screener kat`, `screener golden` and `screener burnin` share: bounds, help texts, fault
parsing, the unfired-fault exit rule and JSON output.
"""

from __future__ import annotations

import json
from typing import Any, Sequence

import click

from screener.types import ExitCode

# Upper bounds of the counts (issue 23.6): far past any sensible run, and each keeps a run finite
# (`kat run --repeat 1.2e29` ran for ever). A burn-in's iterations match the daemon's
# burnin_min_iterations bound.
MAX_REPEAT = 1000
MAX_ITERATIONS = 10_000
DEVICE_HELP = "Device to screen: cpu, cuda:N or all (every GPU, or the CPU without one). Repeatable."
INJECT_HELP = ("Inject a fault in a device's child, to prove the screen catches it: "
               "'device=cuda:1,op=mm,call=2,element=7,bit=30' (keys: device, op, call, element, bit, "
               "mode=flip|scale|nan|inf|set, factor, value, output, persistent=true (every call from "
               "`call` on), parameter, step, job, iteration). Repeatable. A fault that never fires "
               "(a call past the job's last) is named on stderr and makes the exit code 2: a "
               "screen that tested nothing must not read as a pass.")


def parse_faults(specs: Sequence[str], devices: Sequence[str]) -> dict[str, list[Any]]:
    """--inject specs as device -> faults (a spec without a device applies to every device)."""
    from screener.known_answer.fault_spec import parse_fault

    out: dict[str, list[Any]] = {}
    for text in specs:
        device, fault = parse_fault(text)
        for d in ([device] if device else devices):
            out.setdefault(d, []).append(fault)
    return out


def unfired_exit(result: Any, code: int) -> int:
    """Warn about injected faults that never fired; such a run exits 2 (usage), since it did
    not test what it was asked to."""
    lines = result.warnings() if result is not None else []
    for line in lines:
        click.echo(f"screener: warning: {line}", err=True)
    return int(ExitCode.USAGE) if lines else code


def echo_json(obj: Any) -> None:
    """A command's JSON result on stdout, indented."""
    click.echo(json.dumps(obj, indent=2, default=str))
