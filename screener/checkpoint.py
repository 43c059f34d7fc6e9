"""Read the tensors of a checkpoint file safely: torch.save'd (nested) dicts or safetensors files.

Pickles are loaded with weights_only=True, so a file that would need arbitrary code to load is refused
rather than executed. Every problem is a BadInputError naming the file.
"""

from __future__ import annotations

import pickle
import re
import warnings
import zipfile
from pathlib import Path
from typing import Any, Mapping

import torch

from screener.errors import BadInputError


def _why(e: BaseException) -> str:
    """One line describing an exception, with its type when the message alone says little."""
    lines = str(e).strip().splitlines()
    first = lines[0] if lines else ""
    return f"{type(e).__name__}: {first}" if len(first) < 24 else first


def _flatten(obj: Any, prefix: str, out: dict[str, torch.Tensor], path: Path) -> None:
    if isinstance(obj, torch.Tensor):
        out[prefix or "<tensor>"] = obj
    elif isinstance(obj, Mapping):
        for k, v in obj.items():
            _flatten(v, f"{prefix}.{k}" if prefix else str(k), out, path)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _flatten(v, f"{prefix}.{i}" if prefix else str(i), out, path)
    # Other leaves (step counters, strings, None) carry no tensor bits to fingerprint.


def load_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors in a checkpoint, by dotted name (nested dicts and lists flattened), on the CPU."""
    p = Path(path)
    if not p.exists():
        raise BadInputError(f"{p}: no such file")
    if p.is_dir():
        raise BadInputError(f"{p}: is a directory, not a checkpoint file")
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
    except (RuntimeError, EOFError, zipfile.BadZipFile, ValueError, OSError, AttributeError,
            TypeError, IndexError, KeyError, UnicodeDecodeError) as e:
        raise BadInputError(f"{p}: not a PyTorch checkpoint: {_why(e)}") from None
    out: dict[str, torch.Tensor] = {}
    _flatten(obj, "", out, p)
    if not out and not isinstance(obj, (Mapping, list, tuple)):
        raise BadInputError(f"{p}: holds a {type(obj).__name__}, not a tensor or dict of tensors")
    return out


def _load_safetensors(p: Path) -> dict[str, torch.Tensor]:
    from screener._optional import require

    require("safetensors", f"{p}: reading a safetensors file")
    from safetensors.torch import load_file
    try:
        return dict(load_file(str(p), device="cpu"))
    except Exception as e:  # noqa: BLE001 - safetensors raises its own SafetensorError and others
        raise BadInputError(f"{p}: not a readable safetensors file: {_why(e)}") from None
