"""Building blocks shared by kvwatch's dashboards: variables, selectors and panel helpers."""

from __future__ import annotations

from collections.abc import Sequence

from grafana_foundation_sdk.builders import common as common_builders
from grafana_foundation_sdk.builders import dashboard as dash
from grafana_foundation_sdk.builders import prometheus, stat, table, timeseries
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models.dashboard import (
    DashboardCursorSync,
    DashboardLinkType,
    DataSourceRef,
    DataTransformerConfig,
    Threshold,
    ThresholdsMode,
    VariableRefresh,
    VariableSort,
)
from grafana_foundation_sdk.models.prometheus import PromQueryFormat

from kvspool.catalogue import exposed

DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
JOB = 'job="kvwatch"'

# Label matchers that the dashboards' variables drive.
NODES = 'node=~"$node"'
ROLES = 'role=~"$role"'
NODE_ROLE = f"{NODES}, {ROLES}"
ONE_NODE = 'node="$node"'
ONE_NODE_ROLE = f"{ONE_NODE}, {ROLES}"

GREEN_RED = [Threshold(value=None, color="green"), Threshold(value=1, color="red")]
GREEN_ORANGE_RED = [
    Threshold(value=None, color="green"),
    Threshold(value=1, color="orange"),
    Threshold(value=2, color="red"),
]


def skeleton(
    title: str, uid: str, description: str, *, since: str, one_node: bool
) -> dash.Dashboard:
    """A kvwatch dashboard before its panels: the time range back to ``since``, the data source,
    node (one or many) and role variables, and the dropdown linking the kvwatch dashboards."""
    return (
        dash.Dashboard(title)
        .uid(uid)
        .description(description)
        .tags(["kvwatch", "kv-cache", "llm-serving"])
        .editable()
        .tooltip(DashboardCursorSync.CROSSHAIR)
        .time(since, "now")
        .refresh("30s")
        .timezone("browser")
        .with_variable(datasource_variable())
        .with_variable(node_variable(multi=not one_node))
        .with_variable(role_variable(ONE_NODE if one_node else NODES))
        .link(
            dash.DashboardLink("kvwatch dashboards")
            .type(DashboardLinkType.DASHBOARDS)
            .tags(["kvwatch"])
            .as_dropdown(True)
            .include_vars(True)
            .keep_time(True)
        )
    )


def datasource_variable() -> dash.DatasourceVariable:
    return dash.DatasourceVariable("datasource").label("Data source").type("prometheus")


def query_variable(
    name: str, label: str, query: str, *, multi: bool, include_all: bool
) -> dash.QueryVariable:
    variable = (
        dash.QueryVariable(name)
        .label(label)
        .datasource(DATASOURCE)
        .query(query)
        .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(VariableSort.ALPHABETICAL_ASC)
        .multi(multi)
        .include_all(include_all)
    )
    if include_all:
        variable = variable.all_value(".*")
    return variable


def node_variable(*, multi: bool) -> dash.QueryVariable:
    return query_variable(
        "node",
        "Node",
        f"label_values(up{{{JOB}}}, node)",
        multi=multi,
        include_all=multi,
    )


def role_variable(node_matcher: str) -> dash.QueryVariable:
    return query_variable(
        "role",
        "Role",
        f"label_values({exposed('engine_info')}{{{node_matcher}}}, role)",
        multi=True,
        include_all=True,
    )


def query(expr: str, legend: str = "", ref: str = "A") -> prometheus.Dataquery:
    q = prometheus.Dataquery().expr(expr).ref_id(ref).datasource(DATASOURCE).range()
    if legend:
        q = q.legend_format(legend)
    return q


def instant_table_query(expr: str, ref: str = "A") -> prometheus.Dataquery:
    return (
        prometheus.Dataquery()
        .expr(expr)
        .ref_id(ref)
        .datasource(DATASOURCE)
        .instant()
        .format(PromQueryFormat.TABLE)
    )


def thresholds(steps: Sequence[Threshold]) -> dash.ThresholdsConfig:
    return dash.ThresholdsConfig().mode(ThresholdsMode.ABSOLUTE).steps(list(steps))


class Ids:
    """Panel ids in the order panels are built: stable across regenerations."""

    def __init__(self) -> None:
        self.last = 0

    def __call__(self) -> int:
        self.last += 1
        return self.last


def timeseries_panel(
    ids: Ids,
    title: str,
    description: str,
    targets: Sequence[prometheus.Dataquery],
    *,
    unit: str = "short",
    width: int = 12,
    height: int = 8,
    bars: bool = False,
) -> timeseries.Panel:
    panel = (
        timeseries.Panel()
        .id(ids())
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .targets(list(targets))
        .unit(unit)
        .min(0)
        .span(width)
        .height(height)
        .legend(
            common_builders.VizLegendOptions()
            .display_mode(common.LegendDisplayMode.TABLE)
            .placement(common.LegendPlacement.BOTTOM)
            .show_legend(True)
            .calcs(["lastNotNull", "max"])
        )
        .tooltip(common_builders.VizTooltipOptions().mode(common.TooltipDisplayMode.MULTI))
    )
    if bars:
        panel = panel.draw_style(common.GraphDrawStyle.BARS).fill_opacity(80)
    else:
        panel = panel.line_width(1).fill_opacity(10)
    return panel


def stat_panel(
    ids: Ids,
    title: str,
    description: str,
    expr: str,
    *,
    steps: Sequence[Threshold] = GREEN_RED,
    unit: str = "short",
    width: int = 6,
    height: int = 4,
) -> stat.Panel:
    return (
        stat.Panel()
        .id(ids())
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .with_target(query(expr))
        .unit(unit)
        .span(width)
        .height(height)
        .thresholds(thresholds(steps))
        .color_mode(common.BigValueColorMode.BACKGROUND)
        .graph_mode(common.BigValueGraphMode.NONE)
        .reduce_options(common_builders.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
    )


def table_panel(
    ids: Ids,
    title: str,
    description: str,
    targets: Sequence[prometheus.Dataquery],
    *,
    rename: dict[str, str],
    width: int = 12,
    height: int = 8,
    steps: Sequence[Threshold] | None = None,
) -> table.Panel:
    """A table of instant queries, merged on their labels, ``Time`` hidden, columns renamed."""
    transformations = []
    if len(targets) > 1:
        transformations.append(DataTransformerConfig(id_val="merge", options={}))
    transformations.append(
        DataTransformerConfig(
            id_val="organize",
            options={"excludeByName": {"Time": True}, "renameByName": dict(rename)},
        )
    )
    panel = (
        table.Panel()
        .id(ids())
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .targets(list(targets))
        .transformations(transformations)
        .span(width)
        .height(height)
    )
    if steps is not None:
        panel = panel.thresholds(thresholds(steps))
    return panel


def row(ids: Ids, title: str) -> dash.Row:
    return dash.Row(title).id(ids())
