"""deploy/'s Grafana dashboard, Prometheus config and alert rules (issue 10): they parse, they
fit the compose stack, and every metric and label name their PromQL uses is one a real
gateway and a real worker export (checked against a scrape after real calls)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml  # pyyaml: installed with gguf and transformers ([worker,dev])

from protos.convert import build_request
from protos.metrics import DEFAULT_GATEWAY_PORT, DEFAULT_WORKER_PORT
from tests.service import MetricsStack, scrape_samples, wait_until

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
DASHBOARD = DEPLOY / "grafana" / "tokenrelay-dashboard.json"
ALERTS = DEPLOY / "prometheus" / "alerts.yml"
PROMETHEUS = DEPLOY / "prometheus" / "prometheus.yml"
COMPOSE = DEPLOY / "compose.yaml"
DATASOURCES = DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yaml"
DASHBOARD_PROVIDERS = DEPLOY / "grafana" / "provisioning" / "dashboards" / "tokenrelay.yaml"
OPERATIONS_DOC = DEPLOY.parent / "docs" / "operations.md"

# Series Prometheus itself writes for every target, never in a /metrics page.
PROMETHEUS_SERIES = {"up"}
# Labels Prometheus attaches to every scraped series (the target's).
TARGET_LABELS = {"job", "instance"}
# Words of PromQL that look like metric names (functions are told apart by their "(").
PROMQL_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless",
                   "bool", "offset", "inf", "nan"}
REQUIRED_ALERTS = {"TokenrelayTimeToFirstTokenP99OverSLO", "TokenrelayOldestWaitingRequestOverSLO",
                   "TokenrelayKVCacheNearlyFull", "TokenrelayNoLiveWorker", "TokenrelayRejectionRateHigh"}

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_LABEL_LIST = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^()]*)\)")
_MATCHERS = re.compile(r"\{([^{}]*)\}")
_RANGE = re.compile(r"\[[^\[\]]*\]")
_IDENT = re.compile(r"(?<![\w$.:])([A-Za-z_:][\w:]*)\s*(\()?")
_OUR_NAME = re.compile(r"\b(?:tokenrelay|grpc_server)_\w+")
_LABEL_VALUES = re.compile(r"^\s*label_values\((.*),\s*(\w+)\s*\)\s*$")


def promql_names(expr: str) -> tuple[set[str], set[str]]:
    """(metric names, label names) an expression selects or groups by; not its functions."""
    expr = _STRING.sub('""', expr)  # label values, e.g. "$model"
    labels: set[str] = set()
    for m in _LABEL_LIST.finditer(expr):
        labels |= set(re.findall(r"\w+", m.group(1)))
    expr = _LABEL_LIST.sub(" ", expr)
    for m in _MATCHERS.finditer(expr):
        labels |= set(re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", m.group(1)))
    expr = _RANGE.sub(" ", _MATCHERS.sub(" ", expr))  # [5m], [$__rate_interval]
    names = {m.group(1) for m in _IDENT.finditer(expr) if not m.group(2)}
    return names - PROMQL_KEYWORDS, labels


def _panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))  # a collapsed row holds its panels


def dashboard_exprs() -> list[str]:
    board = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in _panels(board["panels"]) for t in p.get("targets", [])]
    for variable in board["templating"]["list"]:
        if variable["type"] == "query":  # label_values(<selector>, <label>): a selector and a label
            match = _LABEL_VALUES.match(variable["query"])
            assert match, variable["query"]
            selector, label = match.groups()
            exprs.append(f"count by ({label}) ({selector})")
    return exprs


def alert_rules() -> list[dict[str, Any]]:
    return [rule for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]]


def all_exprs() -> list[str]:
    return dashboard_exprs() + [rule["expr"] for rule in alert_rules()]


@pytest.mark.parametrize("path", [COMPOSE, PROMETHEUS, ALERTS, DATASOURCES, DASHBOARD_PROVIDERS, DASHBOARD],
                         ids=lambda p: p.name)
def test_every_file_parses(path: Path) -> None:
    parsed = json.loads(path.read_text()) if path.suffix == ".json" else yaml.safe_load(path.read_text())
    assert isinstance(parsed, dict) and parsed


def test_the_name_extractor_skips_functions_labels_and_grafana_variables() -> None:
    expr = ('histogram_quantile(0.99, sum by (model, le) (rate(a_bucket{model=~"$model", kind!="x"}'
            '[$__rate_interval]))) / on() group_left() sum(b_total offset 5m) > 2e1'
            ' and absent(c) or vector(0)')
    assert promql_names(expr) == ({"a_bucket", "b_total", "c"}, {"model", "le", "kind"})


def test_the_name_extractor_finds_every_tokenrelay_name() -> None:
    for expr in all_exprs():
        names, _ = promql_names(expr)
        assert set(_OUR_NAME.findall(expr)) <= names, expr


def test_the_dashboard_has_its_variables_units_and_datasource() -> None:
    board = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert (variables["datasource"]["type"], variables["datasource"]["query"]) == ("datasource", "prometheus")
    assert variables["model"]["includeAll"] and variables["model"]["datasource"]["uid"] == "${datasource}"
    panels = [p for p in _panels(board["panels"]) if p["type"] != "row"]
    assert len({p["id"] for p in _panels(board["panels"])}) == len(list(_panels(board["panels"])))
    for panel in panels:
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["fieldConfig"]["defaults"].get("unit"), panel["title"]
        assert panel["targets"] and all(t["datasource"]["uid"] == "${datasource}" for t in panel["targets"])
    exprs = " ".join(dashboard_exprs())
    for q in ("0.5", "0.9", "0.99"):
        for name in ("time_to_first_token", "inter_token_latency", "e2e_request_latency"):
            assert f"histogram_quantile({q}, sum by (le) (rate(tokenrelay_{name}_seconds_bucket" in exprs


def test_every_alert_has_a_for_severity_and_text() -> None:
    rules = alert_rules()
    assert REQUIRED_ALERTS <= {rule["alert"] for rule in rules}
    for rule in rules:
        assert re.fullmatch(r"\d+[smh]", rule["for"]), rule["alert"]
        assert rule["labels"]["severity"] in {"warning", "critical"}, rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule["alert"]


def test_prometheus_scrapes_the_compose_services_and_grafana_reads_it() -> None:
    compose = yaml.safe_load(COMPOSE.read_text())["services"]
    prometheus = yaml.safe_load(PROMETHEUS.read_text())
    jobs = {job["job_name"]: job for job in prometheus["scrape_configs"]}
    for job, service, port in (("tokenrelay-gateway", "gateway", DEFAULT_GATEWAY_PORT),
                               ("tokenrelay-worker", "worker", DEFAULT_WORKER_PORT)):
        [sd] = jobs[job]["dns_sd_configs"]  # every container of a --scale'd service
        assert sd["names"] == [service] and sd["port"] == port
        assert str(port) in compose[service]["expose"]
        assert "TOKENRELAY_METRICS_PORT" not in compose[service].get("environment", {})
    assert [(PROMETHEUS.parent / f).resolve() for f in prometheus["rule_files"]] == [ALERTS]

    for name, port in (("prometheus", "9090"), ("grafana", "3000")):
        assert compose[name]["profiles"] == ["observability"]
        assert f"{port}:{port}" in compose[name]["ports"]
    mounts = {}
    for name in ("prometheus", "grafana"):
        for volume in compose[name]["volumes"]:
            source, target = volume.split(":")[:2]
            if source.startswith("."):
                assert (DEPLOY / source).exists(), volume
                mounts[(DEPLOY / source).resolve()] = target
    assert mounts[PROMETHEUS.parent] == "/etc/prometheus"
    assert mounts[DATASOURCES.parents[1]] == "/etc/grafana/provisioning"
    [provider] = yaml.safe_load(DASHBOARD_PROVIDERS.read_text())["providers"]
    assert Path(mounts[DASHBOARD]).parent == Path(provider["options"]["path"])
    [datasource] = yaml.safe_load(DATASOURCES.read_text())["datasources"]
    assert datasource["type"] == "prometheus" and datasource["url"] == "http://prometheus:9090"


@pytest.mark.skipif(shutil.which("promtool") is None, reason="no promtool binary on PATH (Prometheus' own "
                    "checker); the YAML and the names are still checked above and below")
def test_promtool_accepts_the_config_and_the_rules() -> None:
    for args in (["check", "config", str(PROMETHEUS)], ["check", "rules", str(ALERTS)]):
        done = subprocess.run(["promtool", *args], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr


def documented_metrics(text: str) -> set[str]:
    """The metric names in the rows of docs/operations.md's metrics table (`{label}` dropped)."""
    rows = (line for line in text.splitlines() if line.startswith(("| gateway |", "| worker |")))
    return {name for row in rows for name in _OUR_NAME.findall(row.split("|")[2])}


def family(sample: str) -> str:
    """A scraped sample's metric family as the docs name it (a histogram's _bucket, _count, _sum)."""
    for suffix in ("_bucket", "_count", "_sum"):
        if sample.endswith(suffix):
            return sample.removesuffix(suffix)
    return sample


def test_documented_metrics_reads_the_table_rows_only() -> None:
    text = ("see `tokenrelay_not_in_a_row`\n| process | metric |\n"
            "| gateway | `tokenrelay_a_total{reason}`, `grpc_server_b_total` | counter "
            "| `tokenrelay_meaning` |\n")
    assert documented_metrics(text) == {"tokenrelay_a_total", "grpc_server_b_total"}


def scrape(port: int) -> tuple[set[str], set[str]]:
    """(sample names, label names) of one /metrics page."""
    samples = scrape_samples(port)
    return {s.name for s in samples}, {label for s in samples for label in s.labels}


@pytest.mark.slow
def test_every_name_the_dashboard_and_alerts_use_is_exported(metrics_stack: MetricsStack) -> None:
    stub, gateway_port, worker_port = metrics_stack
    list(stub.Generate(build_request("Say hi.", max_tokens=3, ignore_eos=True), timeout=60))
    with pytest.raises(grpc.RpcError):  # a labelled series shows once touched: one rejection
        list(stub.Generate(build_request("Bad.", max_tokens=-1), timeout=10))

    def scraped(port: int, *needed: str) -> Callable[[], tuple[set[str], set[str]] | None]:
        def check() -> tuple[set[str], set[str]] | None:
            names, labels = scrape(port)
            return (names, labels) if set(needed) <= names else None
        return check

    # The final's counters land after the call returns; the queue gauges are read once a second.
    g_names, g_labels = wait_until(scraped(gateway_port, "tokenrelay_e2e_request_latency_seconds_count",
                                           "tokenrelay_queue_depth"), timeout=5)
    w_names, w_labels = wait_until(scraped(worker_port, "tokenrelay_request_decode_time_seconds_count"),
                                   timeout=5)
    exported, labels = g_names | w_names, g_labels | w_labels | TARGET_LABELS
    used_names: set[str] = set()
    for expr in all_exprs():
        names, used_labels = promql_names(expr)
        assert names - PROMETHEUS_SERIES <= exported, f"not exported: {names - exported - PROMETHEUS_SERIES}"
        assert used_labels <= labels, f"no such label: {used_labels - labels} in {expr}"
        used_names |= names
    # The board covers both processes' families (not just what one of them happens to serve).
    assert {"tokenrelay_time_to_first_token_seconds_bucket", "tokenrelay_requests_rejected_total",
            "tokenrelay_queue_oldest_waiting_age_seconds", "tokenrelay_kv_cache_usage_perc",
            "tokenrelay_num_requests_running", "tokenrelay_prefix_cache_hits_total"} <= used_names
    # docs/operations.md's table names what the processes export: nothing invented, nothing missing.
    documented = documented_metrics(OPERATIONS_DOC.read_text())
    families = {family(name) for name in exported  # a counter's _created twin is prometheus-client's
                if name.startswith(("tokenrelay_", "grpc_server_")) and not name.endswith("_created")}
    assert documented <= families, f"documented, not exported: {documented - families}"
    assert families <= documented, f"exported, not in docs/operations.md: {families - documented}"
