"""The NVIDIA command-line tools the repair ladder drives: `nvidia-smi` (the compute processes on
each GPU, and `nvidia-smi -r`, the GPU reset) and `dcgmi diag` (DCGM's active diagnostics, the
corroboration on entry to quarantine).

Each tool is run as a child process with a time limit, found on the PATH it is given, and its
text output is parsed here. What a tool says about the hardware is a result; a tool that is
missing, times out, exits non-zero without its result table, or prints what we cannot read is
OUR failure (`ToolResult.error`), never a hardware verdict in either direction.

Formats (real output, quoted in tests/data/gpu_tools/ with its sources in SOURCES.md there):
  nvidia-smi --query-compute-apps=gpu_uuid,pid,process_name --format=csv,noheader
      one line per process, "GPU-a008e90f-259e-df57-7988-63b6831fff68, 6374,
      /usr/NX/bin/nxnode.bin"; nothing when no process runs.
  nvidia-smi -r -i <index>
      "GPU 00000000:1A:00.0 was successfully reset." (and "All done." when it resets several),
      exit 0. A refusal lists the GPUs: "The following GPUs could not be reset:" then
      "  GPU 00000000:0B:00.0: In use by another client" (or ": Not Supported"), exit 255 for the
      former; older drivers and other refusals say "Unable to reset GPU <bus>: Insufficient
      Permissions" or "Unable to reset GPU <bus> because it's being used by some other process".
      Exit codes are the man page's RETURN VALUE list (3 not supported, 4 no permission, 255
      other). Anything but exit 0 with the success sentence and no refusal is our failure.
  dcgmi diag -r <level>
      "Successfully ran diagnostic for group." and a table under Metadata / Deployment /
      Hardware / Integration / Stress. DCGM 3.x: one row per status, the test's name on the first
      only ("| Targeted Power | Pass - GPUs: 0, 2, 3 |" then "|  | Fail - GPU: 1 |"), level-1
      rows a bare "Pass"/"Fail". DCGM 4.x: the test's row ("| memory | Fail |", where Warn prints
      "Warn") then one nameless row per GPU ("|  | GPU1: Fail |", a GPU's warning also printed
      "Fail"). "Warning", "Info" and "Error" rows carry messages wrapped over nameless rows. After
      the table dcgmi exits 226 (DCGM_ST_NVVS_ERROR) or 205 (DCGM_ST_NVVS_ISOLATE_ERROR) when a
      test failed, 0 otherwise. `dcgmi diag -j` is not used: its schema differs between 3.x and
      4.x and 4.x's JSON writes a warning as "Fail" (NVIDIA/DCGM dcgmi/Diag.cpp).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

TOOL_TIMEOUT_S = 60.0
DIAG_TIMEOUT_S = 1800.0  # level 2 takes about two minutes, level 3 about fifteen
_OUTPUT_KEEP = 2000  # characters of a tool's output kept as evidence (the history is bounded)


@dataclass(frozen=True)
class ToolResult:
    """One run of a tool: its command, exit code, output, and our error (if we failed)."""

    argv: tuple[str, ...]
    returncode: Optional[int]
    output: str
    error: str = ""  # set when the tool could not run or be read: our failure, not a verdict

    def to_dict(self) -> dict[str, Any]:
        return {"argv": list(self.argv), "returncode": self.returncode,
                "output": self.output[-_OUTPUT_KEEP:], "error": self.error}


def run_tool(argv: Sequence[str], *, env: Optional[Mapping[str, str]] = None,
             timeout_s: float = TOOL_TIMEOUT_S) -> ToolResult:
    """Run `argv` (its first word looked up on env's PATH), stdout and stderr together."""
    path = (env or {}).get("PATH") if env is not None else None
    exe = shutil.which(argv[0], path=path)
    if exe is None:
        return ToolResult(tuple(argv), None, "", f"{argv[0]} not found on PATH")
    try:
        done = subprocess.run([exe, *argv[1:]], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              stdin=subprocess.DEVNULL, timeout=timeout_s, check=False,
                              env=dict(env) if env is not None else None)
    except subprocess.TimeoutExpired:
        return ToolResult(tuple(argv), None, "", f"{argv[0]} did not finish in {timeout_s:g} s")
    except OSError as e:
        return ToolResult(tuple(argv), None, "", f"cannot run {argv[0]}: {e.strerror or e}")
    return ToolResult(tuple(argv), done.returncode, done.stdout.decode("utf-8", "replace"))


def available(tool: str, env: Optional[Mapping[str, str]] = None) -> bool:
    """Whether `tool` is on env's PATH (dcgmi is optional: no DCGM, no corroboration)."""
    return shutil.which(tool, path=(env or {}).get("PATH") if env is not None else None) is not None


# --- nvidia-smi -------------------------------------------------------------------------------------

# nvidia-smi's words for "no process" in its table view; harmless to accept in the CSV one.
_NO_PROCESS = re.compile(r"^\s*No running processes found\s*$")


@dataclass(frozen=True)
class ComputeApp:
    """One process on a GPU, as nvidia-smi --query-compute-apps reports it."""

    gpu_uuid: str
    pid: int
    name: str


def compute_apps(nvidia_smi: str = "nvidia-smi", *, env: Optional[Mapping[str, str]] = None
                 ) -> tuple[list[ComputeApp], ToolResult]:
    """The compute processes on every GPU; the list is empty when the query failed (check
    result.error: a failed query must never read as "no process")."""
    res = run_tool([nvidia_smi, "--query-compute-apps=gpu_uuid,pid,process_name",
                    "--format=csv,noheader"], env=env)
    return read_compute_apps(res)


def read_compute_apps(res: ToolResult) -> tuple[list[ComputeApp], ToolResult]:
    """The processes one finished compute-process query listed (see compute_apps)."""
    if res.error or res.returncode != 0:
        return [], _failed(res, "the compute-process query failed")
    apps = []
    for line in res.output.splitlines():
        if not line.strip() or _NO_PROCESS.match(line):
            continue
        parts = [p.strip() for p in line.split(",", 2)]
        if len(parts) != 3 or not parts[1].isdigit():
            return [], _failed(res, f"unreadable compute-process line {line.strip()[:120]!r}")
        apps.append(ComputeApp(parts[0], int(parts[1]), parts[2]))
    return apps, res


_BUS = r"[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-9A-Fa-f]"
_RESET_OK = re.compile(rf"^GPU {_BUS} was successfully reset\.\s*$", re.M)
# The refusals we know, each giving the reason: the list under "The following GPUs could not be
# reset:" ("  GPU <bus>: In use by another client"), and "Unable to reset GPU <bus>: <reason>" or
# "Unable to reset GPU <bus> because <reason>".
_RESET_LISTED = re.compile(rf"^\s+GPU {_BUS}: (?P<why>.+?)\s*$", re.M)
_RESET_UNABLE = re.compile(rf"^Unable to reset GPU {_BUS}(?::\s*| because )(?P<why>.+?)\s*$", re.M)
_RESET_REFUSED = re.compile(r"could not be reset|Unable to reset GPU", re.I)
# nvidia-smi(1), RETURN VALUE.
SMI_EXIT = {2: "a supplied argument or flag is invalid",
            3: "the requested operation is not available on target device",
            4: "the current user does not have permission to access this device or perform "
               "this operation",
            6: "a query to find an object was unsuccessful",
            9: "NVIDIA driver is not loaded",
            12: "NVML shared library could not be found or loaded",
            15: "the GPU has fallen off the bus or has otherwise become inaccessible",
            255: "other error or internal driver error occurred"}


def reset_gpu(index: int, nvidia_smi: str = "nvidia-smi", *,
              env: Optional[Mapping[str, str]] = None) -> ToolResult:
    """`nvidia-smi -r -i INDEX`; error set unless it exits 0, says the GPU was reset and refuses
    nothing. A refusal (known or not) is our failure: the reset did not happen."""
    res = run_tool([nvidia_smi, "-r", "-i", str(index)], env=env)
    if res.error:
        return res
    return _failed(res, why) if (why := reset_refusal(res.returncode, res.output, index)) else res


def reset_refusal(returncode: Optional[int], output: str, index: int) -> str:
    """Why `nvidia-smi -r -i INDEX` did not reset the GPU, or "" when it did."""
    if returncode == 0 and _RESET_OK.search(output) and not _RESET_REFUSED.search(output):
        return ""
    m = _RESET_LISTED.search(output) or _RESET_UNABLE.search(output)
    if m:
        reason = m.group("why")
    else:
        lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
        reason = lines[0] if lines else "no output"
    meaning = SMI_EXIT.get(returncode) if returncode is not None else None
    return (f"GPU {index} was not reset (exit {returncode}): {reason[:200]}"
            + (f" [nvidia-smi: {meaning}]" if meaning else ""))


def _failed(res: ToolResult, why: str) -> ToolResult:
    return ToolResult(res.argv, res.returncode, res.output, res.error or why)


# --- dcgmi diag ------------------------------------------------------------------------------------

_STATUS = r"(?P<st>Pass|Fail|Warn|Skip|Not Run)"
_CELLS = re.compile(r"^\|(?P<name>[^|]*)\|(?P<value>.*)\|\s*$")
# A test's own row: "Pass" (3.x level 1, 4.x), "Pass - All", "Fail - GPU: 1", "Pass - GPUs: 0, 2".
_TEST_VALUE = re.compile(rf"^{_STATUS}(?: - (?:All|GPUs?: [0-9][0-9, ]*))?$")
# A nameless row that belongs to the test above it: 3.x "Fail - GPU: 1" / "Warn - GPUs: 2, 3",
# 4.x "GPU1: Fail" (any entity group: GPU, CPU, ...).
_MORE_3X = re.compile(rf"^{_STATUS} - (?:All|GPUs?: [0-9][0-9, ]*)$")
_MORE_4X = re.compile(rf"^(?P<entity>[A-Za-z_]+[0-9]+): {_STATUS}$")
_MESSAGE_ROWS = ("Warning", "Info", "Error")
_HEADER_ROW = ("Diagnostic", "Result")
EXIT_NVVS_ERROR, EXIT_NVVS_ISOLATE = 226, 205  # DCGM_ST_NVVS_ERROR -30, ..._ISOLATE_ERROR -51


@dataclass(frozen=True)
class DiagResult:
    """What `dcgmi diag -r LEVEL` said: passed (no test failed), the failed tests, every test's
    result rows ("Pass - GPUs: 0, 2, 3; Fail - GPU: 1", or "Fail; GPU0: Pass; GPU1: Fail")."""

    level: int
    passed: Optional[bool]  # None: no result (our failure, see tool.error)
    failed: tuple[str, ...] = ()
    rows: Mapping[str, str] = field(default_factory=dict)
    tool: Optional[ToolResult] = None
    version: str = ""  # "DCGM Version" from the table's Metadata, when it prints one

    def to_dict(self) -> dict[str, Any]:
        return {"level": self.level, "passed": self.passed, "failed": list(self.failed),
                "rows": dict(self.rows), "version": self.version,
                "tool": self.tool.to_dict() if self.tool else None}


@dataclass
class _Test:
    results: list[str] = field(default_factory=list)
    failed: bool = False


def parse_diag_table(output: str) -> tuple[dict[str, _Test], str]:
    """Every test row of a `dcgmi diag` table (DCGM 3.x or 4.x) and the DCGM version."""
    tests: dict[str, _Test] = {}
    version, current = "", None
    for line in output.splitlines():
        m = _CELLS.match(line.strip())
        if not m:
            continue
        name, value = m.group("name").strip(), m.group("value").strip()
        if name.startswith("---") or (name, value) == _HEADER_ROW:
            continue  # a section's heading, or the table's
        if name == "DCGM Version":
            version = value
            continue
        if name.split(":")[0] in _MESSAGE_ROWS:  # "Warning", "Warning: GPU0", "Info", "Error"
            continue  # (not a prefix test: "Inforom" is a test)
        if name:
            t = _TEST_VALUE.match(value)
            if not t:
                current = None  # metadata ("Driver Version Detected") or something unknown
                continue
            current = name
            test = tests.setdefault(name, _Test())
            test.results.append(value)
            test.failed |= t.group("st") == "Fail"
            continue
        if current is None:
            continue
        more3, more4 = _MORE_3X.match(value), _MORE_4X.match(value)
        if more3:  # 3.x: the same test, another set of GPUs
            tests[current].results.append(value)
            tests[current].failed |= more3.group("st") == "Fail"
        elif more4:  # 4.x: one GPU; the test's own row says whether it failed (a Warn prints Fail)
            tests[current].results.append(value)
        # anything else nameless is a message wrapped over several rows
    return tests, version


def dcgm_diag(level: int = 2, dcgmi: str = "dcgmi", *, env: Optional[Mapping[str, str]] = None,
              timeout_s: float = DIAG_TIMEOUT_S) -> DiagResult:
    """Run DCGM's diagnostic suite at `level` and read its table. A run that printed no result
    table (DCGM not running, a bad level), or whose exit status contradicts its table, has
    passed=None: no verdict."""
    res = run_tool([dcgmi, "diag", "-r", str(level)], env=env, timeout_s=timeout_s)
    return read_diag(level, res)


def read_diag(level: int, res: ToolResult) -> DiagResult:
    """The verdict of one finished `dcgmi diag` run (see dcgm_diag)."""
    tests, version = parse_diag_table(res.output)
    rows = {name: "; ".join(t.results) for name, t in tests.items()}
    if res.error or not tests:
        first = next((ln.strip() for ln in res.output.splitlines() if ln.strip()), "no output")
        return DiagResult(level, None, tool=_failed(
            res, f"dcgmi diag printed no result table (exit {res.returncode}): {first[:200]}"))
    failed = tuple(name for name, t in tests.items() if t.failed)
    if not failed and res.returncode != 0:
        # dcgmi exits non-zero after its table only when a test failed; a clean table with a
        # failing exit is something we cannot read, not a pass.
        return DiagResult(level, None, (), rows, _failed(
            res, f"dcgmi diag exited {res.returncode} but its table shows no failed test"), version)
    return DiagResult(level, not failed, failed, rows, res, version)
