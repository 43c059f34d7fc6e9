"""Fault specs for a screening child: what the `--fault` option and the drills ask a device to get.

A DeviceFault is the parent's light description of a fault (no torch: the parent process of a
screen stays light); the child turns it into a screener.known_answer.engine.faults.FaultSpec, which
applies it. `parse_fault` reads the CLI's `key=value,...` form.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Optional

from screener.errors import BadInputError

FAULT_MODES = ("flip", "scale", "nan", "inf", "set")  # = screener.known_answer.engine.faults.MODES
_INT_KEYS = ("call", "element", "bit", "output", "step", "iteration")
_FLOAT_KEYS = ("factor", "value")
_STR_KEYS = ("op", "mode", "parameter", "job")
_BOOL_KEYS = ("persistent",)
_BOOLS = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}


@dataclass(frozen=True)
class DeviceFault:
    """A fault for one device's child: an op fault (FaultSpec fields) or a parameter flip.

    job / iteration restrict it to one job and one iteration (None: every one). An op fault uses
    op, call, element, bit, mode, factor, value, output (persistent: every call from `call` on);
    a parameter fault (train jobs) sets
    `parameter`, `step`, `element` and `bit`: the bit is flipped after that optimizer step.
    """

    op: Optional[str] = None
    call: int = 0
    element: int = 0
    bit: Optional[int] = None
    mode: str = "flip"
    factor: float = 1e4
    value: float = 0.0
    output: int = 0
    parameter: Optional[str] = None
    step: int = 0
    job: Optional[str] = None
    iteration: Optional[int] = None
    persistent: bool = False

    def __post_init__(self) -> None:
        # Checked here without importing torch (screener.known_answer.engine.faults does), so the parent
        # process of a screen stays light; the child builds the FaultSpec, which checks again.
        if (self.op is None) == (self.parameter is None):
            raise BadInputError("a fault needs exactly one of op= and parameter=")
        if not isinstance(self.persistent, bool):
            raise BadInputError(f"fault persistent={self.persistent!r} must be true or false")
        if self.mode not in FAULT_MODES:
            raise BadInputError(f"fault mode {self.mode!r} is not one of {', '.join(FAULT_MODES)}")
        if min(self.call, self.element, self.output, self.step) < 0 or (
                self.bit is not None and self.bit < 0):
            raise BadInputError("fault call, element, bit, output and step must be >= 0")

    def fault_spec(self) -> Any:
        """The op fault as a screener.known_answer.engine.faults.FaultSpec (in the child only)."""
        # faults imports torch at its top (about 1 s); only the child, which runs torch anyway,
        # calls this, and the parent and the CLI must not pay for it.
        from screener.known_answer.engine.faults import FaultSpec

        try:
            return FaultSpec(op=str(self.op), call=self.call, element=self.element, bit=self.bit,
                             mode=self.mode, factor=self.factor, value=self.value,
                             output=self.output, persistent=self.persistent)
        except ValueError as e:
            raise BadInputError(f"fault {self}: {e}") from None

    def applies(self, job: str, iteration: int) -> bool:
        """Whether the fault is meant for this job's run in this iteration."""
        return (self.job is None or self.job == job) and (self.iteration is None
                                                          or self.iteration == iteration)

    def to_dict(self) -> dict[str, Any]:
        """The fields, as the child's request carries them (DeviceFault(**d) reads them back)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _value(text: str, key: str, value: str) -> Any:
    """One `key=value` pair's value, typed by its key."""
    try:
        if key in _INT_KEYS:
            return int(value)
        if key in _FLOAT_KEYS:
            return float(value)
    except ValueError:
        kind = "an integer" if key in _INT_KEYS else "a number"
        raise BadInputError(f"fault {text!r}: {key} must be {kind}") from None
    if key in _STR_KEYS:
        return value
    if key in _BOOL_KEYS:
        if value.lower() not in _BOOLS:
            raise BadInputError(f"fault {text!r}: {key} must be true or false")
        return _BOOLS[value.lower()]
    raise BadInputError(f"fault {text!r}: unknown key {key!r}")


def parse_fault(text: str) -> tuple[Optional[str], DeviceFault]:
    """Parse `key=value,...` (device, op, call, element, bit, mode, factor, value, output,
    persistent, parameter, step, job, iteration) into (device or None for every device, DeviceFault)."""
    kv: dict[str, Any] = {}
    device = None
    for part in filter(None, (s.strip() for s in text.split(","))):
        key, sep, value = part.partition("=")
        if not sep:
            raise BadInputError(f"fault {text!r}: {part!r} is not key=value")
        key, value = key.strip(), value.strip()
        if key == "device":
            device = value
        else:
            kv[key] = _value(text, key, value)
    return device, DeviceFault(**kv)
