"""Discovery against a real multi-NUMA kernel (the QEMU test guest, tests/guest/)."""

from __future__ import annotations

import json

import pytest

from tests.support.vm import PYTHON, run_in_vm

pytestmark = pytest.mark.vm

SCRIPT = (
    "import json; from supervisor.hostfs import HostFS; "
    "from supervisor.topology.discover import read_topology; "
    "from supervisor.topology.model import DiscoveryOptions; "
    "from supervisor.topology.render import topology_to_doc; "
    "opts = DiscoveryOptions(pci_devices=('0000:21:00.0', '0000:41:00.0')); "
    "t = read_topology(HostFS('/'), opts); "
    "print('DOC=' + json.dumps(topology_to_doc(t)))"
)


def _doc(vm_args: list[str]) -> dict:  # type: ignore[type-arg]
    proc = run_in_vm(vm_args, [PYTHON, "-c", SCRIPT], timeout_s=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    line = next(x for x in proc.stdout.splitlines() if x.startswith("DOC="))
    return json.loads(line[4:])  # type: ignore[no-any-return]


@pytest.mark.vm
@pytest.mark.timeout(600)
def test_cpuless_node_and_numa_local_devices() -> None:
    doc = _doc(["--preset", "cpuless", "--cgroup", "v2"])
    nodes = {n["id"]: n for n in doc["nodes"]}
    assert sorted(nodes) == [0, 1, 2]
    assert nodes[0]["cpus"] == [0, 1] and nodes[1]["cpus"] == [2, 3]
    assert nodes[2]["cpus"] == [] and nodes[2]["mem_total_bytes"] > 0
    assert nodes[0]["distances"] == {"0": 10, "1": 20, "2": 30}
    devs = [(d["bus_id"], d["numa_node"], d["locality"]) for d in doc["devices"]]
    assert devs == [("0000:21:00.0", 0, "numa_node"), ("0000:41:00.0", 1, "numa_node")]
    assert all(d["irqs"] for d in doc["devices"])  # virtio-net MSI-X vectors
    nics = {n["bus_id"]: n["numa_node"] for n in doc["nics"] if n["bus_id"]}
    assert nics["0000:21:00.0"] == 0 and nics["0000:41:00.0"] == 1
    assert doc["allowed"]["cpus"] == [0, 1, 2, 3]
    assert doc["allowed"]["cgroup_version"] == 2
