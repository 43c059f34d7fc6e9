"""Fake NVIDIA tools on a PATH of their own: `nvidia-smi` and `dcgmi` executables that print what
the real tools print (the formats, with their sources, in tests/data/gpu_tools/SOURCES.md), log
every call, and fail on demand through files in their state folder:

- `apps`: the lines `nvidia-smi --query-compute-apps=gpu_uuid,pid,process_name --format=csv,
  noheader` prints ("GPU-<uuid>, <pid>, <process name>"); absent or empty: no process.
- `reset_fails`: `nvidia-smi -r` refuses. Its text picks the refusal: empty or "in_use" (the
  "The following GPUs could not be reset: ... In use by another client" list, exit 255, as seen on
  real nodes), "not_supported" (the same list with "Not Supported"; exit 3, the man page's code,
  not seen in a run), "permissions" ("Unable to reset GPU <bus>: Insufficient Permissions"; exit 4,
  likewise), or any other text, printed as it is with exit 255 (a refusal we do not know).
- `diag_fails`: `dcgmi diag` reports GPU 1 failing its memory test (the text: another GPU index).
- `dcgm_version`: "3" prints DCGM 3.x's table, otherwise 4.x's (DCGM 4.4.2).

Also a reboot command that logs its call and can fail the same way."""

from __future__ import annotations

import sys
from pathlib import Path

NVIDIA_SMI = r'''#!{python}
import os, pathlib, sys
d = pathlib.Path(os.environ["FAKE_GPU_DIR"])
args = sys.argv[1:]
with open(d / "calls", "a") as f:
    f.write("nvidia-smi " + " ".join(args) + "\n")
if args and args[0].startswith("--query-compute-apps="):
    apps = d / "apps"
    sys.stdout.write(apps.read_text() if apps.exists() else "")
    sys.exit(0)
if args[:1] == ["-r"]:
    bus = "00000000:%02X:00.0" % (7 + int(args[args.index("-i") + 1]))
    fails = d / "reset_fails"
    if fails.exists():
        kind = fails.read_text().strip() or "in_use"
        if kind == "in_use":  # NVSentinel issue 1690; nvidia-mig-manager's log: exit status 255
            print("\nThe following GPUs could not be reset:\n  GPU %s: In use by another client\n\n"
                  "1 device is currently being used by one or more other processes (e.g., Fabric "
                  "Manager, CUDA application, graphics application such as an X server, or a "
                  "monitoring application such as another instance of nvidia-smi). Please first "
                  "kill all processes using this device and all compute applications running in "
                  "the system." % bus)
            sys.exit(255)
        if kind == "not_supported":  # yandex-cloud/docs ru/compute/operations/enable-mig.md
            print("The following GPUs could not be reset:\n  GPU %s: Not Supported" % bus)
            sys.exit(3)
        if kind == "permissions":
            print("Unable to reset GPU %s: Insufficient Permissions" % bus)
            sys.exit(4)
        print(kind)
        sys.exit(255)
    print("GPU %s was successfully reset." % bus)  # NVSentinel issue 1690: `-r -i`, exit 0
    sys.exit(0)
sys.exit(2)  # nvidia-smi(1): "A supplied argument or flag is invalid"
'''

# dcgmi diag's table: the layout of NVIDIA/DCGM dcgmi/Diag.cpp (v3.3.9 and v4.6.0), as in the real
# runs quoted in tests/data/gpu_tools/ (dcgm3_fail_3.3.9.txt, dcgm4_r2_pass_4.4.2.txt). Two GPUs.
# The failure message is DCGM_FR_FAULTY_MEMORY's (dcgmlib/dcgm_errors.h) and its next step.
DCGMI = r'''#!{python}
import os, pathlib, sys
d = pathlib.Path(os.environ["FAKE_GPU_DIR"])
with open(d / "calls", "a") as f:
    f.write("dcgmi " + " ".join(sys.argv[1:]) + "\n")
fails = d / "diag_fails"
bad = int(fails.read_text().strip() or 1) if fails.exists() else None
v3 = (d / "dcgm_version").exists() and (d / "dcgm_version").read_text().strip() == "3"
gpus = (0, 1)
rule = "+---------------------------+------------------------------------------------+"
out = ["Successfully ran diagnostic for group.", rule,
       "| Diagnostic                | Result                                         |",
       "+===========================+================================================+",
       "|-----  Metadata  ----------+------------------------------------------------|"]

def row(name, value):
    out.append("| %-25s | %-46s |" % (name, value))

def wrapped(name, msg):
    for i in range(0, len(msg), 45):
        row(name if i == 0 else "", msg[i:i + 45])

msg = ("Found 1 faulty memory elements on GPU %d Run a field diagnostic on the GPU." % bad
       if bad is not None else "")
if v3:
    row("DCGM Version", "3.3.9")
    row("Driver Version Detected", "570.195.03")
    row("GPU Device IDs Detected", ",".join("2330" for _ in gpus))
    out.append("|-----  Deployment  --------+------------------------------------------------|")
    for name in ("Denylist", "NVML Library", "CUDA Main Library", "Permissions and OS Blocks",
                 "Persistence Mode", "Environment Variables", "Page Retirement/Row Remap",
                 "Graphics Processes", "Inforom"):
        row(name, "Pass")
    out.append("+-----  Integration  -------+------------------------------------------------+")
    row("PCIe", "Pass - All")
    out.append("+-----  Hardware  ----------+------------------------------------------------+")
    if bad is None:
        row("GPU Memory", "Pass - All")
    else:
        good = [g for g in gpus if g != bad]
        row("GPU Memory", "Pass - GPU%s: %s   " % ("s" if len(good) > 1 else "",
                                                   ", ".join(map(str, good))))
        row("", "Fail - GPU: %d   " % bad)
        wrapped("Warning", "GPU %d %s" % (bad, msg))
else:
    row("DCGM Version", "4.4.2")
    row("Driver Version Detected", "580.105.08")
    row("GPU Device IDs Detected", ", ".join("2330" for _ in gpus))
    out.append("|-----  Deployment  --------+------------------------------------------------|")
    row("software", "Pass")
    for g in gpus:
        row("", "GPU%d: Pass" % g)
    out.append("+-----  Hardware  ----------+------------------------------------------------+")
    row("memory", "Pass" if bad is None else "Fail")
    for g in gpus:
        row("", "GPU%d: %s" % (g, "Fail" if g == bad else "Pass"))
        if g == bad:
            wrapped("Warning: GPU%d" % g, msg)
    out.append("+-----  Integration  -------+------------------------------------------------+")
    row("pcie", "Pass")
    for g in gpus:
        row("", "GPU%d: Pass" % g)
out.append(rule)
print("\n".join(out))
sys.exit(226 if bad is not None else 0)  # DCGM_ST_NVVS_ERROR (-30) as an exit status
'''


# The reboot command: logs its call and, when FAKE_STATE_DB names the state database, how many
# RepairStep records the database held when it ran (a reboot must be on file before it is asked
# for). A `reboot_fails` file makes it refuse, as systemctl does without the privilege.
REBOOT = r'''#!{python}
import os, pathlib, sqlite3, sys
d = pathlib.Path(os.environ["FAKE_GPU_DIR"])
db = os.environ.get("FAKE_STATE_DB")
on_file = -1
if db:
    con = sqlite3.connect(db)
    on_file = con.execute("SELECT COUNT(*) FROM transitions WHERE record LIKE '%\"RepairStep\"%'").fetchone()[0]
    con.close()
with open(d / "calls", "a") as f:
    f.write("reboot %s on_file=%d\n" % (" ".join(sys.argv[1:]), on_file))
if (d / "reboot_hangs").exists():  # the host going down under the command
    import time
    time.sleep(30)
if (d / "reboot_fails").exists():
    print("Failed to set wall message, ignoring: Interactive authentication required.")
    print("Failed to reboot system via logind: Interactive authentication required.")
    sys.exit(1)
sys.exit(0)
'''


def install_tools(tmp: Path, *, dcgmi: bool = True) -> tuple[dict[str, str], Path]:
    """A bin folder with the fake tools, and the environment that puts only it on PATH."""
    bin_dir, state = tmp / "bin", tmp / "gpu"
    bin_dir.mkdir(parents=True)
    state.mkdir()
    scripts = {"nvidia-smi": NVIDIA_SMI, "fake-reboot": REBOOT,
               **({"dcgmi": DCGMI} if dcgmi else {})}
    for name, text in scripts.items():
        p = bin_dir / name
        p.write_text(text.replace("{python}", sys.executable, 1))
        p.chmod(0o755)
    return {"PATH": str(bin_dir), "FAKE_GPU_DIR": str(state)}, state


def tool_calls(state: Path) -> list[str]:
    """Every call the fake tools logged, in order."""
    p = state / "calls"
    return p.read_text().splitlines() if p.exists() else []
