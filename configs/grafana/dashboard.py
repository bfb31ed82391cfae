"""The Grafana dashboard as code (grafana-foundation-sdk); writes JSON, reads nothing.

    .venv/bin/python configs/grafana/dashboard.py > configs/grafana/placement-supervisor.json
    .venv/bin/python configs/grafana/dashboard.py --out configs/grafana/placement-supervisor.json

`placement-supervisor.json` is this script's output, committed so Grafana can
provision it without Python; tests/serve/test_dashboard.py fails when the two differ.
A fleet is one Prometheus job with one `instance` per host: every query filters
on `instance=~"$host"` and every aggregation keeps `instance` (see `agg`), so
"All" hosts never adds rank 0 of one host to rank 0 of another.
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
HOST = 'instance=~"$host"'
HOST_RANK = 'instance=~"$host", rank=~"$rank"'

Panel = Builder[dm.Panel]


def agg(op: str, labels: Sequence[str], expr: str) -> str:
    """`op by (instance, labels...) (expr)`: one series per host, never a sum over hosts."""
    return f"{op} by ({', '.join(('instance', *labels))}) ({expr})"


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


# -- rows --------------------------------------------------------------------------------


def health() -> Iterator[Panel]:
    yield (
        stat_panel(
            "Ready",
            "1 when every process is running and bound as planned (GET /readyz).",
            query(f"placement_ready{{{HOST}}}", "{{instance}}"),
        )
        .span(4)
        .color_mode(common.BigValueColorMode.BACKGROUND)
        .thresholds(steps((None, "red"), (1, "green")))
        .mappings(
            [
                dm.ValueMap(
                    options={
                        "0": dm.ValueMappingResult(text="NOT READY"),
                        "1": dm.ValueMappingResult(text="ready"),
                    }
                )
            ]
        )
    )
    yield stat_panel(
        "Processes running",
        "Supervised processes running / planned (engine + ranks).",
        query(agg("sum", (), f"placement_up{{{HOST}}}"), "running {{instance}}"),
        query(agg("count", (), f"placement_up{{{HOST}}}"), "planned {{instance}}", "B"),
    ).span(4)
    yield (
        stat_panel(
            "Bind failures in range",
            "Binds the kernel refused (thread, memory, IRQ, cgroup) over the dashboard's "
            "time range, for the processes and the supervisor's own binds.",
            query(
                agg("sum", (), increase("placement_bind_failures_total", HOST, "$__range")),
                "ranks {{instance}}",
            ),
            query(
                agg("sum", (), increase("placement_host_bind_failures_total", HOST, "$__range")),
                "supervisor {{instance}}",
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
            "Seconds since the last placement check finished "
            "(alert PlacementChecksStalled above 60 s).",
            query(f"time() - placement_last_check_timestamp_seconds{{{HOST}}}", "{{instance}}"),
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
            query(
                agg("sum", (), increase("placement_restarts_total", HOST, "$__range")),
                "{{instance}}",
            ),
        )
        .span(4)
        .color_mode(common.BigValueColorMode.BACKGROUND)
        .thresholds(steps((None, "green"), (1, "orange"), (3, "red")))
    )
    yield (
        stat_panel(
            "Config in force",
            "0 when the config file on disk is the one in force and the last reload applied; "
            "1 or 2 when the last reload was refused or invalid, or the file on disk differs "
            "(an edit not reloaded): alert PlacementConfigNotApplied after 10 minutes.",
            query(
                f"(1 - min by (instance) (placement_config_last_reload_successful{{{HOST}}}))"
                " + on(instance) ("
                f"count by (instance) (placement_config_on_disk_info{{{HOST}}}"
                f" unless on(instance, job, sha256) placement_config_info{{{HOST}}})"
                f" or on(instance) (0 * count by (instance) (placement_config_info{{{HOST}}})))",
                "{{instance}}",
            ),
        )
        .span(4)
        .color_mode(common.BigValueColorMode.BACKGROUND)
        .thresholds(steps((None, "green"), (1, "red")))
        .mappings(
            [
                dm.ValueMap(options={"0": dm.ValueMappingResult(text="in force")}),
                dm.RangeMap(
                    options=dm.DashboardRangeMapOptions(
                        from_val=1, to=2, result=dm.ValueMappingResult(text="NOT APPLIED")
                    )
                ),
            ]
        )
    )
    yield (
        statetimeline.Panel()
        .title("Process state")
        .description(
            "Which state each process is in (starting, running, stopping, backoff, failed, "
            "stopped, waiting)."
        )
        .datasource(DATASOURCE)
        .with_target(
            query(
                agg("max", ("rank", "state"), f"placement_process_state{{{HOST_RANK}}}") + " == 1",
                "{{instance}} {{rank}} {{state}}",
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
            "Up and bound",
            "placement_up: the process runs; placement_bound: every planned bind applied "
            "and read back.",
            query(f"placement_up{{{HOST_RANK}}}", "up {{instance}} {{rank}}"),
            query(f"placement_bound{{{HOST_RANK}}}", "bound {{instance}} {{rank}}", "B"),
        )
        .span(12)
        .min(0)
        .max(1)
    )


def memory_locality() -> Iterator[Panel]:
    yield (
        graph(
            "Local memory ratio",
            "Resident memory on the planned NUMA nodes / all resident memory, with each "
            "host's configured threshold (dashed). Alert PlacementLocalMemoryLow when a "
            "rank stays below its host's threshold for 5 minutes.",
            query(f"placement_local_memory_ratio{{{HOST_RANK}}}", "{{instance}} rank {{rank}}"),
            query(
                f"placement_local_memory_ratio_threshold{{{HOST}}}",
                "{{instance}} threshold",
                "B",
            ),
        )
        .span(10)
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
        stat_panel(
            "Local memory threshold",
            "drift.local_memory_threshold of each host's config: a ratio below it is a "
            "memory_locality finding (re-bound where drift.policy.memory_locality is "
            "enforce).",
            query(f"placement_local_memory_ratio_threshold{{{HOST}}}", "{{instance}}"),
        )
        .span(4)
        .height(8)
        .unit("percentunit")
    )
    yield (
        graph(
            "Memory by NUMA node",
            "Resident memory of each process per NUMA node.",
            query(
                agg("sum", ("rank", "node"), f"placement_memory_bytes{{{HOST_RANK}}}"),
                "{{instance}} rank {{rank}} node {{node}}",
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
    + f" > 0 and on(instance) topk({WORST_HOSTS}, {host_failures_in_range(' @ end()')})"
)


def binding_and_drift() -> Iterator[Panel]:
    yield (
        graph(
            "Bind failures",
            f"Refused binds by target (process, thread, memory, irq, cgroup) and reason "
            f"(gone, denied, invalid, managed): only series that are not 0, of the "
            f"{WORST_HOSTS} hosts with the most failures over the time range; legend "
            f"sorted by total.",
            query(BIND_FAILURES_EXPR, "{{instance}} rank {{rank}} {{target}} {{reason}}"),
        )
        .span(8)
        .legend(
            cb.VizLegendOptions()
            .display_mode(common.LegendDisplayMode.TABLE)
            .placement(common.LegendPlacement.BOTTOM)
            .show_legend(True)
            .calcs(["sum", "max"])
            .sort_by("Total")
            .sort_desc(True)
        )
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
                    "indexByName": {"instance": 0, "Value": 1},
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
    yield graph(
        "Drift events",
        "Differences between plan and live state found by the checks.",
        query(
            agg("sum", ("rank", "kind"), increase("placement_drift_events_total")),
            "{{instance}} rank {{rank}} {{kind}}",
        ),
    ).span(8)
    yield graph(
        "Current drift findings",
        "Findings standing now (alert PlacementDriftPersists after 10 minutes).",
        query(
            agg("sum", ("rank", "kind"), f"placement_drift_findings{{{HOST_RANK}}}"),
            "{{instance}} rank {{rank}} {{kind}}",
        ),
    ).span(8)
    yield graph(
        "Re-binds",
        "Re-binds applied by reason: the drift kind corrected (thread_affinity, "
        "memory_locality, irq_affinity), thread_role (a new thread put in its role), "
        "cpuset_changed, api.",
        query(
            agg("sum", ("rank", "reason"), increase("placement_rebinds_total")),
            "{{instance}} rank {{rank}} {{reason}}",
        ),
    ).span(8)
    yield graph(
        "Cpuset changes",
        "Changes of the supervisor's allowed cpuset (each one re-plans).",
        query(increase("placement_cpuset_changes_total", HOST), "{{instance}}"),
    ).span(8)
    yield graph(
        "Supervisor bind failures",
        "Binds of the supervisor's own the kernel refused: its instance cgroup and the "
        "IRQ re-plan after a cpuset change (no rank: placement_host_bind_failures_total).",
        query(
            agg("sum", ("target", "reason"), increase("placement_host_bind_failures_total", HOST)),
            "{{instance}} {{target}} {{reason}}",
        ),
    ).span(8)


# The plan table's one query: CPUs per role, left-joined on (instance, rank) with
# the memory-policy step, so each row carries its process's policy; `or` keeps
# the processes that report no policy yet (PromQL has no outer join of its own).
PLANNED_CPUS = agg("sum", ("rank", "role"), f"placement_planned_cpus{{{HOST_RANK}}}")
MEMPOLICY = agg("max", ("rank", "policy"), f"placement_mempolicy{{{HOST_RANK}}}") + " == 1"
PLAN_EXPR = (
    f"{PLANNED_CPUS} * on(instance, rank) group_left(policy) ({MEMPOLICY})"
    f" or on(instance, rank, role) {PLANNED_CPUS}"
)


def processes() -> Iterator[Panel]:
    yield graph(
        "Restarts",
        "Restarts by the supervisor (alert PlacementRankCrashLooping at 3 in 15 minutes).",
        query(
            agg("sum", ("rank",), increase("placement_restarts_total")),
            "{{instance}} rank {{rank}}",
        ),
    ).span(8)
    yield (
        graph(
            "Restart backoff",
            "Delay before the next start while a process is in backoff.",
            query(f"placement_backoff_seconds{{{HOST_RANK}}}", "{{instance}} rank {{rank}}"),
        )
        .span(8)
        .unit("s")
    )
    yield graph(
        "Threads per role",
        "Threads the last check found in each process, by role.",
        query(
            agg("sum", ("rank", "role"), f"placement_threads{{{HOST_RANK}}}"),
            "{{instance}} rank {{rank}} {{role}}",
        ),
    ).span(8)
    yield (
        table.Panel()
        .title("Plan and memory policy")
        .description(
            "CPUs the plan gives each role, and the memory-policy step its process got "
            "(bind, preferred, none; empty until the process reports one)."
        )
        .datasource(DATASOURCE)
        .with_target(table_query(PLAN_EXPR))
        .with_transformation(
            dm.DataTransformerConfig(
                id_val="organize",
                options={
                    "excludeByName": {"Time": True},
                    "indexByName": {"instance": 0, "rank": 1, "role": 2, "Value": 3, "policy": 4},
                    "renameByName": {"Value": "CPUs", "policy": "memory policy"},
                },
            )
        )
        .height(8)
        .span(24)
    )


def checks() -> Iterator[Panel]:
    yield (
        graph(
            "Check duration",
            "Mean and last duration of a placement check (reading /proc, diffing, re-binding).",
            query(
                f"rate(placement_check_duration_seconds_sum{{{HOST}}}[$__rate_interval])"
                f" / rate(placement_check_duration_seconds_count{{{HOST}}}[$__rate_interval])",
                "mean {{instance}}",
            ),
            query(f"placement_last_check_duration_seconds{{{HOST}}}", "last {{instance}}", "B"),
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
                "{{instance}}",
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
        label_values("host", "instance", "placement_info")
        .label("Host")
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
