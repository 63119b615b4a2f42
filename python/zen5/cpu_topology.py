"""How many compute threads to use by default: the physical cores of one NUMA node, among the
CPUs this process may run on.

Why physical cores: decode streams the weights (memory-bound) and prefill keeps the vector units
busy; an SMT sibling shares both its core's load/store ports and its FMA / int8 pipes, so a second
thread per core adds contention (and one more straggler per thread-pool dispatch), not speed;
llama.cpp's default makes the same choice. Why one NUMA node: the weights are read from the node
whose memory holds them; threads on another socket read them across the inter-socket link at a
fraction of local bandwidth and slow every dispatch to the pace of the remote ones. The node
chosen is the one with the most allowed CPUs (the lowest-numbered on a tie). `--threads N` /
`threads=` override it; README "Threads and NUMA" says what to do on a multi-socket box.

Read from Linux sysfs (`/sys/devices/system/cpu`); anywhere it is missing, every allowed CPU
counts.
"""
from __future__ import annotations

import os
from pathlib import Path

SYSFS = Path("/sys/devices/system/cpu")


def allowed_cpus() -> set[int]:
    try:
        return set(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return set(range(os.cpu_count() or 1))


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _node_of(cpu_dir: Path) -> int | None:
    for entry in cpu_dir.glob("node[0-9]*"):
        return int(entry.name[4:])
    return None


def default_threads(cpus: set[int] | None = None, sysfs: Path = SYSFS) -> int:
    """Distinct physical cores (package, core id) of the busiest NUMA node among `cpus` (default:
    this process's affinity)."""
    cpus = allowed_cpus() if cpus is None else set(cpus)
    cores_by_node: dict[int, set[tuple[str, str]]] = {}
    cpus_by_node: dict[int, int] = {}
    for cpu in sorted(cpus):
        d = sysfs / f"cpu{cpu}"
        core, package = _read(d / "topology" / "core_id"), _read(d / "topology" / "physical_package_id")
        if core is None or package is None:
            return max(1, len(cpus))  # no topology here: every allowed CPU counts
        node = _node_of(d)
        node = -1 if node is None else node
        cores_by_node.setdefault(node, set()).add((package, core))
        cpus_by_node[node] = cpus_by_node.get(node, 0) + 1
    if not cpus_by_node:
        return 1
    node = min(cpus_by_node, key=lambda n: (-cpus_by_node[n], n))
    return max(1, len(cores_by_node[node]))
