"""compose/grafana: a dashboard Grafana can load, over the data source compose provisions.

Grafana does not run where the tests run, so these read the files: the dashboard
JSON has the structure Grafana's dashboard model needs (panels with unique ids,
grid positions inside the 24 columns, targets with ref ids and PromQL that
parses), every panel and query names the provisioned data source by its uid,
and the provisioning points Grafana at the folder the dashboard is mounted in.
That the queries' metrics are the ones a worker exports is checked against a
real worker (tests/integration/test_dashboard_metrics.py).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import yaml

from bench.dashboard import DASHBOARD, DATASOURCES, expr_metrics, load, queries
from bench.promql import parse
from tests.conftest import REPO

COMPOSE_DIR = REPO / "compose"
GRID_COLUMNS = 24
PANEL_TYPES = {"row", "timeseries", "stat", "gauge", "bargauge", "table", "text"}


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return load()


@pytest.fixture(scope="module")
def datasource() -> dict[str, Any]:
    [source] = yaml.safe_load(DATASOURCES.read_text())["datasources"]
    assert isinstance(source, dict)
    return source


def graphs(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in dashboard["panels"] if p["type"] != "row"]


def test_the_dashboard_has_what_grafana_needs_at_the_top(dashboard: dict[str, Any]) -> None:
    assert isinstance(dashboard["uid"], str)
    assert 0 < len(dashboard["uid"]) <= 40
    assert dashboard["title"]
    assert isinstance(dashboard["schemaVersion"], int)
    assert dashboard["schemaVersion"] >= 36
    assert isinstance(dashboard["panels"], list)
    assert dashboard["panels"]
    assert dashboard.get("id") is None  # Grafana assigns ids; a fixed one clashes on import
    assert set(dashboard["time"]) == {"from", "to"}


def test_panels_have_unique_ids_known_types_and_places_on_the_grid(
    dashboard: dict[str, Any],
) -> None:
    panels = dashboard["panels"]
    ids = [p["id"] for p in panels]
    assert all(isinstance(i, int) for i in ids)
    assert [i for i, n in Counter(ids).items() if n > 1] == []
    cells: set[tuple[int, int]] = set()
    for panel in panels:
        assert panel["type"] in PANEL_TYPES, panel["title"]
        assert panel["title"]
        grid = panel["gridPos"]
        assert set(grid) == {"h", "w", "x", "y"}, panel["title"]
        assert all(isinstance(v, int) and v >= 0 for v in grid.values()), panel["title"]
        assert grid["w"] >= 1
        assert grid["h"] >= 1
        assert grid["x"] + grid["w"] <= GRID_COLUMNS, panel["title"]
        covered = {
            (x, y)
            for x in range(grid["x"], grid["x"] + grid["w"])
            for y in range(grid["y"], grid["y"] + grid["h"])
        }
        assert not covered & cells, f"{panel['title']} overlaps another panel"
        cells |= covered


def test_every_graph_queries_the_provisioned_prometheus(
    dashboard: dict[str, Any], datasource: dict[str, Any]
) -> None:
    expected = {"type": "prometheus", "uid": datasource["uid"]}
    for panel in graphs(dashboard):
        assert panel["datasource"] == expected, panel["title"]
        targets = panel["targets"]
        assert targets, f"{panel['title']} has no query"
        ref_ids = [t["refId"] for t in targets]
        assert len(set(ref_ids)) == len(ref_ids), panel["title"]
        for target in targets:
            assert target["datasource"] == expected, panel["title"]
            assert target["expr"].strip(), panel["title"]
    for variable in dashboard["templating"]["list"]:
        assert variable["datasource"] == expected, variable["name"]


def test_every_query_parses_and_selects_a_conveyor_or_process_metric(
    dashboard: dict[str, Any],
) -> None:
    for query in queries(dashboard):
        names = expr_metrics(query.expr)
        assert names, query
        assert all(n.startswith(("conveyor_", "process_")) for n in names), query
        if "conveyor_" in query.expr:
            assert 'model=~"$model"' in query.expr, f"{query} ignores the model picked"


def test_a_query_that_is_not_promql_is_refused() -> None:
    with pytest.raises(ValueError, match="expected"):
        parse("sum by (status (rate(conveyor_requests_total[1m]))")
    with pytest.raises(ValueError, match="cannot read"):
        parse("rate(conveyor_requests_total[1m]) ^ 2")


def test_the_panels_cover_what_an_operator_watches(dashboard: dict[str, Any]) -> None:
    exprs = " ".join(q.expr for q in queries(dashboard))
    for metric in (
        "conveyor_requests_total",  # throughput, errors by status
        "conveyor_end_to_end_seconds_bucket",  # latency and its parts
        "conveyor_queue_wait_seconds_bucket",
        "conveyor_inference_seconds_bucket",
        "conveyor_consumer_lag",  # lag
        "conveyor_inference_seconds_sum",  # model (GPU) busy
        "conveyor_gpu_memory_allocated_bytes",
        "conveyor_dead_letters_total",  # errors by code
        "conveyor_superseded_total",
    ):
        assert metric in exprs, metric


def test_provisioning_loads_the_dashboard_folder_that_compose_mounts(
    datasource: dict[str, Any],
) -> None:
    assert datasource["type"] == "prometheus"
    assert datasource["url"] == "http://prometheus:9090"  # the compose service
    assert datasource["access"] == "proxy"
    providers = yaml.safe_load(
        (COMPOSE_DIR / "grafana" / "provisioning" / "dashboards" / "conveyor.yml").read_text()
    )["providers"]
    [provider] = providers
    assert provider["type"] == "file"
    compose = yaml.safe_load((COMPOSE_DIR / "docker-compose.yml").read_text())
    volumes = compose["services"]["grafana"]["volumes"]
    mounted = {v.split(":")[1]: v.split(":")[0] for v in volumes}
    assert mounted[provider["options"]["path"]] == "./grafana/dashboards"
    assert (COMPOSE_DIR / "grafana" / "dashboards" / DASHBOARD.name).is_file()
    assert mounted["/etc/grafana/provisioning"] == "./grafana/provisioning"
