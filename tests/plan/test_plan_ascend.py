"""Ascend as the vLLM-Ascend CPU binding document describes it (issue 27 items 2-4).

Fixture hosts with real NPU numbering (supervisor.examples.hosts: the A2 with
8 and with 4 NUMA nodes, NPU0 at C1:00.0; the A3); services run as real
`plan --root TREE --json` processes, one per ASCEND_RT_VISIBLE_DEVICES, and
their outputs are checked against each other.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from supervisor.config import parse_config
from supervisor.errors import ConfigError
from supervisor.examples import hosts
from supervisor.examples.builder import FakeHost
from supervisor.hostfs import HostFS
from supervisor.plan.placement import PlanSettings
from supervisor.plan.planner import plan
from supervisor.topology.discover import read_topology

ROOT = Path(__file__).resolve().parents[2]
ASCEND_CONFIG = ROOT / "configs" / "ascend-16npu.toml"
VISIBILITY = "ASCEND_RT_VISIBLE_DEVICES"

DOCUMENT_ROLES = "rank_roles = { irq = 2, acl = 1, release = 1 }\n"


def document_config(tmp_path: Path, allocator: str, roles: str = DOCUMENT_ROLES) -> Path:
    """A config with the document's allocator and role split, no engine."""
    path = tmp_path / f"{allocator}.toml"
    path.write_text(
        'accelerator = "ascend"\n[workers]\ncommand = ["/opt/w", "{rank}"]\n'
        f'[placement]\nallocator = "{allocator}"\n{roles}'
    )
    return path


def plan_process(
    root: Path, visible: str | None, config: Path | None = None, env_var: str = VISIBILITY
) -> dict:  # type: ignore[type-arg]
    """`plan --root ROOT --json` as its own process, as one service would run it."""
    env = {k: v for k, v in os.environ.items() if k not in (VISIBILITY, "CUDA_VISIBLE_DEVICES")}
    if visible is not None:
        env[env_var] = visible
    args = [sys.executable, "-m", "supervisor", "plan", "--root", str(root), "--json"]
    if config is not None:
        args += ["--config", str(config), "--no-checks"]
    proc = subprocess.run(args, check=False, capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    doc: dict = json.loads(proc.stdout)  # type: ignore[type-arg]
    return doc


def slots(doc: dict) -> list[tuple[str, set[int]]]:  # type: ignore[type-arg]
    out = [(f"rank {r['rank']}", set(r["cpus"])) for r in doc["ranks"]]
    if doc["engine"] is not None:
        out.append(("engine", set(doc["engine"]["cpus"])))
    return out


def assert_disjoint(*docs: dict) -> None:  # type: ignore[type-arg]
    seen: dict[int, str] = {}
    for i, doc in enumerate(docs):
        for name, cpus in slots(doc):
            for cpu in cpus:
                assert cpu not in seen, f"CPU {cpu}: service {i} {name} and {seen[cpu]}"
                seen[cpu] = f"service {i} {name}"


# -- item 2: the document's two examples, exactly ---------------------------------


@pytest.mark.parametrize("nodes_per_socket", [2, 1])
def test_document_a2_example_two_single_card_services(
    tmp_path: Path, nodes_per_socket: int
) -> None:
    """Process A sees NPU0, B NPU2, both cpuset 144-191: A 144-167, B 168-191.

    With 8 nodes the NPUs' affinity is node 6 (144-167), extended by node 7;
    with 4 nodes it is node 3 (144-191) already. Either way the hidden
    same-affinity NPU is a candidate and the shared pool is split.
    """
    root = hosts.ascend_a2(tmp_path, nodes_per_socket, cpuset="144-191")
    config = document_config(tmp_path, "topo_affinity")
    a = plan_process(root, "0", config)
    b = plan_process(root, "2", config)
    assert a["ranks"][0]["device"]["bus_id"] == "0000:c1:00.0"
    assert b["ranks"][0]["device"]["bus_id"] == "0000:c2:00.0"
    assert a["ranks"][0]["cpus"] == list(range(144, 168))
    assert b["ranks"][0]["cpus"] == list(range(168, 192))
    assert a["ranks"][0]["roles"] == {
        "irq": [144, 145],
        "main": list(range(146, 166)),
        "acl": [166],
        "release": [167],
    }
    assert b["ranks"][0]["roles"]["acl"] == [190] and b["ranks"][0]["roles"]["release"] == [191]
    assert a["ranks"][0]["strategy"] == "topo-affinity"
    assert [i["bdf"] for i in a["ranks"][0]["irqs"]] == ["0000:c1:00.0"] * 2
    assert a["ranks"][0]["irqs"][0]["cpus"] == [144, 145]
    assert_disjoint(a, b)


def test_document_a3_global_slice_table(tmp_path: Path) -> None:
    """640 CPUs, 16 logical NPUs: worker i gets 40i..40i+39, irq c0-c1, main
    c2-c37, acl c38, release c39; the NPU is the one of logical id i."""
    root = hosts.ascend_a3(tmp_path)
    doc = plan_process(root, None, document_config(tmp_path, "global_slice"))
    assert doc["engine"] is None and len(doc["ranks"]) == 16
    for r in doc["ranks"]:
        i, base = r["rank"], 40 * r["rank"]
        assert r["device"]["bus_id"] == f"0000:{hosts.A3_BUSES[i]}:00.0"
        assert r["cpus"] == list(range(base, base + 40))
        assert r["roles"] == {
            "irq": [base, base + 1],
            "main": list(range(base + 2, base + 38)),
            "acl": [base + 38],
            "release": [base + 39],
        }
        assert r["strategy"] == "global-slice"
        assert {i["bdf"] for i in r["irqs"]} == {r["device"]["bus_id"]}


def test_global_slice_base_and_extra(tmp_path: Path) -> None:
    """base = len // total, the first `extra` logical ids one more CPU."""
    root = hosts.ascend_a2(tmp_path, cpuset="0-42")  # 43 CPUs over 8 NPUs: base 5, extra 3
    config = document_config(tmp_path, "global_slice")
    doc = plan_process(root, None, config)
    sizes = [len(r["cpus"]) for r in doc["ranks"]]
    assert sizes == [6, 6, 6, 5, 5, 5, 5, 5]
    assert doc["ranks"][3]["cpus"] == [18, 19, 20, 21, 22]


def test_topo_affinity_without_affinity_falls_back_to_global_slice(tmp_path: Path) -> None:
    host = FakeHost(tmp_path / "a3_unknown").cpus(2, 4, 1)
    for i in range(2):
        host.ascend_npu(f"0000:{i + 1:02x}:00.0", -1)
    topo = read_topology(HostFS(str(host.build())))
    settings = PlanSettings(allocator="topo_affinity", engine=False, rank_roles={"irq": 2})
    p = plan(topo, settings)
    assert [r.slot.cpus for r in p.ranks] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert any("falling back to global_slice" in w for w in p.warnings)


# -- item 1 in the plan: every rank on its own NPU's node -----------------------------


@pytest.mark.parametrize("nodes_per_socket", [2, 1])
def test_a2_whole_host_ranks_sit_on_their_npus_node(tmp_path: Path, nodes_per_socket: int) -> None:
    root = hosts.ascend_a2(tmp_path, nodes_per_socket)
    topo = read_topology(HostFS(str(root)))
    doc = plan_process(root, None)
    node_of = {c.id: c.node for c in topo.cpus}
    for r in doc["ranks"]:
        assert r["device"]["bus_id"] == f"0000:{hosts.A2_BUSES[r['rank']]}:00.0"
        assert {node_of[c] for c in r["cpus"]} == {r["device"]["numa_node"]}, r
    # The project's own layout stays for one whole-host deployment: the
    # engine has a slot of its own, its roles apart.
    assert doc["engine"] is not None and doc["engine"]["roles"]["so_compiler"]


# -- item 3: any number of services, never an overlap ---------------------------------


SERVICE_CASES = [
    ("a2-8node", lambda p: hosts.ascend_a2(p, 2, cpuset="144-191"), ["0", "2"]),
    ("a2-4node", lambda p: hosts.ascend_a2(p, 1, cpuset="144-191"), ["0", "2"]),
    ("a3", hosts.ascend_a3, ["0", "2"]),
    ("a3-four", hosts.ascend_a3, ["0,1", "2,3", "4", "5"]),
]


@pytest.mark.parametrize(
    ("name", "build", "services"), SERVICE_CASES, ids=[c[0] for c in SERVICE_CASES]
)
@pytest.mark.parametrize("config", [None, "shipped", "topo_affinity", "global_slice"])
def test_independent_services_never_overlap(
    tmp_path: Path,
    name: str,
    build,
    services: list[str],
    config: str | None,  # type: ignore[no-untyped-def]
) -> None:
    root = build(tmp_path)
    path = {
        None: None,
        "shipped": ASCEND_CONFIG,
        "topo_affinity": document_config(tmp_path, "topo_affinity"),
        "global_slice": document_config(tmp_path, "global_slice"),
    }[config]
    docs = [plan_process(root, visible, path) for visible in services]
    for doc, visible in zip(docs, services, strict=True):
        assert [r["device"]["index"] for r in doc["ranks"]] == [int(v) for v in visible.split(",")]
    if name == "a3-four" and config == "topo_affinity":
        # The document's topo_affinity on A3's ubcore nodes: NPU0/2 extend to
        # nodes 0-1, NPU1/3 to nodes 1-2, and differing pools are not split.
        # The document uses global_slice on A3 for this; the plan says so.
        assert any("allocator global_slice never overlaps" in w for w in docs[0]["warnings"])
        return
    assert_disjoint(*docs)
    if config in (None, "shipped"):
        assert all(doc["engine"] is not None for doc in docs)


def test_a3_engines_of_two_services_differ(tmp_path: Path) -> None:
    """Main gave both services the engine CPUs 74-79; now each engine comes
    from its own rank 0's share."""
    root = hosts.ascend_a3(tmp_path)
    a, b = plan_process(root, "0"), plan_process(root, "2")
    assert a["engine"]["cpus"] == [34, 35, 36, 37, 38, 39]
    assert b["engine"]["cpus"] == [74, 75, 76, 77, 78, 79]
    assert a["ranks"][0]["cpus"] == list(range(34)) and b["ranks"][0]["cpus"] == list(range(40, 74))


def test_a2_engine_in_its_own_part_of_the_free_node(tmp_path: Path) -> None:
    """Cpuset 144-191: node 7 has no NPU; each service's engine sits in its
    devices' part of it, ranks keep node 6. Hidden NPUs on nodes 0, 2, 4
    (no allowed CPU) keep no share."""
    root = hosts.ascend_a2(tmp_path, cpuset="144-191")
    a, b = plan_process(root, "0"), plan_process(root, "2")
    assert a["ranks"][0]["cpus"] == list(range(144, 156))
    assert b["ranks"][0]["cpus"] == list(range(156, 168))
    assert a["engine"]["cpus"] == list(range(174, 180)) and a["engine_node"] == 7
    assert b["engine"]["cpus"] == list(range(186, 192))
    assert_disjoint(a, b)


def test_allocator_key_is_validated_naming_file_key_and_value() -> None:
    def load(value: str) -> str:
        doc = {"workers": {"command": "w"}, "placement": {"allocator": value}}
        return parse_config(doc, "npu.toml").placement.allocator

    assert load("topo_affinity") == "topo_affinity"
    with pytest.raises(ConfigError, match=r"npu.toml: placement.allocator: must be one of "):
        load("topo-affinity")


def test_a3_sixteen_single_card_services_never_overlap(tmp_path: Path) -> None:
    """One service per logical NPU, same (whole-host) cpuset, no config."""
    root = hosts.ascend_a3(tmp_path)
    docs = [plan_process(root, str(i)) for i in range(16)]
    assert_disjoint(*docs)
    for i, doc in enumerate(docs):
        assert doc["ranks"][0]["device"]["bus_id"] == f"0000:{hosts.A3_BUSES[i]}:00.0"
        assert doc["engine"] is not None


def test_a3_whole_host_irqs_are_those_of_each_ranks_npu(tmp_path: Path) -> None:
    """Item 6: main routed rank 0's IRQs for bus 01:00.0 (logical 14, socket 3)."""
    root = hosts.ascend_a3(tmp_path)
    topo = read_topology(HostFS(str(root)))
    irqs_of = {d.bdf: set(d.irqs) for d in topo.devices}
    doc = plan_process(root, None)
    for r in doc["ranks"]:
        bus = r["device"]["bus_id"]
        assert bus == f"0000:{hosts.A3_BUSES[r['rank']]}:00.0"
        assert {i["irq"] for i in r["irqs"]} == irqs_of[bus]
        assert {i["bdf"] for i in r["irqs"]} == {bus}
        assert set(r["irqs"][0]["cpus"]) <= set(r["cpus"])
    assert doc["ranks"][0]["irqs"][0]["bdf"] == "0000:9d:00.0"
