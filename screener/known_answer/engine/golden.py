"""Golden records: the known answers of a job on one platform, as plain diffable JSON files.

One file per (job, result): `<job>.<platform_hash>.json` in the golden folder, named by the
platform it was first recorded on. It holds the schema version, the job's name, version and spec
hash, the platform signature and its numeric hash, how it was recorded (devices, repeats, host,
time, screener version), the results (per step the loss bits in hex and every tensor's
fingerprint), their digest, and a sha256 over the canonical content.

Loading validates everything: a file that is truncated, edited, of another schema, misnamed or
recorded for another version of the job raises GoldenError (exit 2) with one line naming the file
and the problem. The checksum catches corruption, not tampering (anyone can recompute it), so the
content is validated for meaning too: the file is parsed within bounds (screener.boundedjson: no
NaN or infinity, no huge integer, no key twice in an object, bounded nesting and size), steps are
numbered 0..n-1 with distinct labels, every loss is a finite float bit pattern, every fingerprint a
pair of signed 64-bit values, and with its job spec, the number of steps is the one the spec
implies on the recorded device and every loss has the width of the loss the job's kind records
(float32 for train and replay, none for gemm and conv). A broken golden is bad input (exit 2),
never a hardware verdict: a device compared with a NaN, a 16-bit pattern or a missing loss would
differ from it and read as suspect. Golden files are written only by `screener golden record`
(record_from_results + write), atomically.

Schema 2 adds `also`: the other platforms (hash, signature, how recorded) whose devices gave the
same bits, added by `golden record` instead of writing a copy. A record without `also` is still
written as schema 1, and schema 1 files load as before.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from screener.atomicfile import write_atomic
from screener import __version__, boundedjson
from screener.errors import GoldenError
from screener.known_answer.engine.packagedata import data_dir
from screener.known_answer.verdict.results import (Difference, JobResult, Step, canonical_json,
                                          first_difference, steps_digest)
from screener.known_answer.engine.specs import JobSpec, expected_steps
from screener.types import printable_text, shown

SCHEMA = 1
SCHEMA_ALSO = 2  # a record that lists other platforms with the same bits (field "also")
MAX_ALSO = 1000
_HASH_RE = re.compile(r"^[0-9a-f]{16}$")
GOLDEN_DIR_ENV = "SCREENER_GOLDEN_DIR"
_FIELDS = ("schema", "job", "job_version", "spec_hash", "platform", "platform_hash", "recorded",
           "digest", "steps", "sha256")
_RECORDED_FIELDS = ("devices", "repeats", "host", "time", "screener_version")
MAX_GOLDEN_BYTES = 64 * 1024 * 1024
MAX_STEPS = 100_000
MAX_TENSORS = 100_000
_I64 = (-(2**63), 2**63 - 1)
_LOSS_RE = re.compile(r"^0x(?:[0-9a-f]{4}|[0-9a-f]{8}|[0-9a-f]{16})$")
# Exponent masks of the float widths whose type the width alone gives (an all-ones exponent is an
# infinity or a NaN). 16-bit patterns could be float16 or bfloat16: only the job says which, and
# spec_problem refuses them for every kind that exists (none records a 16-bit loss).
_EXPONENT_MASK = {8: 0x7F800000, 16: 0x7FF0000000000000}
# The loss width (bits) each kind records, from screener.known_answer.engine.workloads: train and replay
# take synthetic.compute_loss, a cross-entropy over float32 logits (also under bf16/fp16
# autocast), llm its own over float32 logits (screener.known_answer.engine.llm), so their loss is
# float32; gemm, conv and selftest record no loss (None).
LOSS_BITS: Mapping[str, Optional[int]] = {"train": 32, "replay": 32, "llm": 32}


def default_golden_dir() -> Path:
    """$SCREENER_GOLDEN_DIR, or the records shipped with the package (screener._golden: in a
    checkout, the repository's golden/ folder; see screener/known_answer/engine/packagedata.py)."""
    env = os.environ.get(GOLDEN_DIR_ENV)
    if env:
        return Path(env)
    return data_dir("golden")


def golden_path(golden_dir: str | os.PathLike[str], job: str, platform_hash: str) -> Path:
    """Where the golden record of `job` on the platform `platform_hash` lives."""
    return Path(golden_dir) / f"{job}.{platform_hash}.json"


def checksum(content: Mapping[str, Any]) -> str:
    """sha256 over the canonical JSON of every field but sha256 itself."""
    body = {k: v for k, v in content.items() if k != "sha256"}
    return hashlib.sha256(canonical_json(body).encode()).hexdigest()


@dataclass(frozen=True)
class GoldenRecord:
    """A validated golden record (see the module docstring for the file format)."""

    job: str
    job_version: int
    spec_hash: str
    platform: Mapping[str, Any]
    platform_hash: str
    recorded: Mapping[str, Any]
    steps: tuple[Step, ...]
    path: str = field(default="", compare=False)
    # Other platforms whose devices gave these same bits: {"platform_hash", "platform", "recorded"}.
    also: tuple[Mapping[str, Any], ...] = ()

    @property
    def digest(self) -> str:
        return steps_digest(self.steps)

    @property
    def platform_hashes(self) -> tuple[str, ...]:
        """Every platform this record is the golden of: the first, then the added ones."""
        return (self.platform_hash,) + tuple(str(a["platform_hash"]) for a in self.also)

    def platforms(self) -> list[tuple[str, Mapping[str, Any]]]:
        """(hash, signature) of every platform this record is the golden of."""
        return [(self.platform_hash, self.platform)] + [
            (str(a["platform_hash"]), a.get("platform") or {}) for a in self.also]

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "schema": SCHEMA_ALSO if self.also else SCHEMA, "job": self.job,
            "job_version": self.job_version,
            "spec_hash": self.spec_hash, "platform": dict(self.platform),
            "platform_hash": self.platform_hash, "recorded": dict(self.recorded),
            "digest": self.digest, "steps": [s.to_dict() for s in self.steps]}
        if self.also:
            d["also"] = [dict(a) for a in self.also]
        d["sha256"] = checksum(d)
        return d

    def compare(self, result: JobResult) -> Optional[Difference]:
        """Where `result` first differs from this record (None: bit-identical)."""
        return first_difference(self.steps, result.steps)


def _fail(path: Path, problem: str) -> GoldenError:
    return GoldenError(f"golden record {path}: {problem}")


def parse(path: str | os.PathLike[str], text: str) -> GoldenRecord:
    """Validate the text of a golden file; raises GoldenError naming the file and the problem."""
    p = Path(path)
    try:
        d = boundedjson.loads(text, max_bytes=MAX_GOLDEN_BYTES, max_depth=8)
    except ValueError as e:
        raise _fail(p, f"{e}; truncated, corrupted or edited") from None
    if not isinstance(d, dict):
        raise _fail(p, "is not a JSON object")
    if d.get("schema") not in (SCHEMA, SCHEMA_ALSO):
        raise _fail(p, f"schema {d.get('schema')!r} is not a supported schema "
                       f"({SCHEMA} or {SCHEMA_ALSO})")
    missing = [k for k in _FIELDS if k not in d]
    if d["schema"] == SCHEMA_ALSO and "also" not in d:
        missing.append("also")
    if missing:
        raise _fail(p, f"missing field(s) {', '.join(missing)}")
    unknown = sorted(set(d) - set(_FIELDS) - ({"also"} if d["schema"] == SCHEMA_ALSO else set()))
    if unknown:
        raise _fail(p, f"unknown field(s) {', '.join(unknown)}")
    if not isinstance(d["sha256"], str) or d["sha256"] != checksum(d):
        raise _fail(p, "checksum mismatch: the content changed after it was recorded "
                       "(edited or corrupted); re-record it with `screener golden record`")
    for key, typ in (("job", str), ("spec_hash", str), ("platform_hash", str), ("digest", str),
                     ("platform", dict), ("recorded", dict), ("steps", list)):
        if not isinstance(d[key], typ):
            raise _fail(p, f"field {key!r} is not a {typ.__name__}")
    if not isinstance(d["job_version"], int) or isinstance(d["job_version"], bool):
        raise _fail(p, "field 'job_version' is not an integer")
    missing = [k for k in _RECORDED_FIELDS if k not in d["recorded"]]
    if missing:
        raise _fail(p, f"'recorded' lacks {', '.join(missing)}")
    took = d["recorded"].get("seconds")
    if took is not None and (isinstance(took, bool) or not isinstance(took, (int, float))
                             or not 0 <= took <= 1e7):
        raise _fail(p, f"'recorded' seconds {str(took)[:40]} is not a job time in seconds")
    problem = _steps_problem(d["steps"]) or _also_problem(d)
    if problem:
        raise _fail(p, problem)
    try:
        steps = tuple(Step.from_dict(s) for s in d["steps"])
    except (KeyError, TypeError, ValueError) as e:
        raise _fail(p, f"malformed step ({type(e).__name__}: {e})") from None
    if steps_digest(steps) != d["digest"]:
        raise _fail(p, "digest does not match its steps")
    if p.name != golden_path(".", d["job"], d["platform_hash"]).name:
        raise _fail(p, f"file name does not match its content (job {d['job']!r}, platform "
                       f"{d['platform_hash']!r}: expected {d['job']}.{d['platform_hash']}.json)")
    return GoldenRecord(job=d["job"], job_version=d["job_version"], spec_hash=d["spec_hash"],
                        platform=d["platform"], platform_hash=d["platform_hash"],
                        recorded=d["recorded"], steps=steps, path=str(p),
                        also=tuple(d.get("also") or ()))


def _also_problem(d: Mapping[str, Any]) -> str:
    """What is wrong with a schema-2 record's `also` list ("" when nothing is)."""
    if "also" not in d:
        return ""
    also = d["also"]
    if not isinstance(also, list) or not also or len(also) > MAX_ALSO:
        return f"'also' is not a list of 1 to {MAX_ALSO} platforms"
    seen = {d["platform_hash"]}
    for i, a in enumerate(also):
        if not isinstance(a, dict) or set(a) != {"platform_hash", "platform", "recorded"}:
            return f"'also' entry {i} is not an object with platform_hash, platform and recorded"
        h = a["platform_hash"]
        if not isinstance(h, str) or not _HASH_RE.match(h) or h in seen:
            return f"'also' entry {i}: platform_hash {str(h)[:40]!r} is not a new 16-hex-digit hash"
        seen.add(h)
        if not isinstance(a["platform"], dict) or not isinstance(a["recorded"], dict):
            return f"'also' entry {i}: platform and recorded must be objects"
    return ""


def _steps_problem(steps: Any) -> str:
    """What is wrong with the content of a record's steps ("" when nothing is)."""
    if not steps:
        return "has no steps"
    if len(steps) > MAX_STEPS:
        return f"has {len(steps)} steps (at most {MAX_STEPS})"
    labels: dict[str, int] = {}  # every step present once: a copied step keeps its label
    for i, s in enumerate(steps):
        if not isinstance(s, dict) or set(s) != {"step", "label", "loss", "tensors"}:
            return f"step {i} is not an object with step, label, loss and tensors"
        if type(s["step"]) is not int or s["step"] != i:
            return f"step {i} is numbered {str(s['step'])[:40]} (steps run 0..n-1 in order)"
        if not isinstance(s["label"], str) or len(s["label"]) > 200:
            return f"step {i} label is not a short string"
        try:
            printable_text(s["label"], f"step {i} label", 200)
        except ValueError as e:
            return str(e)
        problem = _loss_problem(s["loss"])
        if problem:
            return f"step {i} loss {problem}"
        if s["label"] in labels:
            return f"step {i} repeats the label {s['label'][:80]!r} of step {labels[s['label']]}"
        labels[s["label"]] = i
        tensors = s["tensors"]
        if not isinstance(tensors, list) or len(tensors) > MAX_TENSORS:
            return f"step {i} tensors is not a list of at most {MAX_TENSORS}"
        if not tensors:  # issue 36.6: a step of no tensors compares nothing (gemm, conv)
            return (f"step {i} records no tensor: a golden must compare something in every "
                    f"step")
        names = set()
        for t in tensors:
            if not isinstance(t, list) or len(t) != 3 or not isinstance(t[0], str) or not t[0]:
                return f"step {i}: tensor entry {shown(str(t)[:60])} is not [name, fp1, fp2]"
            try:
                printable_text(t[0], f"step {i} tensor name", 200)
            except ValueError as e:
                return str(e)
            for v in t[1:]:
                if type(v) is not int or not _I64[0] <= v <= _I64[1]:
                    return (f"step {i} tensor {t[0][:80]}: fingerprint {str(v)[:40]} is not a "
                            f"signed 64-bit value")
            if t[0] in names:
                return f"step {i}: tensor {t[0][:80]} listed twice"
            names.add(t[0])
    return ""


def _loss_problem(loss: Any) -> str:
    """What is wrong with one step's loss as written ("" when nothing is): None, or the hex bit
    pattern of a 16, 32 or 64-bit float that, where the width gives the type, is finite."""
    if loss is None:
        return ""
    if not isinstance(loss, str) or not _LOSS_RE.match(loss):
        return f"{str(loss)[:40]!r} is not a float bit pattern (0x + 4, 8 or 16 hex digits)"
    mask = _EXPONENT_MASK.get(len(loss) - 2)
    if mask is not None and int(loss, 16) & mask == mask:
        # A run that produced NaN or an infinity is not a known answer: a golden made of one
        # would call every healthy device different.
        return f"{loss} is a NaN or an infinity, not a known answer"
    return ""


def _loss_width_problem(record: GoldenRecord, spec: JobSpec) -> str:
    """Where a step's loss is not of the width the job's kind records ("" when none is)."""
    want = LOSS_BITS.get(spec.kind)
    for s in record.steps:
        bits = None if s.loss is None else (len(s.loss) - 2) * 4
        if bits != want:
            have = "no loss" if bits is None else f"a {bits}-bit loss {s.loss}"
            need = "no loss" if want is None else f"a {want}-bit (float{want}) loss"
            return f"step {s.step} has {have}, but a {spec.kind} job records {need}"
    return ""


def spec_problem(record: GoldenRecord, spec: JobSpec) -> str:
    """What in the record contradicts its job spec ("" when nothing does): the number of steps the
    spec implies on the device the record was made on, and the width of every loss."""
    device = str(record.platform.get("device") or "cpu")
    try:
        want = expected_steps(spec, device)
    except (KeyError, TypeError, ValueError):
        want = len(record.steps)  # a spec the kind's table cannot size: the count is unchecked
    if len(record.steps) != want:
        return (f"has {len(record.steps)} steps but job {spec.name} implies {want} on "
                f"{device.split(':')[0]}")
    return _loss_width_problem(record, spec)


def load(path: str | os.PathLike[str], *, spec: Optional[JobSpec] = None,
         platform_hash: Optional[str] = None) -> GoldenRecord:
    """Load and validate a golden file; with `spec`/`platform_hash`, also check it is for them."""
    p = Path(path)
    try:
        raw = boundedjson.read_regular(p, MAX_GOLDEN_BYTES)
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise _fail(p, "is not UTF-8 text; corrupted") from None
    except OSError as e:
        raise _fail(p, f"cannot be read: {e.strerror or e}") from e
    except ValueError as e:
        raise _fail(p, f"cannot be read: {e}") from None
    record = parse(p, text)
    if spec is not None:
        if record.job != spec.name:
            raise _fail(p, f"is for job {record.job!r}, not {spec.name!r}")
        if record.spec_hash != spec.spec_hash:
            raise _fail(p, f"was recorded for spec hash {record.spec_hash} (version "
                           f"{record.job_version}) but {spec.path or spec.name} now hashes to "
                           f"{spec.spec_hash} (version {spec.version}): the job changed; re-record "
                           f"with `screener golden record --job {spec.name}`")
        problem = spec_problem(record, spec)
        if problem:
            raise _fail(p, problem)
    if platform_hash is not None and platform_hash not in record.platform_hashes:
        raise _fail(p, f"is for platform {record.platform_hash}, not {platform_hash}")
    return record


def job_records(golden_dir: str | os.PathLike[str], spec: JobSpec) -> list[GoldenRecord]:
    """Every golden record of `spec` in the folder (any platform); GoldenError for a broken or
    stale one."""
    return [load(p, spec=spec) for p in sorted(Path(golden_dir).glob(f"{spec.name}.*.json"))
            if _HASH_RE.match(p.name[len(spec.name) + 1:-len(".json")])]


def find(golden_dir: str | os.PathLike[str], spec: JobSpec,
         platform_hash: str) -> Optional[GoldenRecord]:
    """The golden record of `spec` on `platform_hash` (its own file, or a record that lists the
    platform in `also`), None when there is none; GoldenError when a file is broken or stale."""
    p = golden_path(golden_dir, spec.name, platform_hash)
    if p.exists():
        return load(p, spec=spec, platform_hash=platform_hash)
    return next((r for r in job_records(golden_dir, spec) if platform_hash in r.platform_hashes),
                None)


def find_siblings(golden_dir: str | os.PathLike[str], spec: JobSpec,
                  platform: Mapping[str, Any]) -> list[GoldenRecord]:
    """The golden records of `spec` recorded on sibling platforms of `platform` (same kind,
    torch build and dispatch level or GPU model: screener.known_answer.engine.platform.sibling_key) but not on
    `platform` itself: what a device without a golden of its own is compared with."""
    # platform imports torch at its top (1-5 s); golden is read by the CLI and by the parent of
    # a screen, which must stay light, and only a device without a golden gets here.
    from screener.known_answer.engine.platform import sibling_key

    key = sibling_key(dict(platform))
    if key is None:
        return []
    own = platform.get("numeric_hash")
    return [r for r in job_records(golden_dir, spec) if own not in r.platform_hashes
            and any(sibling_key(dict(pl)) == key for _, pl in r.platforms())]


def add_platform(record: GoldenRecord, platform: Mapping[str, Any], platform_hash: str,
                 recorded: Mapping[str, Any]) -> GoldenRecord:
    """The record with one more platform whose devices gave the same bits (see `also`)."""
    if platform_hash in record.platform_hashes:
        return record
    entry = {"platform_hash": platform_hash, "platform": dict(platform),
             "recorded": dict(recorded)}
    return replace(record, also=tuple(record.also) + (entry,))


def load_dir(golden_dir: str | os.PathLike[str]) -> tuple[list[GoldenRecord], list[GoldenError]]:
    """Every golden record of a folder: the valid ones and one error per broken file."""
    records, errors = [], []
    for p in sorted(Path(golden_dir).glob("*.json")):
        try:
            records.append(load(p))
        except GoldenError as e:
            errors.append(e)
    return records, errors


def record_from_results(spec: JobSpec, platform: Mapping[str, Any], platform_hash: str,
                        results: Sequence[tuple[str, JobResult]], *, repeats: int,
                        host: Optional[str] = None, now: Optional[float] = None,
                        screener_version: Optional[str] = None) -> GoldenRecord:
    """A golden record from (device, result) runs that must all agree bit for bit.

    Raises GoldenError naming the first disagreement: a golden is never recorded from runs that
    do not agree (the caller prints the disagreement instead).
    """
    if not results:
        raise GoldenError(f"no results to record for job {spec.name}")
    ref_device, ref = results[0]
    for device, r in results[1:]:
        diff = first_difference(ref.steps, r.steps)
        if diff is not None:
            raise GoldenError(f"job {spec.name}: runs disagree, refusing to record: {device} differs "
                              f"from {ref_device} at step {diff.step} ({diff.label}) tensor "
                              f"{diff.tensor}: {diff.expected} vs {diff.observed}")
    if any(r.spec_hash != spec.spec_hash for _, r in results):
        raise GoldenError(f"job {spec.name}: results are for another spec hash than {spec.spec_hash}")
    if screener_version is None:
        screener_version = __version__
    stamp = time.gmtime(time.time() if now is None else now)
    return GoldenRecord(
        job=spec.name, job_version=spec.version, spec_hash=spec.spec_hash,
        platform=dict(platform), platform_hash=platform_hash,
        recorded={"devices": sorted({d for d, _ in results}), "repeats": repeats,
                  "host": host or socket.gethostname(),
                  "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", stamp),
                  "screener_version": screener_version,
                  # how long one run took: lets a lone device's timeout count as a hang
                  "seconds": round(max(r.seconds for _, r in results), 4)},
        steps=ref.steps)


def format_record(record: GoldenRecord) -> str:
    """The file text: one field per line, one tensor per line, so a diff shows what changed."""
    d = record.to_dict()
    steps = d.pop("steps")
    sha = d.pop("sha256")
    also = d.pop("also", None)
    lines = ["{"]
    lines += [f" {json.dumps(k)}: {json.dumps(v, sort_keys=True)}," for k, v in d.items()]
    if also is not None:
        lines.append(' "also": [')
        lines += [f"  {json.dumps(a, sort_keys=True)}{',' if i < len(also) - 1 else ''}"
                  for i, a in enumerate(also)]
        lines.append(" ],")
    lines.append(' "steps": [')
    for i, step in enumerate(steps):
        head = {k: step[k] for k in ("step", "label", "loss")}
        lines.append(f"  {json.dumps(head)[:-1]}, \"tensors\": [")
        tensors = step["tensors"]
        for j, t in enumerate(tensors):
            lines.append(f"   {json.dumps(t)}{',' if j < len(tensors) - 1 else ''}")
        lines.append(f"  ]}}{',' if i < len(steps) - 1 else ''}")
    lines.append(" ],")
    lines.append(f' "sha256": {json.dumps(sha)}')
    lines.append("}")
    return "\n".join(lines) + "\n"


def write(record: GoldenRecord, golden_dir: str | os.PathLike[str]) -> Path:
    """Write the record to its file in golden_dir (screener.atomicfile); returns the path."""
    d = Path(golden_dir)
    d.mkdir(parents=True, exist_ok=True)
    p = golden_path(d, record.job, record.platform_hash)
    return write_atomic(p, format_record(record), public=True)
