"""`screener platform` and `screener fingerprint`: the identity of bits, from the shell.

`platform` shows a device's platform signature (the key golden records are filed under);
`fingerprint` fingerprints the tensors of a checkpoint, or compares two.
"""

from __future__ import annotations

import json
import sys
from typing import Optional

import click

from screener.types import ExitCode


def _hex(v: int) -> str:
    return f"{v & 0xFFFFFFFFFFFFFFFF:016x}"


@click.command("platform")
@click.option("--device", "-d", default="cpu", show_default=True,
              help="Device to describe: cpu or cuda:N.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def platform_cmd(device: str, as_json: bool) -> None:
    """Show the platform signature of DEVICE and its numeric hash, as a screening child sees it
    (thread count pinned): the key golden records are filed under.

    The hash covers only what can change float results (GPU: model, SM count, driver, CUDA,
    cuBLAS, cuDNN; CPU: torch build, dispatch level, MKL and oneDNN code paths, thread count),
    so devices that share it must compute the same bits and share golden records.
    """
    from screener.known_answer.engine.screen import local_platform

    p = local_platform(device)
    d = p.to_dict()
    if as_json:
        click.echo(json.dumps(d, indent=2, sort_keys=True))
    else:
        for k, v in d.items():
            mark = "*" if k in p.numeric_fields else " "
            if isinstance(v, list):
                v = " ".join(v) or "-"
            click.echo(f"{mark} {k:20s} {v if v is not None else '-'}")
        click.echo("(* enters numeric_hash)")
    sys.exit(int(ExitCode.PASS))


@click.command("fingerprint")
@click.argument("path", type=click.Path(dir_okay=False, path_type=str))
@click.argument("path2", required=False, type=click.Path(dir_okay=False, path_type=str))
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def fingerprint_cmd(path: str, path2: Optional[str], as_json: bool) -> None:
    """Fingerprint every tensor of the checkpoint PATH; with PATH2, compare the two.

    Checkpoints are torch.save'd state_dicts or nested dicts of tensors (loaded with
    weights_only=True, so nothing in the file is executed) or safetensors files. Each tensor's
    fingerprint is two 64-bit sums over its raw bits (plain and position-weighted), printed as hex.
    With two paths, lists the tensors that differ or exist on one side only; exit 0 when every
    tensor is bit-identical, 75 otherwise.
    """
    from screener.tensorfile import load_tensors
    from screener.fingerprint import digest, fingerprints

    def table(p: str) -> dict[str, dict]:
        tensors = load_tensors(p)
        names = sorted(tensors)
        rows = fingerprints([tensors[n] for n in names]).tolist()
        return {n: {"dtype": str(tensors[n].dtype).replace("torch.", ""),
                    "shape": list(tensors[n].shape), "sum": r[0], "weighted": r[1]}
                for n, r in zip(names, rows)}

    a = table(path)
    if path2 is None:
        d_all = digest({n: (v["sum"], v["weighted"]) for n, v in a.items()})
        if as_json:
            click.echo(json.dumps({"path": path, "digest": d_all, "tensors": a}, indent=2))
        else:
            for n, v in a.items():
                shape = "x".join(map(str, v["shape"])) or "scalar"
                click.echo(f"{_hex(v['sum'])} {_hex(v['weighted'])}  {v['dtype']:>9s} {shape:>14s}  {n}")
            click.echo(f"{len(a)} tensors, digest {d_all}")
        sys.exit(int(ExitCode.PASS))

    b = table(path2)
    differ = sorted(n for n in set(a) & set(b)
                    if (a[n]["sum"], a[n]["weighted"], a[n]["dtype"], a[n]["shape"])
                    != (b[n]["sum"], b[n]["weighted"], b[n]["dtype"], b[n]["shape"]))
    only_a = sorted(set(a) - set(b))
    only_b = sorted(set(b) - set(a))
    equal = not (differ or only_a or only_b)
    if as_json:
        click.echo(json.dumps({"equal": equal, "differ": differ, "only_in_first": only_a,
                               "only_in_second": only_b, "compared": len(set(a) & set(b))},
                              indent=2))
    else:
        for n in differ:
            click.echo(f"differs       {n}  {_hex(a[n]['sum'])}:{_hex(a[n]['weighted'])} != "
                       f"{_hex(b[n]['sum'])}:{_hex(b[n]['weighted'])}")
        for n in only_a:
            click.echo(f"only in first {n}")
        for n in only_b:
            click.echo(f"only in second {n}")
        click.echo("equal: every tensor is bit-identical" if equal else
                   f"different: {len(differ)} differ, {len(only_a)} only in {path}, "
                   f"{len(only_b)} only in {path2}")
    sys.exit(int(ExitCode.PASS if equal else ExitCode.HARDWARE_SUSPECT))
