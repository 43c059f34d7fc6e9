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
    from screener.known_answer.engine.fault_spec import parse_fault

    out: dict[str, list[Any]] = {}
    for text in specs:
        device, fault = parse_fault(text)
        for d in ([device] if device else devices):
            out.setdefault(d, []).append(fault)
    return out


def unfired_warnings(result: Any, given: Sequence[str] = ()) -> list[str]:
    """One line per device whose injected faults never fired, each fault as the --inject that
    asked for it was written (`given`): a field left at its default (step=0 of an op fault) was
    never given, and naming it sends the reader after a setting that is not there. A fault no
    given text matches (a drill's) shows its non-default fields."""
    from screener.known_answer.engine.fault_spec import DeviceFault, parse_fault

    if result is None:
        return []
    asked = []
    for text in given:
        device, fault = parse_fault(text)
        shown = ",".join(p.strip() for p in text.split(",")
                         if p.strip() and p.partition("=")[0].strip() != "device")
        asked.append((device, fault.to_dict(), shown))
    defaults = DeviceFault(op="-").to_dict()
    out = []
    for device, faults in result.unfired_faults.items():
        names = []
        for f in faults:
            match = next((t for d, fd, t in asked if d in (None, device) and fd == f), None)
            names.append(match if match is not None else ",".join(
                f"{k}={v}" for k, v in f.items() if v is not None and v != defaults.get(k)))
        out.append(f"{device}: {len(faults)} injected fault(s) never fired (the job never "
                   f"reached them): {'; '.join(names)}")
    return out


def unfired_exit(result: Any, code: int, given: Sequence[str] = ()) -> int:
    """Warn about injected faults that never fired; such a run exits 2 (usage), since it did
    not test what it was asked to."""
    lines = unfired_warnings(result, given)
    for line in lines:
        click.echo(f"screener: warning: {line}", err=True)
    return int(ExitCode.USAGE) if lines else code


def echo_json(obj: Any) -> None:
    """A command's JSON result on stdout, indented."""
    click.echo(json.dumps(obj, indent=2, default=str))
