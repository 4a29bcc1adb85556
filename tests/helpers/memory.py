"""A process's peak resident memory, as the kernel counts it, and the unit the tests count it in."""

from __future__ import annotations

from layerbus.stages.host import proc_kib_field

MIB = 1 << 20


def vm_hwm(pid: int) -> int:
    peak = proc_kib_field(f"/proc/{pid}/status", "VmHWM")
    assert peak is not None, f"no VmHWM for process {pid}"
    return peak
