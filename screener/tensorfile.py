"""Read the tensors of a checkpoint file safely: torch.save'd (nested) dicts or safetensors files.

Pickles are loaded with weights_only=True, so a file that would need arbitrary code to load is refused
rather than executed. Every problem is a BadInputError naming the file, also a structure nested
deeper than MAX_DEPTH (a crafted pickle can nest a list 100,000 deep without running code) or
holding more than MAX_ENTRIES containers and leaves.
"""

from __future__ import annotations

import pickle
import re
import warnings
import zipfile
from pathlib import Path
from typing import Any, Mapping

import torch

from screener._optional import require
from screener.errors import BadInputError

MAX_DEPTH = 64  # a real checkpoint nests a handful of levels (optimizer state, param groups)
MAX_ENTRIES = 10_000_000


def _why(e: BaseException) -> str:
    """One line describing an exception, with its type when the message alone says little."""
    lines = str(e).strip().splitlines()
    first = lines[0] if lines else ""
    return f"{type(e).__name__}: {first}" if len(first) < 24 else first


def _flatten(obj: Any, prefix: str, out: dict[str, torch.Tensor], path: Path) -> None:
    """Collect every tensor under obj by dotted name, without recursion (so no depth of nesting
    can raise RecursionError) and within MAX_DEPTH and MAX_ENTRIES."""
    stack: list[tuple[Any, str, int]] = [(obj, prefix, 0)]
    seen = 0
    found: list[tuple[str, torch.Tensor]] = []
    while stack:
        v, name, depth = stack.pop()
        seen += 1
        if seen > MAX_ENTRIES:
            raise BadInputError(f"{path}: holds more than {MAX_ENTRIES} entries; not a checkpoint")
        if isinstance(v, torch.Tensor):
            found.append((name or "<tensor>", v))
            continue
        if isinstance(v, Mapping):
            items = [(f"{name}.{k}" if name else str(k), x) for k, x in v.items()]
        elif isinstance(v, (list, tuple)):
            items = [(f"{name}.{i}" if name else str(i), x) for i, x in enumerate(v)]
        else:
            continue  # other leaves (step counters, strings, None) carry no tensor bits
        if depth >= MAX_DEPTH and items:
            raise BadInputError(f"{path}: nested deeper than {MAX_DEPTH} levels; not a checkpoint")
        stack.extend((x, n, depth + 1) for n, x in reversed(items))
    out.update(found)  # in the order a recursive walk would give


def load_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors in a checkpoint, by dotted name (nested dicts and lists flattened), on the CPU."""
    p = Path(path)
    if not p.exists():
        raise BadInputError(f"{p}: no such file")
    if p.is_dir():
        raise BadInputError(f"{p}: is a directory, not a checkpoint file")
    if not p.is_file():  # a FIFO or a device would block or never end
        raise BadInputError(f"{p}: not a regular file")
    with open(p, "rb") as f:
        head = f.read(16)
    if p.suffix == ".safetensors" or (len(head) >= 9 and head[8:9] == b"{"):
        return _load_safetensors(p)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # protocol notes from the weights-only unpickler
            obj = torch.load(p, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        text = str(e)
        m = re.search(r"Unsupported global[^\n]*", text)
        if m:
            raise BadInputError(f"{p}: refused: loading it would run arbitrary code "
                                f"(weights_only=True): {m.group(0).rstrip('.')}") from None
        if head[:1] == b"\x80" or zipfile.is_zipfile(p):
            raise BadInputError(f"{p}: refused: a pickle that weights_only=True cannot load "
                                f"without running code: {_why(e)}") from None
        raise BadInputError(f"{p}: not a PyTorch checkpoint: {_why(e)}") from None
    except RecursionError:
        raise BadInputError(f"{p}: not a PyTorch checkpoint: nested too deeply") from None
    except Exception as e:  # noqa: BLE001 - torch.load of hostile bytes raises anything
        # (struct.error from the legacy format, RuntimeError, EOFError, zipfile errors, ...):
        # whatever it is, this file is not a checkpoint we can read, and that is bad input.
        raise BadInputError(f"{p}: not a PyTorch checkpoint: {_why(e)}") from None
    out: dict[str, torch.Tensor] = {}
    _flatten(obj, "", out, p)
    if not out and not isinstance(obj, (Mapping, list, tuple)):
        raise BadInputError(f"{p}: holds a {type(obj).__name__}, not a tensor or dict of tensors")
    return out


def _load_safetensors(p: Path) -> dict[str, torch.Tensor]:
    require("safetensors", f"{p}: reading a safetensors file")
    # An optional dependency: imported only after require() has said what is missing.
    from safetensors.torch import load_file

    try:
        return dict(load_file(str(p), device="cpu"))
    except Exception as e:  # noqa: BLE001 - safetensors raises its own SafetensorError and others
        raise BadInputError(f"{p}: not a readable safetensors file: {_why(e)}") from None
