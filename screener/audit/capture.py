"""What a replay must reproduce besides weights and batch: the RNG states and the loss scale a step
started from, captured on the owner and carried to whoever replays its step.

A training step that uses randomness (nn.Dropout, F.dropout, torch.rand in the forward) draws from
the default CPU generator and, on a GPU, the current CUDA device's generator. A replay on another
rank reproduces the owner's bits only when it starts from the same generator states, whatever
seeding the job does (one seed everywhere, per-rank seeds, none). So the auditor captures them when
the step starts: in a forward pre-hook on the DDP model (the first forward after the previous
`check_gradients`, so gradient accumulation's micro-batches replay from the same start), or when
the loop calls `Auditor.begin_step()` itself (needed only when loss_fn draws random numbers before
calling the model). Capturing is a copy of 5 KB (CPU Mersenne Twister) and 16 bytes (CUDA Philox
seed and offset); no device synchronisation.

The loss scale of a `torch.amp.GradScaler` is captured at the same moment: the scale a step's
backward used is the one in force when its forward began (`scaler.update()` runs after the
optimizer step), whichever order the loop calls the auditor and the scaler in.

`StepState.encode` packs all of it into one int64 tensor of a length that is the same on every rank
(so it rides in an all_gather); `decode` unpacks a gathered row; `restored(state)` is the context
in which a replay runs: the owner's generator states set, the replayer's own streams put back
afterwards. Imports only torch and the standard library.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch

__all__ = ["StepState", "StateCodec", "capture", "restored"]


@dataclass(frozen=True)
class StepState:
    """The generator states and loss scale one step started from (None: not captured / no scaler)."""

    cpu_rng: Optional[torch.Tensor]  # uint8 ByteTensor, torch.get_rng_state()
    cuda_rng: Optional[torch.Tensor]  # uint8 ByteTensor of the current CUDA device, or None
    scale: Optional[float]  # GradScaler scale in force, or None without an enabled scaler


def scaler_scale(scaler: Any) -> Optional[float]:
    """The scale an enabled GradScaler applies now (None without one or when it is disabled)."""
    if scaler is None or not scaler.is_enabled():
        return None
    return float(scaler.get_scale())


def capture(device: torch.device, scaler: Any = None) -> StepState:
    """The states a step starting now draws from (CPU, and the CUDA device when it computes there)."""
    cuda = None
    if device.type == "cuda":
        cuda = torch.cuda.get_rng_state(device)
    return StepState(torch.get_rng_state(), cuda, scaler_scale(scaler))


def _bytes_to_int64(t: torch.Tensor, words: int) -> torch.Tensor:
    flat = t.detach().cpu().contiguous().view(torch.uint8).reshape(-1)
    out = torch.zeros(words * 8, dtype=torch.uint8)
    out[:flat.numel()] = flat
    return out.view(torch.int64)


class StateCodec:
    """Packs a StepState into a fixed-length int64 tensor and back; built once per auditor.

    Layout: [captured flag, scale flag, scale as float64 bits, cpu words..., cuda words...]. The
    lengths come from this process's generators; every rank of a job runs the same torch build
    on the same device type, so they agree.
    """

    def __init__(self, device: torch.device) -> None:
        self.cpu_bytes = torch.get_rng_state().numel()
        self.cuda_bytes = torch.cuda.get_rng_state(device).numel() if device.type == "cuda" else 0
        self.cpu_words = math.ceil(self.cpu_bytes / 8)
        self.cuda_words = math.ceil(self.cuda_bytes / 8)
        self.length = 3 + self.cpu_words + self.cuda_words

    def encode(self, state: Optional[StepState]) -> torch.Tensor:
        out = torch.zeros(self.length, dtype=torch.int64)
        if state is None:
            return out
        if state.scale is not None:
            out[1] = 1
            out[2] = torch.tensor(state.scale, dtype=torch.float64).view(torch.int64)
        if state.cpu_rng is not None:
            out[0] = 1
            out[3:3 + self.cpu_words] = _bytes_to_int64(state.cpu_rng, self.cpu_words)
            if self.cuda_words and state.cuda_rng is not None:
                out[3 + self.cpu_words:] = _bytes_to_int64(state.cuda_rng, self.cuda_words)
        return out

    def decode(self, row: torch.Tensor) -> StepState:
        row = row.detach().cpu().to(torch.int64).contiguous()
        scale = float(row[2:3].view(torch.float64).item()) if int(row[1]) else None
        if not int(row[0]):
            return StepState(None, None, scale)
        raw = row[3:].clone().view(torch.uint8)
        cpu = raw[:self.cpu_bytes].clone()
        start = self.cpu_words * 8
        cuda = raw[start:start + self.cuda_bytes].clone() if self.cuda_bytes else None
        return StepState(cpu, cuda, scale)


@contextlib.contextmanager
def restored(state: Optional[StepState], device: torch.device) -> Iterator[None]:
    """Run the body from the owner's generator states; afterwards this rank's own streams are as
    they were (torch.random.fork_rng), so a replay never moves the training loop's randomness."""
    devices = [device.index if device.index is not None else torch.cuda.current_device()] \
        if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        if state is not None and state.cpu_rng is not None:
            torch.set_rng_state(state.cpu_rng)
            if devices and state.cuda_rng is not None:
                torch.cuda.set_rng_state(state.cuda_rng, device)
        yield
