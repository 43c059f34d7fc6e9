"""The Xid catalog: what an Xid code means, NVIDIA's resolution label, and what it implies here.

The NVIDIA driver reports many GPU events as numbered "Xid" messages (in the kernel log and through
NVML events). NVIDIA's Xid catalog ("Analyzing Xid Errors with the Xid Catalog", Ampere and newer)
gives each code a mnemonic, a description and two resolution buckets: the immediate action
(RESTART_APP, RESET_GPU, RESTART_BM, IGNORE, CONTACT_SUPPORT, CHECK_MECHANICALS, WORKFLOW_*) and an
investigatory action. The mnemonics, descriptions and labels below are taken from that catalog.

What the catalog does not say is what a screening daemon should conclude, so every entry also
carries our classification:

- ``hardware``: the GPU (or its link, memory or power) is suspect;
- ``software``: usually an application bug. Xid 13 and 31 are typically an out-of-bounds access in
  a kernel; treating them as hardware sends good machines to repair and leaves the bug in place;
- ``informational``: expected, follows another Xid, or is already corrected;
- ``unknown``: a code this table does not know. It is reported, never dropped.

and the severity of the finding it produces. Severity meanings follow `screener.health.verdict.rules`:
suspect = stop new work, drain, reset and re-screen; critical = unusable now or to be removed from
service.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Mapping

from screener.types import Severity


class XidClass(str, enum.Enum):
    """What an Xid implies for the node, in our terms."""

    HARDWARE = "hardware"
    SOFTWARE = "software"
    INFORMATIONAL = "informational"
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class XidInfo:
    """One catalog entry."""

    code: int
    name: str  # NVIDIA's mnemonic
    description: str  # NVIDIA's short description
    resolution: str  # NVIDIA's immediate-action bucket
    investigatory: str  # NVIDIA's investigatory-action bucket
    classification: XidClass
    severity: Severity
    action: str  # what we recommend, in words

    @property
    def known(self) -> bool:
        return self.classification is not XidClass.UNKNOWN

    def to_dict(self) -> dict[str, object]:
        return {"code": self.code, "name": self.name, "description": self.description,
                "resolution": self.resolution, "investigatory": self.investigatory,
                "classification": self.classification.value, "severity": self.severity.label,
                "action": self.action}


_H, _S, _I = XidClass.HARDWARE, XidClass.SOFTWARE, XidClass.INFORMATIONAL
_OK, _INFO, _WARN, _SUSP, _CRIT = (Severity.OK, Severity.INFO, Severity.WARNING, Severity.SUSPECT,
                                   Severity.CRITICAL)

_APP_BUG = "restart the application and debug it (compute-sanitizer memcheck); not a hardware fault"
_RESET = "drain the node and reset the GPU at the next safe point, then re-screen"
_REPAIR = "remove the GPU from service (repair)"
_REBOOT = "drain and reboot the node; repair if it recurs"
_WATCH = "no action; watch for recurrence"
_RESTART = "restart the application; re-screen the GPU if it recurs"

# code: (mnemonic, description, immediate, investigatory, class, severity, action)
_ROWS: dict[int, tuple[str, str, str, str, XidClass, Severity, str]] = {
    8: ("ROBUST_CHANNEL_FIFO_ERROR_IDLE_TIMEOUT", "GPU stopped processing", "RESTART_APP",
        "CONTACT_SUPPORT", _H, _WARN, _RESTART),
    11: ("ROBUST_CHANNEL_GR_ERROR_MISSING_HW", "Invalid or corrupted push buffer stream",
         "RESTART_APP", "CHECK_APP/CUDA", _S, _INFO, _APP_BUG),
    13: ("ROBUST_CHANNEL_GR_EXCEPTION", "Graphics Engine Exception", "RESTART_APP",
         "WORKFLOW_XID_13", _S, _INFO, _APP_BUG),
    14: ("ROBUST_CHANNEL_FAKE_ERROR", "Fake or injected error from userspace", "IGNORE",
         "CONTACT_SUPPORT", _I, _INFO, _WATCH),
    25: ("ROBUST_CHANNEL_GR_ILLEGAL_NOTIFY", "Invalid or illegal push buffer stream", "RESTART_APP",
         "CHECK_APP/CUDA", _S, _INFO, _APP_BUG),
    31: ("ROBUST_CHANNEL_FIFO_ERROR_MMU_ERR_FLT", "GPU memory page fault", "RESTART_APP",
         "WORKFLOW_XID_31", _S, _INFO, _APP_BUG),
    # The catalog notes PBDMA faults are mostly PCIe quality problems, not application actions.
    32: ("ROBUST_CHANNEL_PBDMA_ERROR", "Invalid or corrupted push buffer stream", "RESTART_APP",
         "CHECK_APP/CUDA", _H, _SUSP, "restart the application; check the PCIe link and re-screen"),
    38: ("ROBUST_CHANNEL_FECS_ERR_WATCHDOG_TIMEOUT", "Driver firmware error", "IGNORE",
         "CONTACT_SUPPORT", _I, _INFO, _WATCH),
    43: ("ROBUST_CHANNEL_RESETCHANNEL_VERIF_ERROR", "GPU stopped processing", "IGNORE",
         "CONTACT_SUPPORT", _S, _INFO,
         "none: a user application hit a software fault and was stopped; the GPU stays healthy"),
    44: ("ROBUST_CHANNEL_GR_FAULT_DURING_CTXSW", "Graphics Engine fault during context switch",
         "IGNORE", "CONTACT_SUPPORT", _I, _INFO, _WATCH),
    # 45 is the driver tearing an application down (Ctrl-C, kill, reset, or after another Xid).
    45: ("ROBUST_CHANNEL_PREEMPTIVE_REMOVAL", "Preemptive cleanup, due to previous errors",
         "WORKFLOW_XID_45", "Solo: RESTART_FM / Not Solo: IGNORE (follow other Xid)", _I, _INFO,
         "none by itself; follow the Xid it accompanies"),
    46: ("ROBUST_CHANNEL_GPU_TIMEOUT_ERROR", "GPU stopped processing", "RESET_GPU",
         "CONTACT_SUPPORT", _H, _SUSP, _RESET),
    48: ("ROBUST_CHANNEL_GPU_ECC_DBE", "Double Bit ECC Error", "WORKFLOW_XID_48",
         "WORKFLOW_XID_48", _H, _SUSP, _RESET + "; repair if uncorrectable errors come back after the reset"),
    54: ("SILENT_RUNNING_PWR_REDUCED_CLOCKING",
         "Auxiliary power is not connected to the GPU board", "CHECK_MECHANICALS",
         "CONTACT_SUPPORT", _H, _SUSP, "drain and check the board's power cabling"),
    # Unused on Ampere and newer; older drivers used it for a micro-controller breakpoint/warning.
    61: ("PMU_BREAKPOINT", "Internal micro-controller breakpoint/warning", "CONTACT_SUPPORT",
         "N/A", _H, _WARN, "watch for recurrence; reset the GPU if it repeats"),
    62: ("PMU_HALT_ERROR", "Internal micro-controller halt", "RESET_GPU", "CONTACT_SUPPORT", _H,
         _SUSP, _RESET),
    # A row remap was recorded; it takes effect at the next GPU reset (see the row-remapper rule).
    63: ("INFOROM_DRAM_RETIREMENT_EVENT", "GPU memory remapping event", "IGNORE", "IGNORE", _H,
         _WARN, "a memory row was marked for remapping: drain and reset the GPU at the next safe point"),
    # The catalog says reset; in practice a bank without spare rows means replacing the GPU.
    64: ("INFOROM_DRAM_RETIREMENT_FAILURE", "GPU memory remapping failure", "RESET_GPU",
         "CONTACT_SUPPORT", _H, _CRIT, _REPAIR),
    68: ("ROBUST_CHANNEL_NVDEC0_ERROR", "NVDEC0 Exception", "RESTART_APP", "CONTACT_SUPPORT", _H,
         _WARN, _RESTART),
    69: ("ROBUST_CHANNEL_GR_CLASS_ERROR", "Graphics Engine class error", "RESTART_APP",
         "CHECK_APP/CUDA", _S, _INFO, _APP_BUG),
    74: ("NVLINK_ERROR", "NVLINK Error", "WORKFLOW_NVLINK_ERR", "CONTACT_SUPPORT", _H, _SUSP,
         "drain and reset the GPU (or reboot the node); repair the link if it recurs"),
    79: ("ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS", "GPU has fallen off the bus", "RESTART_BM",
         "CONTACT_SUPPORT", _H, _CRIT, _REBOOT),
    80: ("PBDMA_PUSHBUFFER_CRC_MISMATCH", "Corrupted data sent to GPU", "RESTART_APP",
         "CHECK_APP/CUDA", _H, _SUSP, "restart the application; check the PCIe link and re-screen"),
    92: ("EXCESSIVE_SBE_INTERRUPTS", "High single-bit ECC error rate", "IGNORE", "CONTACT_SUPPORT",
         _H, _WARN, "corrected errors are frequent: watch the ECC counters, re-screen the GPU"),
    94: ("ROBUST_CHANNEL_CONTAINED_ERROR", "Contained memory error", "RESTART_APP",
         "IGNORE (sympathetic)", _H, _SUSP,
         "restart the affected application; " + _RESET),
    95: ("ROBUST_CHANNEL_UNCONTAINED_ERROR", "Uncontained memory error", "RESET_GPU",
         "IGNORE (sympathetic)", _H, _CRIT,
         "stop all work on the GPU and reset it before any application restarts; re-screen"),
    109: ("ROBUST_CHANNEL_CTXSW_TIMEOUT_ERROR", "Context Switch Timeout Error", "RESET_GPU",
          "CONTACT_SUPPORT", _H, _SUSP, _RESET),
    110: ("SEC_FAULT_ERROR", "Security Fault Error", "RESET_GPU", "INVESTIGATE_SW", _H, _SUSP,
          _REBOOT),
    119: ("GSP_RPC_TIMEOUT", "GSP RPC Timeout", "RESET_GPU", "INVESTIGATE_SW", _H, _SUSP, _RESET),
    120: ("GSP_ERROR", "GSP Error", "RESET_GPU", "INVESTIGATE_SW", _H, _SUSP, _RESET),
    # Corrected errors on the C2C link to a Grace CPU; no operational impact per the catalog.
    121: ("C2C_ERROR", "C2C Error", "IGNORE", "CONTACT_SUPPORT", _I, _INFO,
          "none now; reset the GPU at a service window to retrain the link"),
    136: ("ALI_TRAINING_FAIL", "Link Training Failed", "RESET_GPU", "INVESTIGATE_LINK_SI", _H,
          _SUSP, _RESET),
    137: ("NVLINK_PRIV_ERR", "NVLink Privilege Error", "IGNORE", "XID_137_FLOW", _S, _INFO,
          _APP_BUG),
    140: ("UNRECOVERABLE_ECC_ERROR_ESCAPE", "ECC Unrecovered Error", "RESET_GPU", "CONTACT_SUPPORT",
          _H, _SUSP, _RESET + "; repair if it persists"),
    143: ("GPU_INIT_ERROR", "GPU Initialization Error", "RESET_GPU", "CONTACT_SUPPORT", _H, _SUSP,
          _RESET),
    154: ("GPU_RECOVERY_ACTION_CHANGED", "GPU Recovery Action Changed", "XID_154",
          "N/A Informational only regarding another Xid", _I, _INFO,
          "follow the recovery action it names for the Xid it accompanies"),
}

CATALOG: Mapping[int, XidInfo] = {
    code: XidInfo(code, name, desc, res, inv, cls, sev, action)
    for code, (name, desc, res, inv, cls, sev, action) in _ROWS.items()
}


def lookup(code: int) -> XidInfo:
    """The catalog entry for `code`; an unknown code gets an explicit ``unknown`` entry.

    Unknown codes are warnings: we cannot say they are harmless, and dropping them would hide a
    fault that a newer driver reports under a new number.
    """
    info = CATALOG.get(int(code))
    if info is not None:
        return info
    return XidInfo(code=int(code), name="UNKNOWN", description="not in screener's Xid catalog",
                   resolution="UNKNOWN", investigatory="UNKNOWN", classification=XidClass.UNKNOWN,
                   severity=Severity.WARNING,
                   action="look the code up in NVIDIA's Xid catalog; re-screen the GPU")
