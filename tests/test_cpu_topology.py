"""The default thread count (cpu_topology.py): physical cores of one NUMA node among the CPUs the
process may use, read from a sysfs tree built here for each kind of machine."""
from __future__ import annotations

from zen5.cpu_topology import default_threads


def machine(root, sockets: int, cores: int, smt: int, nodes_per_socket: int = 1):
    """A fake /sys/devices/system/cpu: Linux numbers the first thread of every core first, then
    the SMT siblings; returns the CPU ids."""
    cpus = []
    per_node = cores // nodes_per_socket
    for t in range(smt):
        for s in range(sockets):
            for c in range(cores):
                cpu = (t * sockets + s) * cores + c
                d = root / f"cpu{cpu}"
                (d / "topology").mkdir(parents=True)
                (d / "topology" / "core_id").write_text(f"{c}\n")
                (d / "topology" / "physical_package_id").write_text(f"{s}\n")
                (d / f"node{s * nodes_per_socket + c // per_node}").mkdir()
                cpus.append(cpu)
    return set(cpus)


def test_a_two_core_vm_uses_both(tmp_path):
    assert default_threads(machine(tmp_path, 1, 2, 1), tmp_path) == 2


def test_smt_siblings_do_not_count(tmp_path):
    assert default_threads(machine(tmp_path, 1, 8, 2), tmp_path) == 8


def test_a_dual_socket_zen5_uses_one_socket_of_physical_cores(tmp_path):
    cpus = machine(tmp_path, 2, 96, 2)          # 2 x 96 cores x SMT2 = 384 CPUs
    assert len(cpus) == 384 and default_threads(cpus, tmp_path) == 96


def test_nps4_uses_one_node(tmp_path):
    assert default_threads(machine(tmp_path, 2, 96, 2, nodes_per_socket=4), tmp_path) == 24


def test_affinity_picks_the_node_it_allows(tmp_path):
    cpus = machine(tmp_path, 2, 4, 2)
    socket1 = {4, 5, 6, 7, 12, 13, 14, 15}      # numactl --cpunodebind=1
    assert socket1 < cpus
    assert default_threads(socket1, tmp_path) == 4
    assert default_threads({0, 8, 4}, tmp_path) == 1  # cpu 0 and its sibling 8 on node 0: one core


def test_without_topology_every_allowed_cpu_counts(tmp_path):
    assert default_threads({0, 1, 2}, tmp_path / "missing") == 3
