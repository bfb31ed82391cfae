"""Containers' CPU shares (supervisor.agent.shares): disjoint, deterministic, refused at zero."""

from __future__ import annotations

from supervisor.agent.shares import Share, compute_shares, overlapping


def fs(*cpus: int) -> frozenset[int]:
    return frozenset(cpus)


def test_containers_that_do_not_overlap_keep_their_whole_cpuset() -> None:
    sets = {"/a": fs(0, 1, 2, 3), "/b": fs(4, 5)}
    assert compute_shares(sets) == {"/a": Share(fs(0, 1, 2, 3)), "/b": Share(fs(4, 5))}
    assert overlapping(sets) == [["/a"], ["/b"]]


def test_the_same_cpuset_is_split_in_contiguous_runs_by_path() -> None:
    sets = {"/b": fs(0, 1, 2, 3), "/a": fs(0, 1, 2, 3)}
    assert compute_shares(sets) == {"/a": Share(fs(0, 1)), "/b": Share(fs(2, 3))}
    assert compute_shares({"/x": fs(0, 1), "/y": fs(0, 1)}) == {
        "/x": Share(fs(0)),
        "/y": Share(fs(1)),
    }


def test_only_the_shared_part_is_split() -> None:
    shares = compute_shares({"/a": fs(0, 1, 2, 3), "/b": fs(2, 3, 4, 5), "/c": fs(8)})
    assert shares == {"/a": Share(fs(0, 1, 2)), "/b": Share(fs(3, 4, 5)), "/c": Share(fs(8))}
    assert overlapping({"/a": fs(0, 1), "/b": fs(1, 2), "/c": fs(2, 3), "/d": fs(9)}) == [
        ["/a", "/b", "/c"],
        ["/d"],
    ]


def test_shares_are_disjoint_and_within_each_cpuset() -> None:
    sets = {f"/c{i}": frozenset(range(i, i + 5)) for i in range(0, 12, 2)}  # a chain of overlaps
    shares = compute_shares(sets)
    seen: set[int] = set()
    for name, share in shares.items():
        assert share.cpus <= sets[name] and share.reason is None
        assert not share.cpus & seen
        seen |= share.cpus
    assert compute_shares(dict(reversed(sets.items()))) == shares  # order does not matter


def test_a_container_whose_share_would_be_empty_is_refused_and_the_rest_reshared() -> None:
    shares = compute_shares({"/a": fs(0, 1), "/b": fs(0, 1), "/c": fs(0, 1)})
    assert shares["/a"] == Share(fs(0)) and shares["/b"] == Share(fs(1))
    assert shares["/c"].cpus == frozenset()
    assert shares["/c"].reason == (
        "cannot place: its CPUs 0-1 are all shared with /a, /b, "
        "and a share of them is less than one CPU"
    )
    assert compute_shares({"/e": fs()})["/e"].reason == "cannot place: its cgroup allows no CPU"
    assert compute_shares({}) == {}
