"""Fault injection: precise, seedable silent data corruption for tests and pipeline drills.

Three places a fault can land, each a model of a real failure:

- an operator output (`inject`, `FaultInjector`): flip bit b of element i of the output of the n-th
  matching call of an aten op, or scale it, or make it NaN/Inf, or set a value; optionally only when
  a predicate on the operands holds (a marginal unit that fails on some operand patterns) or only on
  one device. It is a TorchDispatchMode, so it sees every op below autograd on CPU and CUDA, forward
  and backward (the autograd engine carries the mode into its worker threads).
- a parameter after the optimizer step (`corrupt_parameter`): a flipped bit in weight memory.
- a gradient bucket inside the all-reduce (`corrupt_allreduce`): a DDP communication hook that
  corrupts the bucket on one rank before the reduction.

Op names. A spec's `op` is matched against the aten overload packet name the dispatcher sees
(`func.overloadpacket.__name__`), e.g. "mm", "addmm", "bmm", "baddbmm", "convolution",
"convolution_backward", "_softmax", "_log_softmax", "native_layer_norm", "gelu", "embedding",
"add", "mul", "sum", "nll_loss_forward". Composite ops never reach the dispatcher under their own
name, so these aliases match their decompositions (the call count runs over all of them):

    matmul -> mm, bmm          linear -> addmm, mm, bmm     softmax -> _softmax
    log_softmax -> _log_softmax                              layer_norm -> native_layer_norm
    conv, conv1d, conv2d, conv3d -> convolution               cross_entropy -> _log_softmax

Only ops that produce a new tensor make sense as targets; corrupting the output of a view op
(view, t, transpose, ...) writes through to its base.

Bits. `bit` indexes the raw bit pattern of the element (0 = least significant mantissa bit; for
float32 bit 31 is the sign, 23..30 the exponent; for bf16 15 / 7..14; for fp16 15 / 10..14). It
wraps modulo the element's width, as `element` wraps modulo numel; `fired` records what was applied.
For mode "flip" a bit of None means bit 0: one unit in the last place, the hardest case to catch.

Only torch and the standard library are imported.
"""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass
from typing import Any, Callable, Container, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.utils._python_dispatch import TorchDispatchMode

from screener.audit.hooks import stateless_hook

MODES = ("flip", "scale", "nan", "inf", "set")

OP_ALIASES: dict[str, tuple[str, ...]] = {
    "matmul": ("mm", "bmm"),
    "linear": ("addmm", "mm", "bmm"),
    "softmax": ("_softmax",),
    "log_softmax": ("_log_softmax",),
    "cross_entropy": ("_log_softmax",),
    "layer_norm": ("native_layer_norm",),
    "conv": ("convolution",),
    "conv1d": ("convolution",),
    "conv2d": ("convolution",),
    "conv3d": ("convolution",),
}

# Integer dtype of the same width, to reach the raw bits of a floating element.
_BITS_VIEW: dict[torch.dtype, torch.dtype] = {
    torch.float64: torch.int64,
    torch.float32: torch.int32,
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
    torch.int64: torch.int64,
    torch.int32: torch.int32,
    torch.int16: torch.int16,
    torch.int8: torch.int8,
    torch.uint8: torch.uint8,
    torch.bool: torch.uint8,
}


def op_names(op: str) -> frozenset[str]:
    """The aten overload packet names a spec's `op` matches (aliases expanded)."""
    return frozenset(OP_ALIASES.get(op, (op,)))


@dataclass(frozen=True)
class FaultSpec:
    """One fault in an operator output; see the module docstring for names, bits and modes.

    op: aten op name or alias. call: the n-th matching call (0-based), counting only calls that
    match op, device and predicate. element: flat row-major index into the output (mod numel).
    bit: bit to flip (mode "flip"). mode: flip | scale | nan | inf | set. factor: for "scale";
    value: for "set"; device: "cuda", "cuda:1", "cpu" (None: any). predicate(args, kwargs): only
    calls for which it is true. output: which output of a multi-output op. persistent: fire on
    the n-th matching call and every one after it (a unit that is wrong again and again, the
    commonest silent data corruption), not only on the n-th.
    """

    op: str
    call: int = 0
    element: int = 0
    bit: Optional[int] = None
    mode: str = "flip"
    factor: float = 1e4
    value: float = 0.0
    device: Optional[str] = None
    predicate: Optional[Callable[[tuple, dict], bool]] = None
    output: int = 0
    persistent: bool = False  # every matching call from `call` on: a unit that stays bad

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"fault mode {self.mode!r} is not one of {', '.join(MODES)}")
        if self.call < 0 or self.element < 0 or self.output < 0:
            raise ValueError("fault call, element and output must be >= 0")
        if self.bit is not None and self.bit < 0:
            raise ValueError(f"fault bit {self.bit} must be >= 0")
        if self.device is not None:
            torch.device(self.device)  # raises on a malformed device string
        # A misspelt op would never fire and a drill would "pass" without testing anything.
        unknown = sorted(n for n in op_names(self.op) if not hasattr(torch.ops.aten, n))
        if unknown:
            raise ValueError(f"fault op {self.op!r}: no aten op named {', '.join(unknown)} "
                             f"(aliases: {', '.join(sorted(OP_ALIASES))})")


def _device_matches(want: Optional[str], t: Tensor) -> bool:
    if want is None:
        return True
    d = torch.device(want)
    return t.device.type == d.type and (d.index is None or t.device.index == d.index)


def _unsigned_bits(x: Tensor) -> int:
    """The raw bit pattern of a 0-d tensor as a non-negative int."""
    dt = _BITS_VIEW[x.dtype]
    width = torch.iinfo(dt).bits
    v = int(x.view(dt).item()) if x.dtype != torch.bool else int(x.item())
    return v & ((1 << width) - 1)


def _hex(x: Tensor) -> str:
    width = torch.iinfo(_BITS_VIEW[x.dtype]).bits
    return f"0x{_unsigned_bits(x):0{width // 4}x}"


def _as_value(x: Tensor) -> Any:
    v = x.item()
    return v if isinstance(v, (int, float, bool)) else float(v)


def apply_to_tensor(t: Tensor, element: int, *, mode: str = "flip", bit: Optional[int] = None,
                    factor: float = 1e4, value: float = 0.0) -> dict[str, Any]:
    """Corrupt one element of t in place and return a record of what changed.

    The element is the flat row-major index (mod numel), found through an index rather than a
    flattened view, so non-contiguous outputs are corrupted where they live.
    """
    n = t.numel()
    if n == 0:
        return {"skipped": "empty tensor"}
    flat = element % n
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), t.shape)) if t.dim() else ()
    with torch.no_grad():
        elem = t[index] if index else t  # a 0-d view into t's storage
        before_hex, before = _hex(elem), _as_value(elem)
        applied_bit = None
        if mode == "flip":
            if t.dtype not in _BITS_VIEW:
                raise TypeError(f"cannot flip bits of dtype {t.dtype}")
            ity = _BITS_VIEW[t.dtype]
            width = torch.iinfo(ity).bits
            applied_bit = (bit or 0) % width
            if t.dtype == torch.bool:
                elem.logical_not_()
            else:
                mask = 1 << applied_bit
                if ity != torch.uint8 and applied_bit == width - 1:
                    mask = -mask  # the sign bit as a signed value of that width
                bits = elem.view(ity)
                bits.bitwise_xor_(torch.tensor(mask, dtype=ity, device=t.device))
        elif mode == "scale":
            elem.mul_(factor)
        elif mode == "nan":
            elem.fill_(float("nan"))
        elif mode == "inf":
            elem.fill_(float("inf"))
        elif mode == "set":
            elem.fill_(value)
        else:
            raise ValueError(f"fault mode {mode!r} is not one of {', '.join(MODES)}")
        return {"element": flat, "index": list(index), "bit": applied_bit, "mode": mode,
                "dtype": str(t.dtype).replace("torch.", ""), "device": str(t.device),
                "before": before_hex, "after": _hex(elem), "before_value": before,
                "after_value": _as_value(elem)}


class FaultInjector(TorchDispatchMode):
    """A dispatch mode that applies FaultSpecs to op outputs; `fired` records each applied fault.

    Use as a context manager (`with inject(spec): ...`). Call counts are kept per spec and start
    at zero when the injector is created; reuse across two `with` blocks keeps counting.
    """

    def __init__(self, *specs: FaultSpec) -> None:
        super().__init__()
        self.specs: tuple[FaultSpec, ...] = tuple(specs)
        self._names = [op_names(s.op) for s in self.specs]
        self._all_names = frozenset().union(*self._names) if self._names else frozenset()
        self.counts: list[int] = [0] * len(self.specs)
        self.fired: list[dict[str, Any]] = []
        self._lock = threading.Lock()  # backward may run on autograd worker threads

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: D105
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if name not in self._all_names:
            return out
        for i, spec in enumerate(self.specs):
            if name not in self._names[i]:
                continue
            target = out
            if out is None and name.endswith("_") and args:
                # An in-place op that returns nothing (the foreach and fused optimizer kernels:
                # _fused_adamw_, _foreach_lerp_): the fault lands in what it wrote, its first
                # argument (output picks the tensor of a list), as a wrong update would.
                target = args[0]
            if isinstance(target, (tuple, list)):
                if spec.output >= len(target):
                    continue
                target = target[spec.output]
            if not isinstance(target, Tensor) or target.device.type == "meta":
                continue
            # a DTensor (tensor parallel): the fault lands in this rank's own shard of it
            target = getattr(target, "_local_tensor", target)
            if not _device_matches(spec.device, target):
                continue
            if spec.predicate is not None and not spec.predicate(args, kwargs):
                continue
            with self._lock:
                n = self.counts[i]
                self.counts[i] += 1
            if n != spec.call and not (spec.persistent and n > spec.call):
                continue
            rec = apply_to_tensor(target, spec.element, mode=spec.mode, bit=spec.bit,
                                  factor=spec.factor, value=spec.value)
            rec.update({"op": name, "spec": i, "call": n, "output": spec.output})
            with self._lock:
                self.fired.append(rec)
        return out


def inject(*specs: FaultSpec) -> FaultInjector:
    """A FaultInjector for the given specs, to use as `with inject(FaultSpec("mm", bit=3)) as f:`."""
    return FaultInjector(*specs)


def _lookup(module: torch.nn.Module, name: str) -> Tensor:
    params: dict[str, Tensor] = dict(module.named_parameters())
    params.update(dict(module.named_buffers()))
    for candidate in (name, f"module.{name}", name.removeprefix("module.")):
        if candidate in params:
            return params[candidate]
    raise KeyError(f"{type(module).__name__} has no parameter or buffer {name!r}; "
                   f"it has {', '.join(sorted(params)[:20])}")


def corrupt_parameter(module: torch.nn.Module, name: str, element: int, *,
                      bit: Optional[int] = None, value: Optional[float] = None) -> dict[str, Any]:
    """Flip `bit` of (or write `value` into) one element of a named parameter, in place.

    Models a flipped bit in weight memory after the optimizer step; autograd does not see it.
    The name may carry or omit DDP's "module." prefix. Give exactly one of bit and value.
    """
    if (bit is None) == (value is None):
        raise ValueError("corrupt_parameter needs exactly one of bit= and value=")
    t = _lookup(module, name)
    if bit is not None:
        rec = apply_to_tensor(t.data, element, mode="flip", bit=bit)
    else:
        rec = apply_to_tensor(t.data, element, mode="set", value=float(value))  # type: ignore[arg-type]
    rec["parameter"] = name
    return rec


def corrupt_allreduce(*, rank: int, calls: Optional[Container[int]] = None, element: int = 0,
                      value: float = float("nan"), base_hook: Optional[Callable] = None) -> Callable:
    """A DDP communication hook that corrupts one gradient bucket on one rank, then reduces.

    On global rank `rank`, for the hook's 0-based call numbers in `calls` (None: every call), it
    writes `value` into `bucket.buffer()[element]` (mod its size), then runs `base_hook` (default:
    the stock all-reduce hook). Calls are counted on every rank. Applied faults are listed in the
    returned hook's `.fired`. Pass it to `ddp.register_comm_hook(state, hook)` or to the in-job
    Auditor as `reduce_hook=`, so the fault lands after the local statistics were recorded.
    """
    if base_hook is None:
        base_hook = allreduce_hook
    counter = {"n": 0}
    fired: list[dict[str, Any]] = []

    # No annotations on purpose: DDP checks that a hook's bucket annotation, if any, is the
    # GradBucket class itself, and under postponed evaluation it would be a string.
    def hook(state, bucket):
        n = counter["n"]
        counter["n"] += 1
        if dist.get_rank() == rank and (calls is None or n in calls):
            buf = bucket.buffer()
            rec = apply_to_tensor(buf, element, mode="set", value=value)
            rec.update({"rank": rank, "call": n, "bucket": bucket.index()})
            fired.append(rec)
        return base_hook(state, bucket)

    hook.fired = fired  # type: ignore[attr-defined]
    # It stands in for hardware on the reduction it wraps: as stateless as that one is (the
    # audit redoes a bad reduction only through a hook that keeps no state between calls).
    hook.stateless = stateless_hook(base_hook)  # type: ignore[attr-defined]
    return hook


def random_flips(n: int, *, seed: int, ops: Sequence[str], max_call: int, max_element: int,
                 bits: int = 32, device: Optional[str] = None) -> list[FaultSpec]:
    """n single-bit flips with op, call, element and bit drawn from random.Random(seed).

    `bits` is the width bits are drawn from (32 for float32 outputs; a flip beyond an output's
    width wraps). The same seed always gives the same campaign.
    """
    if n < 0 or max_call < 1 or max_element < 1 or bits < 1 or not ops:
        raise ValueError("random_flips needs n >= 0, max_call >= 1, max_element >= 1, bits >= 1 "
                         "and at least one op")
    rng = random.Random(seed)
    return [FaultSpec(op=rng.choice(list(ops)), call=rng.randrange(max_call),
                      element=rng.randrange(max_element), bit=rng.randrange(bits), device=device)
            for _ in range(n)]


def bit_classes(dtype: torch.dtype) -> dict[str, int]:
    """One representative bit per class (sign, top exponent, low exponent, high/low mantissa)."""
    table = {
        torch.float32: {"sign": 31, "exp_high": 30, "exp_low": 23, "mant_high": 22, "mant_low": 0},
        torch.float16: {"sign": 15, "exp_high": 14, "exp_low": 10, "mant_high": 9, "mant_low": 0},
        torch.bfloat16: {"sign": 15, "exp_high": 14, "exp_low": 7, "mant_high": 6, "mant_low": 0},
        torch.float64: {"sign": 63, "exp_high": 62, "exp_low": 52, "mant_high": 51, "mant_low": 0},
    }
    if dtype not in table:
        raise TypeError(f"no bit classes for {dtype}")
    return dict(table[dtype])


__all__ = ["FaultSpec", "FaultInjector", "inject", "corrupt_parameter",
                          "corrupt_allreduce", "random_flips", "bit_classes", "apply_to_tensor",
                          "op_names", "OP_ALIASES", "MODES"]
