"""Pod and container names from the kubelet's log tree (supervisor.agent.kube_names).

The trees are the links and directories the kubelet makes (legacyLogSymlink,
BuildPodLogsDirectory), written under a temp root: names with `-` and `.`, a
link cut at 255 bytes, garbled names, links whose names and targets disagree,
links to nowhere (the target is read, never followed), and no tree at all.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from supervisor.agent.kube_names import (
    ContainerName,
    PodName,
    parse_container_link,
    parse_pod_dir,
    read_kube_names,
)
from supervisor.hostfs import HostFS

UID = "0f2d8a9e-5b1c-4c7e-9f00-1234567890ab"
UID2 = "9c1e7a52-0d3b-4f6e-8a11-fedcba098765"
CID = "4b825dc642cb6eb9a060e54bf8d69288fbee4904" + "0" * 24
CID2 = "a" * 64


def kubelet_link(root: Path, pod: str, ns: str, uid: str, *, container: str, cid: str) -> Path:
    """The link the kubelet makes for a container, to where it makes the log (not created)."""
    name = f"{pod}_{ns}_{container}-{cid}"[: 255 - len(".log")] + ".log"
    link = root / "var/log/containers" / name
    link.parent.mkdir(parents=True, exist_ok=True)
    os.symlink(f"/var/log/pods/{ns}_{pod}_{uid}/{container}/0.log", link)
    return link


STATIC = "3b2c6f6e0c9d4c44a5e1d1f0b2a3c4d5"  # a static pod's UID: its manifest's hash


@pytest.mark.parametrize(
    ("name", "want"),
    [
        (f"default_vllm-0_{UID}", PodName("default", "vllm-0", UID)),
        (f"ml_llama.70b-x2k4q_{UID}", PodName("ml", "llama.70b-x2k4q", UID)),
        (f"kube-system_etcd-n1_{STATIC}", PodName("kube-system", "etcd-n1", STATIC)),
        (UID, None),  # a kubelet before 1.14: the UID alone
        (f"default_vllm_0_{UID}", None),  # four parts: no name holds "_"
        (f"Default_vllm-0_{UID}", None),  # upper case
        (f"default_-vllm_{UID}", None),  # a name starts with a letter or digit
        ("default_vllm-0_not-a-uid", None),
        (f"default__{UID}", None),
    ],
)
def test_pod_directory_names(name: str, want: PodName | None) -> None:
    assert parse_pod_dir(name) == want


def test_a_link_gives_the_pod_s_and_the_container_s_names() -> None:
    got = parse_container_link(
        f"llama.70b-x2k4q_ml-serving_vllm-engine-{CID}.log",
        f"/var/log/pods/ml-serving_llama.70b-x2k4q_{UID}/vllm-engine/3.log",
    )
    assert got == ContainerName(PodName("ml-serving", "llama.70b-x2k4q", UID), "vllm-engine", CID)


LINK = f"vllm-0_default_vllm-{CID}.log"


def log_of(pod_dir: str = f"default_vllm-0_{UID}", container: str = "vllm") -> str:
    return f"/var/log/pods/{pod_dir}/{container}/0.log"


@pytest.mark.parametrize(
    ("name", "target", "problem"),
    [
        (LINK.removesuffix(".log"), log_of(), "does not end in .log"),
        (f"vllm-0_default-vllm-{CID}.log", log_of(), "is not <pod>_<namespace>_<container>-<id>"),
        (f"vllm-0_default_vllm_x-{CID}.log", log_of(), "is not <pod>_<namespace>_<container>-"),
        ("vllm-0_default_vllm-zz12.log", log_of(), "container id 'zz12' is not hex"),
        (LINK, log_of().replace("0.log", "current"), "is not <pod logs>/<namespace>_<pod>_<uid>/"),
        (LINK, "0.log", "is not <pod logs>"),
        (LINK, log_of(UID), f"'{UID}' is not <namespace>_<pod>_<uid>"),
        # The name and the target must name the same pod and container.
        (LINK, log_of(f"default_vllm-1_{UID}"), "name another pod or container"),
        (LINK, log_of(f"other_vllm-0_{UID}"), "name another pod or container"),
        (LINK, log_of(container="sidecar"), "name another pod or container"),
    ],
)
def test_a_garbled_link_is_named_with_what_is_wrong(name: str, target: str, problem: str) -> None:
    got = parse_container_link(name, target)
    assert isinstance(got, str) and problem in got, got


def test_the_tree_names_each_container_by_its_id_and_each_pod_by_its_uid(tmp_path: Path) -> None:
    kubelet_link(tmp_path, "vllm-0", "ml", UID, container="engine", cid=CID)
    kubelet_link(tmp_path, "vllm-0", "ml", UID, container="sidecar", cid=CID2)
    (tmp_path / f"var/log/pods/ml_vllm-0_{UID}/engine").mkdir(parents=True)
    (tmp_path / f"var/log/pods/batch_job-7_{UID2}/main").mkdir(parents=True)  # no link yet
    names = read_kube_names(HostFS(str(tmp_path)), "/var/log")
    assert names is not None and names.problems == ()
    pod = PodName("ml", "vllm-0", UID)
    assert names.container(UID, CID) == ContainerName(pod, "engine", CID)
    assert names.container(UID, CID2) == ContainerName(pod, "sidecar", CID2)
    assert names.pod(UID2) == PodName("batch", "job-7", UID2)
    # The links point to /var/log/pods/... of the host: read, never followed, so
    # they name the containers where that directory is not there (tmp_path's is not).
    assert not (tmp_path / "var/log/containers").iterdir().__next__().exists()
    # A link found under another pod's UID is not this container's.
    assert names.container(UID2, CID) is None
    assert names.container(UID, "b" * 64) is None


def test_a_name_cut_at_255_bytes_is_matched_by_its_id_s_prefix(tmp_path: Path) -> None:
    pod = "p" * 180  # 180 + "_ml_engine-" leaves 60 of the id's 64 digits
    link = kubelet_link(tmp_path, pod, "ml", UID, container="engine", cid=CID)
    assert len(link.name) == 255
    names = read_kube_names(HostFS(str(tmp_path)), "var/log")
    assert names is not None and names.problems == ()
    got = names.container(UID, CID)
    assert got is not None and got.cut and got.container_id == CID[:60]
    assert (got.pod.name, got.container) == (pod, "engine")
    # Cut before 12 digits of the id: which container it is cannot be told.
    kubelet_link(tmp_path, "q" * 233, "ml", UID2, container="engine", cid=CID2)
    names = read_kube_names(HostFS(str(tmp_path)), "var/log")
    assert names is not None and names.container(UID2, CID2) is None
    assert len(names.problems) == 1 and "of 12 digits or more" in names.problems[0]


def test_what_is_no_kubelet_name_is_skipped_with_one_line_each(tmp_path: Path) -> None:
    kubelet_link(tmp_path, "vllm-0", "ml", UID, container="engine", cid=CID)
    containers = tmp_path / "var/log/containers"
    (containers / "notes.txt").write_text("a file an operator left\n")
    os.symlink("/nowhere", containers / f"vllm-0_ml_engine-{CID2}.log")
    (tmp_path / "var/log/pods").mkdir()
    (tmp_path / "var/log/pods/lost+found").mkdir()
    names = read_kube_names(HostFS(str(tmp_path)), "/var/log")
    assert names is not None
    assert names.container(UID, CID) is not None  # the good one still counts
    assert sorted(names.problems) == [
        f"{containers}/notes.txt: not a symbolic link",
        f"{containers}/vllm-0_ml_engine-{CID2}.log: target '/nowhere' is not "
        "<pod logs>/<namespace>_<pod>_<uid>/<container>/<n>.log",
        f"{tmp_path}/var/log/pods/lost+found: not <namespace>_<pod>_<uid>",
    ]


def test_no_log_tree_is_no_names(tmp_path: Path) -> None:
    assert read_kube_names(HostFS(str(tmp_path)), "/var/log") is None
    (tmp_path / "var/log").mkdir(parents=True)  # a host's /var/log, not a node's
    assert read_kube_names(HostFS(str(tmp_path)), "/var/log") is None
    (tmp_path / "var/log/pods").mkdir()  # a node with no pods yet
    names = read_kube_names(HostFS(str(tmp_path)), "/var/log")
    assert names is not None and not names.pods and not names.containers
