"""deploy/Containerfile, parsed (it cannot be built here: no registry): its base is a
build argument, its ENTRYPOINT is the Deployment's command, its config path is the
ConfigMap's mount, and the package it installs is this checkout's."""

from __future__ import annotations

import re

import pytest

from tests.deploy.manifests import (
    BASE,
    CONTAINERFILE,
    containerfile_instructions,
    exec_form,
    kustomize_build,
    one,
)


@pytest.fixture(scope="module")
def instructions() -> list[tuple[str, str]]:
    return containerfile_instructions(CONTAINERFILE.read_text())


def test_the_base_image_is_a_build_argument_defaulting_to_vllm(
    instructions: list[tuple[str, str]],
) -> None:
    words = [w for w, _ in instructions]
    assert words.index("ARG") < words.index("FROM")  # an ARG before FROM may name the base
    arg = next(a for w, a in instructions if w == "ARG")
    name, _, default = arg.partition("=")
    assert default.startswith("vllm/vllm-openai:")
    assert [a for w, a in instructions if w == "FROM"] == [f"${{{name}}}"]
    assert "lmsysorg/sglang:" in CONTAINERFILE.read_text()  # the documented other base


def test_the_entrypoint_is_the_deployments_command(
    instructions: list[tuple[str, str]],
) -> None:
    (entrypoint,) = [exec_form(a) for w, a in instructions if w == "ENTRYPOINT"]
    docs = kustomize_build(BASE)
    c = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert c["command"] == entrypoint
    assert not c.get("args")  # the image's CMD is empty: nothing is appended
    assert [exec_form(a) for w, a in instructions if w == "CMD"] == [[]]
    # The config path the entrypoint reads is where the ConfigMap is mounted.
    config_path = entrypoint[entrypoint.index("--config") + 1]
    mount_dir, _, file_name = config_path.rpartition("/")
    assert any(m["mountPath"] == mount_dir for m in c["volumeMounts"])
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    items = [
        item
        for v in pod["volumes"]
        for s in v.get("projected", {}).get("sources", [])
        for item in s.get("configMap", {}).get("items", [])
    ]
    assert [i["path"] for i in items] == [file_name]


def test_the_supervisor_gets_its_own_environment(instructions: list[tuple[str, str]]) -> None:
    (entrypoint,) = [exec_form(a) for w, a in instructions if w == "ENTRYPOINT"]
    venv = entrypoint[0].removesuffix("/bin/placement-supervisor")
    assert venv != entrypoint[0]
    runs = " ".join(a for w, a in instructions if w == "RUN")
    assert f"python3 -m venv --without-pip {venv}" in runs
    assert f"--python {venv}/bin/python" in runs
    # The install is smoke-tested in the image, on a host that needs no GPU.
    assert f"{venv}/bin/placement-supervisor topology --example" in runs
    # What is copied is what the package build needs (pyproject's readme, the package).
    copies = [a.split() for w, a in instructions if w == "COPY"]
    sources = {s for c in copies for s in c[:-1]}
    assert {"pyproject.toml", "README.md", "supervisor"} <= sources


def test_the_exposed_ports_are_the_containers(instructions: list[tuple[str, str]]) -> None:
    exposed = {int(p) for w, a in instructions if w == "EXPOSE" for p in a.split()}
    docs = kustomize_build(BASE)
    c = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert exposed == {p["containerPort"] for p in c["ports"]}


def test_the_parser_joins_continued_lines_and_drops_comments() -> None:
    # The control for the checks above: a continued RUN is one instruction.
    text = '# c\nARG A=1\nFROM ${A}\nRUN a \\\n    # inner\n && b\nENTRYPOINT ["x"]\n'
    got = containerfile_instructions(text)
    assert got == [("ARG", "A=1"), ("FROM", "${A}"), ("RUN", "a  && b"), ("ENTRYPOINT", '["x"]')]
    assert re.fullmatch(r"a\s+&& b", got[2][1])
