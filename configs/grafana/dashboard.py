"""The Grafana dashboard as code (grafana-foundation-sdk); writes JSON, reads nothing.

    .venv/bin/python configs/grafana/dashboard.py > configs/grafana/placement-supervisor.json
    .venv/bin/python configs/grafana/dashboard.py --out configs/grafana/placement-supervisor.json

`placement-supervisor.json` is this script's output, committed so Grafana can
provision it without Python; tests/serve/test_dashboard.py fails when the two differ.
A fleet is one Prometheus job with one `instance` per host: every query filters
on `instance=~"$host"` and `pod=~"$pod"`, and every aggregation and match keeps
`instance`, `namespace`, `pod` and `container` (WHERE, see `agg`), so "All" never
adds rank 0 of one host, or of one container of a node agent, to another's.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from collections.abc import Iterator, Sequence

from grafana_foundation_sdk.builders import common as cb
from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.builders import prometheus, stat, statetimeline, table, timeseries
from grafana_foundation_sdk.cog.builder import Builder
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models import dashboard as dm
from grafana_foundation_sdk.models import prometheus as pm

UID = "placement-supervisor"
DATASOURCE = dm.DataSourceRef(type_val="prometheus", uid="${datasource}")
# `node`: the Kubernetes node a pod runs on (the PodMonitor's relabeling); a pod's
# IP, its `instance`, changes at each Recreate. Off Kubernetes there is no `node`
# label: the variable's "All" is ".*", which matches its absence.
# `pod`: a node agent's container's pod (or the pod an in-pod supervisor runs in, the
# PodMonitor's label). A supervisor off Kubernetes has none: "All" is ".*" again.
HOST = 'instance=~"$host", node=~"$node", pod=~"$pod"'
HOST_RANK = 'instance=~"$host", node=~"$node", pod=~"$pod", rank=~"$rank"'
# What one supervisor's series have in common: a node agent serves several
# supervisors' series under one `instance`, each with its container's labels.
WHERE_LABELS = ("instance", "namespace", "pod", "container")
WHERE = ", ".join(WHERE_LABELS)
WORST_SERIES = 10  # counter panels: the series with the most over the range
LOWEST = 5  # the local memory ratio graph: the lowest host/rank pairs over the range

Panel = Builder[dm.Panel]


def agg(op: str, labels: Sequence[str], expr: str) -> str:
    """`op by (WHERE..., labels...) (expr)`: one series per supervisor, never a sum
    over hosts or over a node agent's containers."""
    return f"{op} by ({', '.join((*WHERE_LABELS, *labels))}) ({expr})"


def query(expr: str, legend: str, ref_id: str = "A") -> prometheus.Dataquery:
    return (
        prometheus.Dataquery()
        .datasource(DATASOURCE)
        .expr(expr)
        .legend_format(legend)
        .ref_id(ref_id)
        .range()
    )


def table_query(expr: str, ref_id: str = "A") -> prometheus.Dataquery:
    return (
        prometheus.Dataquery()
        .datasource(DATASOURCE)
        .expr(expr)
        .format(pm.PromQueryFormat.TABLE)
        .ref_id(ref_id)
        .instant()
    )


def steps(*colors: tuple[float | None, str]) -> db.ThresholdsConfig:
    return (
        db.ThresholdsConfig()
        .mode(dm.ThresholdsMode.ABSOLUTE)
        .steps([dm.Threshold(value=value, color=color) for value, color in colors])
    )


def last_value() -> cb.ReduceDataOptions:
    return cb.ReduceDataOptions().calcs(["lastNotNull"]).fields("").values(False)


def stat_panel(title: str, description: str, *queries: prometheus.Dataquery) -> stat.Panel:
    p = stat.Panel().title(title).description(description).datasource(DATASOURCE).height(4)
    for q in queries:
        p = p.with_target(q)
    return p.reduce_options(last_value())


def graph(title: str, description: str, *queries: prometheus.Dataquery) -> timeseries.Panel:
    p = timeseries.Panel().title(title).description(description).datasource(DATASOURCE).height(8)
    for q in queries:
        p = p.with_target(q)
    return p.legend(
        cb.VizLegendOptions()
        .display_mode(common.LegendDisplayMode.LIST)
        .placement(common.LegendPlacement.BOTTOM)
        .show_legend(True)
    ).tooltip(
        cb.VizTooltipOptions()
        .mode(common.TooltipDisplayMode.MULTI)
        .sort(common.SortOrder.DESCENDING)
    )


def increase(
    metric: str, selector: str = HOST_RANK, window: str = "$__rate_interval", at: str = ""
) -> str:
    """`increase(metric{selector}[window])`; `at` e.g. " @ end()" (the @ modifier)."""
    return f"increase({metric}{{{selector}}}[{window}]{at})"


def nonzero_ranked(metric: str, labels: Sequence[str], selector: str = HOST_RANK) -> str:
    """A counter's increase per series, only where it is not 0, and only the
    WORST_SERIES series with the most over the dashboard's range (`@ end()` ranks once
    for the whole range, rather than a new top list per step)."""
    on = ", ".join((*WHERE_LABELS, *labels))
    now = agg("sum", labels, increase(metric, selector))
    total = agg("sum", labels, increase(metric, selector, "$__range", " @ end()"))
    return f"{now} > 0 and on({on}) topk({WORST_SERIES}, {total} > 0)"


def ranked_legend() -> cb.VizLegendOptions:
    """A table legend sorted by each series' total: the worst first."""
    return (
        cb.VizLegendOptions()
        .display_mode(common.LegendDisplayMode.TABLE)
        .placement(common.LegendPlacement.BOTTOM)
        .show_legend(True)
        .calcs(["sum", "max"])
        .sort_by("Total")
        .sort_desc(True)
    )


# -- rows --------------------------------------------------------------------------------


# The stat panels sum over the hosts chosen (one or two tiles, however many hosts):
# the graphs and tables below say which host.
def health() -> Iterator[Panel]:
    yield (
        stat_panel(
            "Hosts not ready",
            "Hosts where some process is not running and bound as planned (GET /readyz "
            "answers 503); 0: every host chosen is ready.",
            query(f"sum(1 - placement_ready{{{HOST}}})", "not ready"),
        )
        .span(4)
        .color_mode(common.BigValueColorMode.BACKGROUND)
        .thresholds(steps((None, "green"), (1, "red")))
        .mappings([dm.ValueMap(options={"0": dm.ValueMappingResult(text="all ready")})])
    )
    yield stat_panel(
        "Processes running",
        "Supervised processes running / planned (engine + ranks), on all hosts chosen.",
        query(f"sum(placement_up{{{HOST}}})", "running"),
        query(f"count(placement_up{{{HOST}}})", "planned", "B"),
    ).span(4)
    yield (
        stat_panel(
            "Bind failures in range",
            "Binds the kernel refused (thread, memory, IRQ, cgroup) over the dashboard's "
            "time range, for the processes and the supervisor's own binds.",
            query(f"sum({increase('placement_bind_failures_total', HOST, '$__range')})", "ranks"),
            query(
                f"sum({increase('placement_host_bind_failures_total', HOST, '$__range')})",
                "supervisor",
                "B",
            ),
        )
        .span(4)
        .color_mode(common.BigValueColorMode.BACKGROUND)
        .thresholds(steps((None, "green"), (1, "orange")))
    )
    yield (
        stat_panel(
            "Last check age",
            "Seconds since the last placement check finished, on the host that is "
            "longest without one (alert PlacementChecksStalled above 60 s).",
            query(f"max(time() - placement_last_check_timestamp_seconds{{{HOST}}})", "oldest"),
        )
        .span(4)
        .unit("s")
        .color_mode(common.BigValueColorMode.BACKGROUND)
        .thresholds(steps((None, "green"), (10, "orange"), (60, "red")))
    )
    yield (
        stat_panel(
            "Restarts in range",
            "Restarts of the engine and workers by the supervisor over the time range.",
            query(f"sum({increase('placement_restarts_total', HOST, '$__range')})", "restarts"),
        )
        .span(4)
        .color_mode(common.BigValueColorMode.BACKGROUND)
        .thresholds(steps((None, "green"), (1, "orange"), (3, "red")))
    )
    yield (
        stat_panel(
            "Config in force",
            "Hosts whose last reload was refused or invalid, or whose config file on disk "
            "differs from the one in force (an edit not reloaded): alert "
            "PlacementConfigNotApplied after 10 minutes. 0: every host runs its file.",
            query(
                "sum(clamp_max("
                f"(1 - min by ({WHERE}) (placement_config_last_reload_successful{{{HOST}}}))"
                f" + on({WHERE}) ("
                f"count by ({WHERE}) (placement_config_on_disk_info{{{HOST}}}"
                f" unless on({WHERE}, job, sha256) placement_config_info{{{HOST}}})"
                f" or on({WHERE}) (0 * count by ({WHERE}) (placement_config_info{{{HOST}}})))"
                ", 1))",
                "hosts not applied",
            ),
        )
        .span(4)
        .color_mode(common.BigValueColorMode.BACKGROUND)
        .thresholds(steps((None, "green"), (1, "red")))
        .mappings([dm.ValueMap(options={"0": dm.ValueMappingResult(text="all in force")})])
    )
    yield (
        statetimeline.Panel()
        .title("Process state")
        .description(
            "The processes not running, and which state each is in (starting, stopping, "
            "backoff, failed, stopped, waiting) while it is: an empty panel is every "
            "process running."
        )
        .datasource(DATASOURCE)
        .with_target(
            query(
                agg(
                    "max",
                    ("rank", "state"),
                    f'placement_process_state{{{HOST_RANK}, state!="running"}}',
                )
                + " == 1",
                "{{instance}} {{pod}} {{rank}} {{state}}",
            )
        )
        .height(8)
        .span(12)
        .color_scheme(db.FieldColor().mode(dm.FieldColorModeId.PALETTE_CLASSIC))
        .show_value(common.VisibilityMode.NEVER)
        .merge_values(True)
    )
    yield (
        graph(
            "Down or unbound",
            "Only the processes that are not up (placement_up 0: not running) or not bound "
            "(placement_bound 0: a planned bind not applied or not read back), while they "
            "are not: an empty panel is a healthy fleet.",
            query(f"placement_up{{{HOST_RANK}}} == 0", "down {{instance}} {{pod}} {{rank}}"),
            query(
                f"placement_bound{{{HOST_RANK}}} == 0", "unbound {{instance}} {{pod}} {{rank}}", "B"
            ),
        )
        .span(12)
        .min(0)
        .max(1)
    )


RATIO = f"placement_local_memory_ratio{{{HOST_RANK}}}"
# The LOWEST host/rank pairs by their lowest ratio over the range (ranked once, at
# its end), drawn at every step; and the thresholds of their hosts.
LOWEST_RATIO_EXPR = (
    f"{RATIO} and on({WHERE}, rank) bottomk({LOWEST}, min_over_time({RATIO}[$__range] @ end()))"
)
LOWEST_THRESHOLD_EXPR = (
    f"max by ({WHERE}) (placement_local_memory_ratio_threshold{{{HOST}}})"
    f" and on({WHERE}) bottomk({LOWEST}, min_over_time({RATIO}[$__range] @ end()))"
)
LOWEST_TABLE_EXPR = f"sort(bottomk({WORST_SERIES}, {RATIO}))"


def memory_locality() -> Iterator[Panel]:
    yield (
        graph(
            f"Local memory ratio: the lowest {LOWEST}",
            "Resident memory on the planned NUMA nodes / all resident memory, of the "
            f"{LOWEST} host/rank pairs lowest over the time range, with their hosts' "
            "configured thresholds (dashed). Alert PlacementLocalMemoryLow when a rank stays "
            "below its host's threshold for 5 minutes.",
            query(LOWEST_RATIO_EXPR, "{{instance}} {{pod}} rank {{rank}}"),
            query(LOWEST_THRESHOLD_EXPR, "{{instance}} {{pod}} threshold", "B"),
        )
        .span(12)
        .unit("percentunit")
        .min(0)
        .max(1)
        .override_by_query(
            "B",
            [
                dm.DynamicConfigValue(
                    id_val="custom.lineStyle", value={"fill": "dash", "dash": [10, 10]}
                ),
                dm.DynamicConfigValue(id_val="color", value={"mode": "fixed", "fixedColor": "red"}),
            ],
        )
    )
    yield (
        table.Panel()
        .title("Lowest local memory ratio now")
        .description(
            f"The {WORST_SERIES} host/rank pairs with the lowest local memory ratio now, "
            "lowest first."
        )
        .datasource(DATASOURCE)
        .with_target(table_query(LOWEST_TABLE_EXPR))
        .with_transformation(
            dm.DataTransformerConfig(
                id_val="organize",
                options={
                    "excludeByName": {"Time": True, "__name__": True, "job": True},
                    "indexByName": {"instance": 0, "pod": 1, "rank": 2, "Value": 3},
                    "renameByName": {"instance": "host", "Value": "local memory ratio"},
                },
            )
        )
        .with_transformation(
            dm.DataTransformerConfig(
                id_val="sortBy", options={"sort": [{"field": "local memory ratio"}]}
            )
        )
        .height(8)
        .span(8)
        .unit("percentunit")
    )
    yield (
        stat_panel(
            "Local memory threshold",
            "drift.local_memory_threshold of the hosts' configs, lowest and highest: a ratio "
            "below it is a memory_locality finding (re-bound where "
            "drift.policy.memory_locality is enforce).",
            query(f"min(placement_local_memory_ratio_threshold{{{HOST}}})", "lowest"),
            query(f"max(placement_local_memory_ratio_threshold{{{HOST}}})", "highest", "B"),
        )
        .span(4)
        .height(8)
        .unit("percentunit")
    )
    yield (
        graph(
            "Memory by NUMA node",
            "Resident memory of each process per NUMA node (a line per rank and node: "
            "choose a host).",
            query(
                agg("sum", ("rank", "node"), f"placement_memory_bytes{{{HOST_RANK}}}"),
                "{{instance}} {{pod}} rank {{rank}} node {{node}}",
            ),
        )
        .span(10)
        .unit("bytes")
        .stacking(cb.StackingConfig().mode(common.StackingMode.NORMAL).group("A"))
        .fill_opacity(30)
    )


# The bind failure counters are pre-initialised at 0 for every rank, target and
# reason (metrics.py: `increase()` needs it): ~3,700 series for 20 hosts of 8 ranks,
# almost all 0 forever. The panels show only what is not 0, worst hosts first.
WORST_HOSTS = 10
BIND_FAILURES = "placement_bind_failures_total"


# Failures per host over the dashboard's range: the table ranks them at the range's
# end; the graph keeps the series of the same hosts at every step (`@ end()`
# fixes the ranking, rather than a new top 10 per step).
def host_failures_in_range(at: str = "") -> str:
    return agg("sum", (), increase(BIND_FAILURES, HOST_RANK, "$__range", at)) + " > 0"


WORST_HOSTS_EXPR = f"sort_desc(topk({WORST_HOSTS}, {host_failures_in_range()}))"
BIND_FAILURES_EXPR = (
    agg("sum", ("rank", "target", "reason"), increase(BIND_FAILURES))
    + f" > 0 and on({WHERE}) topk({WORST_HOSTS}, {host_failures_in_range(' @ end()')})"
)


def binding_and_drift() -> Iterator[Panel]:
    yield (
        graph(
            "Bind failures",
            f"Refused binds by target (process, thread, memory, irq, cgroup) and reason "
            f"(gone, denied, invalid, managed): only series that are not 0, of the "
            f"{WORST_HOSTS} hosts with the most failures over the time range; legend "
            f"sorted by total.",
            query(BIND_FAILURES_EXPR, "{{instance}} {{pod}} rank {{rank}} {{target}} {{reason}}"),
        )
        .span(8)
        .legend(ranked_legend())
    )
    yield (
        table.Panel()
        .title("Worst hosts: bind failures in range")
        .description(
            f"The {WORST_HOSTS} hosts with the most refused binds over the time range, "
            "most first; hosts without any are not listed."
        )
        .datasource(DATASOURCE)
        .with_target(table_query(WORST_HOSTS_EXPR))
        .with_transformation(
            dm.DataTransformerConfig(
                id_val="organize",
                options={
                    "excludeByName": {"Time": True},
                    "indexByName": {"instance": 0, "pod": 1, "Value": 2},
                    "renameByName": {"instance": "host", "Value": "bind failures"},
                },
            )
        )
        .with_transformation(
            dm.DataTransformerConfig(
                id_val="sortBy",
                options={"sort": [{"field": "bind failures", "desc": True}]},
            )
        )
        .height(8)
        .span(8)
    )
    # Counters pre-initialised at 0 for every rank and kind/reason: only what is not 0,
    # the WORST_SERIES most first (nonzero_ranked).
    yield (
        graph(
            "Drift events",
            "Differences between plan and live state found by the checks: series not 0 only, "
            f"the {WORST_SERIES} with the most over the time range.",
            query(
                nonzero_ranked("placement_drift_events_total", ("rank", "kind")),
                "{{instance}} {{pod}} rank {{rank}} {{kind}}",
            ),
        )
        .span(8)
        .legend(ranked_legend())
    )
    findings = f"placement_drift_findings{{{HOST_RANK}}}"
    yield (
        graph(
            "Current drift findings",
            "Findings standing now (alert PlacementDriftPersists after 10 minutes): series not "
            f"0 only, the {WORST_SERIES} with the most at any time in the range.",
            query(
                agg("sum", ("rank", "kind"), findings)
                + f" > 0 and on({WHERE}, rank, kind) topk({WORST_SERIES}, "
                + agg("sum", ("rank", "kind"), f"max_over_time({findings}[$__range] @ end())")
                + " > 0)",
                "{{instance}} {{pod}} rank {{rank}} {{kind}}",
            ),
        )
        .span(8)
        .legend(ranked_legend())
    )
    yield (
        graph(
            "Re-binds",
            "Re-binds applied by reason: the drift kind corrected (thread_affinity, "
            "memory_locality, irq_affinity), thread_role (a new thread put in its role), "
            f"cpuset_changed, api: series not 0 only, the {WORST_SERIES} with the most.",
            query(
                nonzero_ranked("placement_rebinds_total", ("rank", "reason")),
                "{{instance}} {{pod}} rank {{rank}} {{reason}}",
            ),
        )
        .span(8)
        .legend(ranked_legend())
    )
    yield (
        graph(
            "Cpuset changes",
            "Changes of the supervisor's allowed cpuset (each one re-plans): hosts with any, "
            f"the {WORST_SERIES} with the most.",
            query(
                nonzero_ranked("placement_cpuset_changes_total", (), HOST), "{{instance}} {{pod}}"
            ),
        )
        .span(8)
        .legend(ranked_legend())
    )
    yield (
        graph(
            "Supervisor bind failures",
            "The supervisor's own binds that the kernel refused: its instance cgroup and the "
            "IRQ re-plan after a cpuset change (no rank: placement_host_bind_failures_total): "
            f"series not 0 only, the {WORST_SERIES} with the most.",
            query(
                nonzero_ranked("placement_host_bind_failures_total", ("target", "reason"), HOST),
                "{{instance}} {{pod}} {{target}} {{reason}}",
            ),
        )
        .span(8)
        .legend(ranked_legend())
    )


# The plan table's one query: CPUs per role, left-joined on (instance, rank) with
# the memory-policy step, so each row carries its process's policy; `or` keeps
# the processes that report no policy yet (PromQL has no outer join of its own).
PLANNED_CPUS = agg("sum", ("rank", "role"), f"placement_planned_cpus{{{HOST_RANK}}}")
MEMPOLICY = agg("max", ("rank", "policy"), f"placement_mempolicy{{{HOST_RANK}}}") + " == 1"
PLAN_EXPR = (
    f"{PLANNED_CPUS} * on({WHERE}, rank) group_left(policy) ({MEMPOLICY})"
    f" or on({WHERE}, rank, role) {PLANNED_CPUS}"
)


def processes() -> Iterator[Panel]:
    yield (
        graph(
            "Restarts",
            "Restarts by the supervisor (alert PlacementRankCrashLooping at 3 in 15 minutes): "
            f"processes with any, the {WORST_SERIES} with the most.",
            query(
                nonzero_ranked("placement_restarts_total", ("rank",)),
                "{{instance}} {{pod}} rank {{rank}}",
            ),
        )
        .span(8)
        .legend(ranked_legend())
    )
    yield (
        graph(
            "Restart backoff",
            "Delay before the next start while a process is in backoff (only those).",
            query(
                f"placement_backoff_seconds{{{HOST_RANK}}} > 0",
                "{{instance}} {{pod}} rank {{rank}}",
            ),
        )
        .span(8)
        .unit("s")
    )
    yield graph(
        "Threads per role",
        "Threads the last check found in each process, by role (a line per rank and role: "
        "choose a host).",
        query(
            agg("sum", ("rank", "role"), f"placement_threads{{{HOST_RANK}}}"),
            "{{instance}} {{pod}} rank {{rank}} {{role}}",
        ),
    ).span(8)
    yield (
        table.Panel()
        .title("Plan and memory policy")
        .description(
            "CPUs the plan gives each role, and the memory-policy step its process got "
            "(bind, preferred, none; empty until the process reports one): a row per rank "
            "and role, choose a host."
        )
        .datasource(DATASOURCE)
        .with_target(table_query(PLAN_EXPR))
        .with_transformation(
            dm.DataTransformerConfig(
                id_val="organize",
                options={
                    "excludeByName": {"Time": True},
                    "indexByName": {
                        "instance": 0,
                        "pod": 1,
                        "rank": 2,
                        "role": 3,
                        "Value": 4,
                        "policy": 5,
                    },
                    "renameByName": {"Value": "CPUs", "policy": "memory policy"},
                },
            )
        )
        .height(8)
        .span(24)
    )


def host_table(title: str, description: str, expr: str, columns: dict[str, str]) -> Panel:
    """An instant table of `expr`'s series, one row each: host, then `columns` (label: heading)."""
    order = {"instance": 0, "pod": 1, **{label: i + 2 for i, label in enumerate(columns)}}
    return (
        table.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .with_target(table_query(expr))
        .with_transformation(
            dm.DataTransformerConfig(
                id_val="organize",
                options={
                    "excludeByName": {"Time": True, "Value": True, "__name__": True, "job": True},
                    "indexByName": order,
                    "renameByName": {"instance": "host", **columns},
                },
            )
        )
        .height(8)
    )


# A capability the host denies while the config wants it (placement_capability_wanted).
MISSING_CAPABILITIES = (
    f"placement_capability{{{HOST}}} == 0"
    f" and on({WHERE}, name) placement_capability_wanted{{{HOST}}} == 1"
)
CONFIG_HASHES = f"placement_config_info{{{HOST}}}"


def config_and_capabilities() -> Iterator[Panel]:
    # Sorted by the hash: a host on another file stands out of the run of the others.
    yield (
        host_table(
            "Config in force per host",
            "The config file each host runs and its sha256 (placement_config_info), sorted "
            "by the hash: a host whose hash differs from the others runs another file.",
            CONFIG_HASHES,
            {"sha256": "sha256", "path": "path"},
        )
        .with_transformation(
            dm.DataTransformerConfig(id_val="sortBy", options={"sort": [{"field": "sha256"}]})
        )
        .span(8)
    )
    yield (
        graph(
            "Config reloads",
            "Reloads by result (ok, invalid, refused): hosts with any, the "
            f"{WORST_SERIES} with the most over the time range.",
            query(
                nonzero_ranked("placement_config_reloads_total", ("result",), HOST),
                "{{instance}} {{pod}} {{result}}",
            ),
        )
        .span(8)
        .legend(ranked_legend())
    )
    yield host_table(
        "Missing capabilities",
        "What a host does not let the supervisor bind though the config wants it "
        "(mempolicy, cgroup, irq; probed at start; alert PlacementCapabilityMissing): one "
        "row per host and capability, none when nothing is missing. "
        "`placement-supervisor check` says what each costs and how to get it.",
        MISSING_CAPABILITIES,
        {"name": "capability"},
    ).span(8)


def checks() -> Iterator[Panel]:
    yield (
        graph(
            "Check duration",
            "Mean and last duration of a placement check (reading /proc, diffing, re-binding).",
            query(
                f"rate(placement_check_duration_seconds_sum{{{HOST}}}[$__rate_interval])"
                f" / rate(placement_check_duration_seconds_count{{{HOST}}}[$__rate_interval])",
                "mean {{instance}} {{pod}}",
            ),
            query(
                f"placement_last_check_duration_seconds{{{HOST}}}", "last {{instance}} {{pod}}", "B"
            ),
        )
        .span(12)
        .unit("s")
    )
    yield (
        graph(
            "Checks per second",
            "How often checks finish (drift.check_interval_s).",
            query(
                f"rate(placement_check_duration_seconds_count{{{HOST}}}[$__rate_interval])",
                "{{instance}} {{pod}}",
            ),
        )
        .span(12)
        .unit("ops")
    )


ROWS = (
    ("Health", health),
    ("Memory locality", memory_locality),
    ("Binding and drift", binding_and_drift),
    ("Processes", processes),
    ("Config and capabilities", config_and_capabilities),
    ("Checks", checks),
)


def variables() -> list[Builder[dm.VariableModel]]:
    def label_values(name: str, label: str, selector: str) -> db.QueryVariable:
        return (
            db.QueryVariable(name)
            .datasource(DATASOURCE)
            .query({"query": f"label_values({selector}, {label})", "refId": name})
            .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED)
            .multi(True)
            .include_all(True)
            .all_value(".+")
        )

    return [
        db.DatasourceVariable("datasource").label("Data source").type("prometheus"),
        # Kubernetes: the node stays when a Recreate gives the pod a new IP (instance).
        label_values("node", "node", "placement_info")
        .label("Node")
        .all_value(".*")
        .sort(dm.VariableSort.ALPHABETICAL_ASC),
        label_values("host", "instance", 'placement_info{node=~"$node"}')
        .label("Host")
        .sort(dm.VariableSort.ALPHABETICAL_ASC),
        # A node agent's containers' pods on the hosts chosen; "All" (.*) also keeps a
        # supervisor's series without any pod label (off Kubernetes).
        label_values("pod", "pod", 'placement_up{instance=~"$host", node=~"$node"}')
        .label("Pod")
        .all_value(".*")
        .sort(dm.VariableSort.ALPHABETICAL_ASC),
        label_values("rank", "rank", f"placement_up{{{HOST}}}")
        .label("Rank")
        .sort(dm.VariableSort.NUMERICAL_ASC),
    ]


def build() -> dm.Dashboard:
    board = (
        db.Dashboard("Placement Supervisor")
        .uid(UID)
        .description(
            "Placement Supervisor: bind health per host and rank (memory locality, bind "
            "failures, drift, re-binds, restarts, checks)."
        )
        .tags(["placement-supervisor", "numa"])
        .editable()
        .tooltip(dm.DashboardCursorSync.CROSSHAIR)
        .refresh("30s")
        .time("now-3h", "now")
        .timezone("")
        .variables(variables())
        .annotation(
            db.AnnotationQuery()
            .name("Annotations & Alerts")
            .datasource(dm.DataSourceRef(type_val="grafana", uid="-- Grafana --"))
            .enable(True)
            .hide(True)
            .icon_color("rgba(0, 211, 255, 1)")
            .type("dashboard")
            .built_in(1)
        )
    )
    for title, panels in ROWS:
        board = board.with_row(db.Row(title))
        for p in panels():
            board = board.with_panel(p)
    model = board.build()
    ids = itertools.count(1)
    for panel in model.panels or []:
        panel.id_val = next(ids)
    return model


def render() -> str:
    """The dashboard JSON exactly as committed (sorted keys, two-space indent, final newline)."""
    return json.dumps(build(), cls=JSONEncoder, indent=2, sort_keys=True) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the JSON to this file instead of stdout")
    args = parser.parse_args(argv)
    text = render()
    if args.out is None:
        sys.stdout.write(text)
    else:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
