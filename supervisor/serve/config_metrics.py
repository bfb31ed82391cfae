"""Metric families of the config in force, the file on disk and the last reload
(pure: each reads snapshot fields; registered by supervisor.serve.metrics in its
place among the supervisor's counters).

What PlacementConfigNotApplied reads: placement_config_info (in force) beside
placement_config_on_disk_info, and placement_config_last_reload_successful.
"""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily

from supervisor.serve.exposition import FamilyTable
from supervisor.state import RELOAD_RESULTS, ReloadVerdict


def register_config_families(table: FamilyTable) -> None:
    """Add the config families to `table`, in exposition order."""

    @table.add(
        "counter",
        "placement_config_reloads",
        "Config reloads (SIGHUP), by result: ok, invalid (old config kept), "
        "refused (needs a restart).",
        ("result",),
    )
    def _config_reloads(m: CounterMetricFamily, config_reloads: Mapping[str, int]) -> None:
        counts = dict.fromkeys(RELOAD_RESULTS, 0) | dict(config_reloads)
        for result, n in sorted(counts.items()):
            m.add_metric([result], n)

    @table.add(
        "info", "placement_config", "The config file in force: its path and sha256 (value 1)."
    )
    def _config_info(m: InfoMetricFamily, config_path: str | None, config_hash: str | None) -> None:
        m.add_metric([], {"path": config_path or "", "sha256": config_hash or ""})

    @table.add(
        "info",
        "placement_config_on_disk",
        "The config file as it is on disk now (read at each reload and every 10 s): its "
        'sha256, "" when it cannot be read (value 1). Differs from placement_config_info\'s '
        "while an edit is not in force.",
    )
    def _config_on_disk(m: InfoMetricFamily, config_on_disk_hash: str | None) -> None:
        m.add_metric([], {"sha256": config_on_disk_hash or ""})

    @table.add(
        "gauge",
        "placement_config_last_reload_successful",
        "1 when the last config reload was applied (or none was asked for yet), 0 when it "
        "was refused or invalid and the config before it stays in force.",
    )
    def _last_reload_ok(m: GaugeMetricFamily, last_reload: ReloadVerdict | None) -> None:
        m.add_metric([], 0.0 if last_reload is not None and last_reload.result != "ok" else 1.0)

    @table.add(
        "gauge",
        "placement_config_last_reload_timestamp_seconds",
        "Unix time the last config reload ended (0 before the first).",
    )
    def _last_reload_at(m: GaugeMetricFamily, last_reload: ReloadVerdict | None) -> None:
        m.add_metric([], 0.0 if last_reload is None else last_reload.at)
