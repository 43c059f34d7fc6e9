"""Job specs (jobs/*.toml): what a known-answer job may say, its hash, loading and choosing them.

A job spec names a workload kind (screener.known_answer.engine.workloads runs them) and its parameters;
this module loads and validates specs and computes their canonical hash, which keys golden
records, so editing a job invalidates its goldens. Each kind has an implementation version that
enters the spec hash, so a change in the code that changes result bits invalidates goldens just
as an edit of the spec does.

Specs are hostile input until validated: every parameter has a type and a range (BOUNDS), and
`check_fits` compares an estimate of the job's memory and arithmetic with the device before the
child allocates anything, so an oversized spec is bad input (exit 2 naming the fields), never a
timeout or a crash that would read as a hardware verdict.

No torch here: the CLI and the parent of a screen read specs through this module and must not
pay torch's start-up (1-5 s).
"""

from __future__ import annotations

import hashlib
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Sequence

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from screener import boundedjson
from screener.errors import BadInputError, ConfigError
from screener.known_answer.engine.packagedata import data_dir
from screener.known_answer.verdict.results import canonical_json

JOBS_DIR_ENV = "SCREENER_JOBS_DIR"
# A spec's version is bumped by hand at each edit; the bound keeps it an ordinary number (it
# enters the spec hash, the key of its golden records, and every listing).
MAX_SPEC_VERSION = 1_000_000
SPEC_FIELDS = ("name", "version", "kind", "description", "quick", "params", "cpu", "cuda")
DTYPES = ("float32", "float16", "bfloat16")
GEMM_DTYPES = (*DTYPES, "float8_e4m3fn")  # FP8 through torch._scaled_mm (gemm only)
# scaled_dot_product_attention's backends (screener.known_answer.engine.llm, which imports torch: named
# here too so a spec is checked without it)
_SDPA_BACKENDS = ("math", "flash", "efficient", "cudnn")

# kind -> (implementation version, {param: (type(s), default)}).
# Bump a kind's implementation version whenever its code changes the bits it produces.
_INT, _FLOAT, _BOOL, _STR, _LIST = int, (int, float), bool, str, list
KINDS: dict[str, tuple[int, dict[str, tuple[Any, Any]]]] = {
    "gemm": (1, {"dtype": (_STR, "float32"), "tf32": (_BOOL, False), "seed": (_INT, 0),
                 "chain": (_INT, 4), "shapes": (_LIST, []), "tile": (_INT, 128),
                 "tiles_per_sm": (_INT, 4)}),
    "conv": (1, {"dtype": (_STR, "float32"), "tf32": (_BOOL, False), "seed": (_INT, 0),
                 "batch": (_INT, 2), "channels": (_INT, 16), "size": (_INT, 16),
                 "layers": (_INT, 4)}),
    "train": (1, {"seed": (_INT, 0), "steps": (_INT, 4), "batch": (_INT, 4), "seq": (_INT, 16),
                  "vocab": (_INT, 64), "d_model": (_INT, 32), "n_heads": (_INT, 4),
                  "d_ff": (_INT, 64), "n_layers": (_INT, 1), "lr": (_FLOAT, 1e-3),
                  "weight_decay": (_FLOAT, 0.01), "autocast": (_STR, "none")}),
    "replay": (1, {"seed": (_INT, 0), "ranks": (_INT, 2), "steps": (_INT, 2), "batch": (_INT, 4),
                   "seq": (_INT, 16), "vocab": (_INT, 64), "d_model": (_INT, 32),
                   "n_heads": (_INT, 4), "d_ff": (_INT, 64), "n_layers": (_INT, 1)}),
    "llm": (1, {"seed": (_INT, 0), "steps": (_INT, 3), "batch": (_INT, 2), "seq": (_INT, 32),
                "vocab": (_INT, 256), "d_model": (_INT, 64), "n_heads": (_INT, 4),
                "d_ff": (_INT, 172), "n_layers": (_INT, 4), "lr": (_FLOAT, 1e-3),
                "weight_decay": (_FLOAT, 0.1), "autocast": (_STR, "none"),
                "max_norm": (_FLOAT, 1.0), "z_loss": (_FLOAT, 1e-4),
                "rope_theta": (_FLOAT, 10000.0),
                "attention": (_LIST, ["math:causal", "flash:causal", "math:full", "flash:full"]),
                "optimizers": (_LIST, ["foreach", "fused"]),
                "probe_attention": (_LIST, [])}),
    "selftest": (1, {"sleep": (_FLOAT, 0.0), "exit": (_INT, -1), "abort": (_BOOL, False),
                     "raise": (_STR, ""), "signal": (_INT, 0)}),
}


def default_jobs_dir() -> Path:
    """$SCREENER_JOBS_DIR, or the specs shipped with the package (screener._jobs: in a checkout,
    the repository's jobs/ folder; see screener/known_answer/engine/packagedata.py)."""
    env = os.environ.get(JOBS_DIR_ENV)
    if env:
        return Path(env)
    return data_dir("jobs")


@dataclass(frozen=True)
class JobSpec:
    """One validated job spec. `params_for(device)` merges the [cpu] or [cuda] overrides."""

    name: str
    version: int
    kind: str
    description: str = ""
    quick: bool = False
    params: Mapping[str, Any] = field(default_factory=dict)
    cpu: Mapping[str, Any] = field(default_factory=dict)
    cuda: Mapping[str, Any] = field(default_factory=dict)
    path: str = ""

    @property
    def spec_hash(self) -> str:
        """16 hex digits over what changes result bits: name, version, kind (and its code
        version) and every parameter; not the description, the quick flag or the path."""
        blob = canonical_json({"name": self.name, "version": self.version, "kind": self.kind,
                           "impl": KINDS[self.kind][0], "params": dict(self.params),
                           "cpu": dict(self.cpu), "cuda": dict(self.cuda)})
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def params_for(self, device: str) -> dict[str, Any]:
        """Defaults, then [params], then the table of the device type (cpu or cuda)."""
        _, schema = KINDS[self.kind]
        merged = {k: default for k, (_, default) in schema.items()}
        merged.update(self.params)
        dtype = device.split(":")[0]
        merged.update(self.cuda if dtype == "cuda" else self.cpu)
        return merged

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "version": self.version, "kind": self.kind,
                "description": self.description, "quick": self.quick,
                "params": dict(self.params), "cpu": dict(self.cpu), "cuda": dict(self.cuda),
                "path": self.path}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, source: str = "<job>") -> "JobSpec":
        """Validate a parsed spec; raises ConfigError naming `source` and the first problem."""
        d = dict(d)
        path = str(d.pop("path", source))
        unknown = sorted(set(d) - set(SPEC_FIELDS))
        if unknown:
            raise ConfigError(f"{source}: unknown key(s) {', '.join(unknown)}; "
                              f"expected {', '.join(SPEC_FIELDS)}")
        for key in ("name", "version", "kind"):
            if key not in d:
                raise ConfigError(f"{source}: missing required key {key!r}")
        name, version, kind = d["name"], d["version"], d["kind"]
        if not isinstance(name, str) or not name or not all(c.isalnum() or c in "-_" for c in name):
            raise ConfigError(f"{source}: name {name!r} must be letters, digits, '-' or '_'")
        if not isinstance(version, int) or isinstance(version, bool) \
                or not 1 <= version <= MAX_SPEC_VERSION:
            raise ConfigError(f"{source}: version {str(version)[:40]} must be an integer in "
                              f"1..{MAX_SPEC_VERSION}")
        if kind not in KINDS:
            raise ConfigError(f"{source}: kind {kind!r} is not one of {', '.join(sorted(KINDS))}")
        if not isinstance(d.get("description", ""), str):
            raise ConfigError(f"{source}: description must be a string")
        if not isinstance(d.get("quick", False), bool):
            raise ConfigError(f"{source}: quick must be true or false")
        tables = {}
        for table in ("params", "cpu", "cuda"):
            value = d.get(table, {})
            if not isinstance(value, Mapping):
                raise ConfigError(f"{source}: [{table}] must be a table")
            tables[table] = _validate_params(kind, dict(value), f"{source} [{table}]")
        spec = cls(name=name, version=version, kind=kind, description=d.get("description", ""),
                   quick=d.get("quick", False), path=path, **tables)
        for device in ("cpu", "cuda"):
            _validate_values(spec.kind, spec.params_for(device), f"{source} ({device})")
        return spec


def _validate_params(kind: str, params: dict[str, Any], where: str) -> dict[str, Any]:
    _, schema = KINDS[kind]
    unknown = sorted(set(params) - set(schema))
    if unknown:
        raise ConfigError(f"{where}: unknown parameter(s) {', '.join(unknown)} for kind {kind!r}; "
                          f"expected {', '.join(sorted(schema))}")
    for key, value in params.items():
        types = schema[key][0]
        if isinstance(value, bool) and types is not bool:
            raise ConfigError(f"{where}: {key} = {value!r} must be {_type_name(types)}")
        if not isinstance(value, types):
            raise ConfigError(f"{where}: {key} = {value!r} must be {_type_name(types)}")
    return params


def _type_name(types: Any) -> str:
    if isinstance(types, tuple):
        return " or ".join(t.__name__ for t in types)
    return types.__name__


# Inclusive ranges of every numeric parameter: far above what a screen needs, far below what
# would exhaust a device or run for days. check_fits does the device-specific part.
BOUNDS: dict[str, tuple[float, float]] = {
    "seed": (0, 2**63 - 1), "chain": (1, 1000), "tile": (1, 4096), "tiles_per_sm": (1, 1024),
    "batch": (1, 4096), "channels": (1, 4096), "size": (1, 8192), "layers": (1, 1000),
    "steps": (1, 10_000), "seq": (1, 16_384), "vocab": (1, 1_000_000), "d_model": (1, 16_384),
    "n_heads": (1, 256), "d_ff": (1, 65_536), "n_layers": (1, 256), "ranks": (1, 1024),
    "lr": (0.0, 10.0), "weight_decay": (0.0, 10.0), "sleep": (0.0, 3600.0), "exit": (-1, 255),
    "signal": (0, 64),
}
MAX_SHAPES = 16
MAX_SPEC_BYTES = 64 * 1024
MAX_DIM = 65_536
MAX_FLOPS = 1e18  # about ten minutes of a whole H100 at its dense peak
MAX_BYTES = 2**40  # 1 TiB: no device has more; check_fits compares with the real one
# An optimistic peak rate per device type: a job that cannot finish within the timeout even at
# this rate is refused; a slower device merely runs closer to its timeout.
PEAK_FLOPS = {"cpu": 2e11, "cuda": 2e15}


def _validate_values(kind: str, p: Mapping[str, Any], where: str) -> None:
    """Range checks on merged parameters, so a bad spec fails at load time, not in a child."""
    def need(cond: bool, what: str) -> None:
        if not cond:
            raise ConfigError(f"{where}: {what}")

    for key, value in p.items():
        if key in BOUNDS and isinstance(value, (int, float)) and not isinstance(value, bool):
            lo, hi = BOUNDS[key]
            need(math.isfinite(value) and lo <= value <= hi,
                 f"{key} = {str(value)[:40]} is outside {lo:g}..{hi:g}")
    if kind == "gemm":
        need(len(p["shapes"]) <= MAX_SHAPES, f"shapes lists more than {MAX_SHAPES} shapes")
        for s in p["shapes"]:
            need(isinstance(s, list) and len(s) == 2 and all(
                isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= MAX_DIM for v in s),
                f"shape {str(s)[:60]} must be [rows, cols] of integers 1..{MAX_DIM}")

    if kind in ("gemm", "conv"):
        allowed = GEMM_DTYPES if kind == "gemm" else DTYPES
        need(p["dtype"] in allowed, f"dtype {p['dtype']!r} is not one of {', '.join(allowed)}")
        need(not p["tf32"] or p["dtype"] == "float32", "tf32 = true needs dtype float32")
    if kind == "gemm" and p["dtype"] == "float8_e4m3fn":
        for s in p["shapes"]:
            need(isinstance(s, list) and all(isinstance(v, int) and v % 16 == 0 for v in s),
                 f"shape {str(s)[:60]} must be multiples of 16 for float8_e4m3fn "
                 f"(torch._scaled_mm)")
    if kind == "gemm":
        need(p["chain"] >= 1, "chain must be >= 1")
        need(p["tile"] >= 1 and p["tiles_per_sm"] >= 1, "tile and tiles_per_sm must be >= 1")
        for s in p["shapes"]:
            need(isinstance(s, list) and len(s) == 2 and all(isinstance(v, int) and v >= 1
                                                             for v in s),
                 f"shape {s!r} must be [rows, cols] of positive integers")
    if kind == "conv":
        need(min(p["batch"], p["channels"], p["size"], p["layers"]) >= 1,
             "batch, channels, size and layers must be >= 1")
    if kind in ("train", "replay", "llm"):
        need(min(p["steps"], p["batch"], p["seq"], p["vocab"], p["d_model"], p["n_heads"],
                 p["d_ff"], p["n_layers"]) >= 1, "sizes and steps must be >= 1")
        need(p["d_model"] % p["n_heads"] == 0, "d_model must be divisible by n_heads")
    if kind == "llm":
        need((p["d_model"] // p["n_heads"]) % 2 == 0, "d_model / n_heads must be even (rotary)")
        need(p["max_norm"] > 0 and p["rope_theta"] > 1 and p["z_loss"] >= 0,
             "max_norm and z_loss must be >= 0 (max_norm > 0) and rope_theta > 1")
        need(p["autocast"] in ("none", "bfloat16", "float16"),
             f"autocast {p['autocast']!r} is not none, bfloat16 or float16")
        need(bool(p["attention"]) and len(p["attention"]) <= 64,
             "attention must list 1 to 64 entries")
        need(len(p["probe_attention"]) <= 64, "probe_attention lists more than 64 entries")
        for a in [*p["attention"], *p["probe_attention"]]:
            backend, _, mask = str(a).partition(":")
            need(isinstance(a, str) and backend in _SDPA_BACKENDS and mask in ("causal", "full"),
                 f"attention entry {str(a)[:60]!r} is not <backend>:<mask> (backend "
                 f"{', '.join(_SDPA_BACKENDS)}; mask causal or full)")
        need(bool(p["optimizers"]) and len(p["optimizers"]) <= 64
             and all(o in ("foreach", "fused") for o in p["optimizers"]),
             "optimizers must list foreach and/or fused")
    if kind == "train":
        need(p["autocast"] in ("none", "bfloat16", "float16"),
             f"autocast {p['autocast']!r} is not none, bfloat16 or float16")
    if kind == "replay":
        need(p["ranks"] >= 1, "ranks must be >= 1")
    if kind != "selftest" and not (kind == "gemm" and not p["shapes"]):
        # (a CUDA GEMM without shapes is sized from the SM count: check_fits sees it on the device)
        nbytes, flops, fields = estimate(kind, p, _static_shapes(p) if kind == "gemm" else None)
        need(nbytes <= MAX_BYTES, f"needs about {nbytes / 2**30:.0f} GiB (at most "
                                  f"{MAX_BYTES / 2**30:.0f}): reduce {fields}")
        need(flops <= MAX_FLOPS, f"needs about {flops:.2g} floating-point operations (at most "
                                 f"{MAX_FLOPS:.0e}): reduce {fields}")


def _static_shapes(p: Mapping[str, Any]) -> list[tuple[int, int]]:
    return [(int(m), int(k)) for m, k in p["shapes"]] or [(256, 256)]


def _elt(p: Mapping[str, Any]) -> int:
    return {"float16": 2, "bfloat16": 2, "float8_e4m3fn": 1}.get(str(p.get("dtype")), 4)


def estimate(kind: str, p: Mapping[str, Any],
             shapes: Optional[Sequence[tuple[int, int]]] = None) -> tuple[float, float, str]:
    """(bytes, floating-point operations, the fields that drive them) of one run of a job with
    merged parameters p: an upper-end estimate of its working set and its arithmetic."""
    if kind == "gemm":
        shapes = shapes if shapes is not None else _static_shapes(p)
        chain = int(p["chain"])
        nbytes = sum((3.0 * m * k + chain * k * k) for m, k in shapes) * _elt(p)
        flops = chain * sum(2.0 * m * k * k for m, k in shapes)
        return nbytes, flops, "shapes (or tile, tiles_per_sm) and chain"
    if kind == "conv":
        b, c, s, layers = (float(p[k]) for k in ("batch", "channels", "size", "layers"))
        nbytes = (4.0 * b * c * s * s + layers * c * c * 9) * _elt(p)
        flops = layers * 2.0 * b * c * c * 9 * s * s
        return nbytes, flops, "batch, channels, size and layers"
    if kind in ("train", "replay", "llm"):
        b, t, v, d, h, f, n = (float(p[k]) for k in ("batch", "seq", "vocab", "d_model",
                                                       "n_heads", "d_ff", "n_layers"))
        params = 2 * v * d + t * d + n * (4 * d * d + 2 * d * f + 8 * d)
        tokens = b * t
        acts = tokens * (n * (12 * d + 2 * f) + 3 * v) + n * b * h * t * t * 3
        copies = 2 if kind == "replay" else 4  # weights, grads (+ Adam moments)
        nbytes = 4.0 * (copies * params + acts)
        runs = float(p["steps"]) * (float(p["ranks"]) if kind == "replay" else 1.0)
        flops = runs * (6.0 * tokens * params + 6.0 * n * b * h * t * t * (d / h))
        return nbytes, flops, "batch, seq, vocab, d_model, d_ff, n_layers and steps"
    return 0.0, 0.0, ""


def expected_steps(spec: "JobSpec", device: str) -> int:
    """How many steps a run of the job records on a device of this type (what a golden holds)."""
    p = spec.params_for(device)
    if spec.kind == "gemm":
        return int(p["chain"])
    if spec.kind == "conv":
        return int(p["layers"])
    if spec.kind in ("train", "llm"):
        return int(p["steps"])
    if spec.kind == "replay":
        return int(p["ranks"]) * int(p["steps"])
    return 1


def check_fits(spec: "JobSpec", device: str, *, free_bytes: Optional[float],
               timeout_s: Optional[float] = None, shapes: Optional[Sequence[tuple[int, int]]] = None,
               threads: int = 1) -> None:
    """Refuse, before anything is allocated, a job this device cannot hold or cannot finish
    within timeout_s even at PEAK_FLOPS: BadInputError naming the spec and the fields."""
    p = spec.params_for(device)
    nbytes, flops, fields = estimate(spec.kind, p, shapes)
    where = spec.path or spec.name
    if free_bytes is not None and nbytes > 0.9 * free_bytes:
        raise BadInputError(f"{where}: job {spec.name} needs about {nbytes / 2**30:.2f} GiB but "
                            f"{device} has {free_bytes / 2**30:.2f} GiB free: reduce {fields}")
    kind = device.split(":")[0]
    rate = PEAK_FLOPS.get(kind, PEAK_FLOPS["cpu"]) * (max(1, threads) if kind == "cpu" else 1)
    if timeout_s is not None and flops / rate > timeout_s:
        raise BadInputError(f"{where}: job {spec.name} needs about {flops:.2g} floating-point "
                            f"operations, more than {device} can do in the {timeout_s:g} s "
                            f"timeout even at {rate:.0e}/s: reduce {fields}")


def load_job(path: str | os.PathLike[str]) -> JobSpec:
    """Parse and validate one jobs/*.toml; the job's name must equal the file's stem."""
    p = Path(path)
    try:
        raw = boundedjson.read_regular(p, MAX_SPEC_BYTES)
    except OSError as e:
        raise ConfigError(f"{p}: cannot read job spec: {e.strerror or e}") from e
    except ValueError as e:
        raise ConfigError(f"{p}: cannot read job spec: {e}") from None
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ConfigError(f"{p}: not UTF-8 text (byte {e.start})") from None
    except RecursionError:
        raise ConfigError(f"{p}: not valid TOML: nested too deeply") from None
    except ValueError as e:  # TOMLDecodeError, a huge integer
        raise ConfigError(f"{p}: not valid TOML: {str(e).splitlines()[0] if str(e) else e}") from None
    if boundedjson.depth(data) > 8:
        raise ConfigError(f"{p}: nested deeper than a job spec can be")
    spec = JobSpec.from_dict({**data, "path": str(p)}, source=str(p))
    if spec.name != p.stem:
        raise ConfigError(f"{p}: job name {spec.name!r} differs from the file name {p.stem!r}")
    return spec


def load_jobs(jobs_dir: str | os.PathLike[str] | None = None) -> list[JobSpec]:
    """Every job spec in the folder (default: default_jobs_dir()), sorted by name."""
    d = Path(jobs_dir) if jobs_dir is not None else default_jobs_dir()
    if not d.is_dir():
        raise ConfigError(f"{d}: jobs folder does not exist")
    return sorted((load_job(p) for p in d.glob("*.toml")), key=lambda s: s.name)


def select_jobs(names: Optional[Sequence[str]] = None, *, jobs_dir: str | os.PathLike[str] | None = None,
                quick_only: bool = False) -> list[JobSpec]:
    """The named jobs (in the order given), or all (quick_only: the quick screen) when none named.

    selftest jobs are only ever run when named.
    """
    available = load_jobs(jobs_dir)
    by_name = {s.name: s for s in available}
    if names:
        missing = [n for n in names if n not in by_name]
        if missing:
            raise BadInputError(f"unknown job(s) {', '.join(missing)}; available: "
                                f"{', '.join(sorted(by_name)) or 'none'}")
        return [by_name[n] for n in dict.fromkeys(names)]
    return [s for s in available if s.kind != "selftest" and (s.quick or not quick_only)]


def describe(specs: Iterable[JobSpec]) -> list[dict[str, Any]]:
    """One row per job for listings: name, kind, version, quick, spec hash, description."""
    return [{"name": s.name, "kind": s.kind, "version": s.version, "quick": s.quick,
             "spec_hash": s.spec_hash, "description": s.description} for s in specs]
