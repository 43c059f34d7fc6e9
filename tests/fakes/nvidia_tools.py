"""Fake NVIDIA tools on a PATH of their own: `nvidia-smi` and `dcgmi` executables that print what
NVIDIA documents (`nvidia-smi -r`'s sentence, --query-compute-apps' CSV, dcgmi diag's result
table), log every call, and fail on demand (files in their state folder: `apps`, `reset_fails`,
`diag_fails`). Also a reboot command that logs its call and can fail the same way."""

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
    if (d / "reset_fails").exists():
        print("Unable to reset GPU %s because it's being used by some other process (e.g. CUDA "
              "application, graphics application like X server, monitoring application like "
              "other instance of nvidia-smi). Please first kill all processes using the device "
              "and retry the command or reboot the system to make GPU reset operational." % bus)
        sys.exit(255)
    print("GPU %s was successfully reset." % bus)
    print("All done.")
    sys.exit(0)
sys.exit(2)
'''

DCGMI = r'''#!{python}
import os, pathlib, sys
d = pathlib.Path(os.environ["FAKE_GPU_DIR"])
with open(d / "calls", "a") as f:
    f.write("dcgmi " + " ".join(sys.argv[1:]) + "\n")
memory = "Fail - GPU: 1" if (d / "diag_fails").exists() else "Pass - All"
print("""Successfully ran diagnostic for group.
+---------------------------+------------------------------------------------+
| Diagnostic                | Result                                         |
+===========================+================================================+
|-----  Deployment  --------+------------------------------------------------|
| Blacklist                 | Pass                                           |
| NVML Library              | Pass                                           |
| CUDA Main Library         | Pass                                           |
| Permissions and OS Blocks | Pass                                           |
| Persistence Mode          | Pass                                           |
| Environment Variables     | Pass                                           |
| Page Retirement/Row Remap | Pass                                           |
| Graphics Processes        | Pass                                           |
| Inforom                   | Pass                                           |
+-----  Integration  -------+------------------------------------------------+
| PCIe                      | Pass - All                                     |
+-----  Hardware  ----------+------------------------------------------------+
| GPU Memory                | %-47s|
+-----  Stress  ------------+------------------------------------------------+
| SM Stress                 | Pass - All                                     |
| Targeted Stress           | Pass - All                                     |
| Targeted Power            | Pass - All                                     |
| Memory Bandwidth          | Pass - All                                     |
+---------------------------+------------------------------------------------+""" % memory)
sys.exit(226 if "Fail" in memory else 0)
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
