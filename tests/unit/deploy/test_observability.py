"""deploy/observability (compose's `observability` profile): Prometheus scrapes every replica of
every meshlm service compose runs, Grafana's provisioning sits where compose mounts it, and the
meshlm dashboard queries only series that meshlm really exports, each from the role that serves
it: the names are read from what live registries of meshlm.common.metrics send to a scraper that
asks the way this Prometheus is configured to (so renaming a metric, or a wire format that
renames it, fails here)."""

from __future__ import annotations

import json
import re
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
import yaml

from meshlm.common.metrics import (
    DetokenizerMetrics,
    GatewayMetrics,
    SchedulerMetrics,
    ServiceMetrics,
    TokenizerMetrics,
)

DEPLOY = Path(__file__).resolve().parents[3] / "deploy"
OBS = DEPLOY / "observability"
PROMETHEUS = OBS / "prometheus.yml"
GRAFANA = OBS / "grafana"
DASHBOARD = GRAFANA / "dashboards" / "meshlm.json"
ROLES = ("gateway", "tokenizer", "scheduler", "detokenizer")
# Series Prometheus itself adds to every target.
SYNTHETIC = {"up"}
# Prometheus 2's Accept header per scrape protocol (config.ScrapeProtocolsHeaders), and the
# protocols it asks for when a config names none (compose runs prom/prometheus v2.x).
PROTOCOL_ACCEPT = {
    "PrometheusProto": "application/vnd.google.protobuf;"
                       "proto=io.prometheus.client.MetricFamily;encoding=delimited",
    "PrometheusText0.0.4": "text/plain;version=0.0.4",
    "OpenMetricsText0.0.1": "application/openmetrics-text;version=0.0.1",
    "OpenMetricsText1.0.0": "application/openmetrics-text;version=1.0.0",
}
DEFAULT_PROTOCOLS = ["OpenMetricsText1.0.0", "OpenMetricsText0.0.1", "PrometheusText0.0.4"]


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return load_yaml(DEPLOY / "compose.yaml")


@pytest.fixture(scope="module")
def prometheus() -> dict[str, Any]:
    return load_yaml(PROMETHEUS)


@pytest.fixture(scope="module")
def datasources() -> list[dict[str, Any]]:
    return load_yaml(GRAFANA / "provisioning" / "datasources" / "prometheus.yml")["datasources"]


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def environment(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: str(v) for k, v in env.items()}


def dns_names(name: str, service: dict[str, Any]) -> set[str]:
    """The names Docker's resolver answers with this service's replicas."""
    names = {name}
    networks = service.get("networks") or {}
    if isinstance(networks, dict):
        for net in networks.values():
            names.update((net or {}).get("aliases", []))
    return names


def mounts(service: dict[str, Any]) -> dict[str, Path]:
    """A service's bind mounts: container path -> host path (compose resolves them from the
    compose file's folder)."""
    out = {}
    for volume in service.get("volumes", []):
        src, dst = volume.split(":")[:2]
        if src.startswith("."):
            out[dst] = (DEPLOY / src).resolve()
    return out


def scrape_jobs(prometheus: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {job["job_name"]: job for job in prometheus["scrape_configs"]}


def role_label(job: dict[str, Any]) -> str | None:
    for rule in job.get("relabel_configs", []):
        if rule.get("target_label") == "role" and rule.get("action", "replace") == "replace":
            return rule.get("replacement")
    return None


# ---- Prometheus ------------------------------------------------------------------------------


def test_every_service_with_a_metrics_port_is_scraped_on_it_by_dns(compose, prometheus):
    services = compose["services"]
    with_metrics = {name: s for name, s in services.items()
                    if "MESHLM_METRICS_PORT" in environment(s)}
    assert set(with_metrics) >= set(ROLES)
    targets = {(name, sd["port"]) for job in scrape_jobs(prometheus).values()
               for sd in job.get("dns_sd_configs", []) for name in sd["names"]}
    for name, service in with_metrics.items():
        port = int(environment(service)["MESHLM_METRICS_PORT"])
        assert port == 9100
        assert any((dns, port) in targets for dns in dns_names(name, service)), (
            f"no scrape job finds {name}'s replicas on :{port}")


def test_one_job_per_role_finds_its_replicas_by_dns_a_records(compose, prometheus):
    jobs = scrape_jobs(prometheus)
    assert set(jobs) == set(ROLES)
    for role, job in jobs.items():
        assert job.get("metrics_path", "/metrics") == "/metrics"
        assert "static_configs" not in job, "static targets miss scaled replicas"
        (sd,) = job["dns_sd_configs"]
        assert sd["type"] == "A"
        assert sd["port"] == 9100
        assert sd["names"] == [role]
        service = compose["services"][role]
        assert environment(service)["MESHLM_METRICS_PORT"] == str(sd["port"])
        assert "mesh" in service["networks"]
        assert "mesh" in compose["services"]["prometheus"]["networks"]


def test_each_job_labels_its_role_and_keeps_each_replica_its_instance(prometheus):
    for role, job in scrape_jobs(prometheus).items():
        assert role_label(job) == role
        for rule in job.get("relabel_configs", []):
            assert rule.get("action") not in ("labeldrop", "labelkeep")
            if rule.get("target_label") == "instance":
                assert rule.get("source_labels") == ["__address__"]


def test_scrapes_every_5s(prometheus, datasources):
    assert prometheus["global"]["scrape_interval"] == "5s"
    for job in prometheus["scrape_configs"]:
        assert job.get("scrape_interval", "5s") == "5s"
    # Grafana's $__rate_interval is worked out from the datasource's scrape interval.
    (ds,) = datasources
    assert ds["jsonData"]["timeInterval"] == prometheus["global"]["scrape_interval"]


def test_prometheus_config_is_where_compose_mounts_it(compose):
    assert mounts(compose["services"]["prometheus"])["/etc/prometheus/prometheus.yml"] == \
        PROMETHEUS.resolve()


# ---- Grafana provisioning --------------------------------------------------------------------


def test_the_datasource_is_compose_s_prometheus_and_the_default(compose, datasources):
    (ds,) = datasources
    assert ds["type"] == "prometheus"
    assert ds["uid"] == "prometheus"
    assert ds["isDefault"] is True
    url = urlparse(ds["url"])
    assert url.hostname in compose["services"]
    prometheus = compose["services"][url.hostname]
    assert any(str(p).rsplit(":", 1)[-1] == str(url.port) for p in prometheus["ports"])
    assert "prometheus" in compose["services"]["grafana"]["depends_on"]


def test_provisioning_and_dashboards_are_where_compose_mounts_them(compose):
    grafana = mounts(compose["services"]["grafana"])
    provisioning = grafana["/etc/grafana/provisioning"]
    assert provisioning == (GRAFANA / "provisioning").resolve()
    assert (provisioning / "datasources" / "prometheus.yml").is_file()
    (provider,) = load_yaml(provisioning / "dashboards" / "meshlm.yml")["providers"]
    assert provider["type"] == "file"
    path = provider["options"]["path"]
    assert grafana[path] == DASHBOARD.parent.resolve()
    assert DASHBOARD.is_file()


# ---- the dashboard ---------------------------------------------------------------------------


def all_panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from all_panels(panel.get("panels", []))


def expressions(dashboard: dict[str, Any]) -> list[str]:
    return [t["expr"] for p in all_panels(dashboard["panels"]) for t in p.get("targets", [])]


def test_the_dashboard_is_meshlm_and_reads_the_provisioned_datasource(dashboard, datasources):
    assert dashboard["uid"] == "meshlm"
    assert dashboard["title"] == "meshlm"
    uids = {ds["uid"] for ds in datasources}
    queried = [p for p in all_panels(dashboard["panels"]) if p.get("targets")]
    assert queried
    for panel in queried:
        assert panel["datasource"]["uid"] in uids, panel["title"]
        for target in panel["targets"]:
            assert target.get("datasource", panel["datasource"])["uid"] in uids, panel["title"]
    ids = [p["id"] for p in all_panels(dashboard["panels"])]
    assert len(ids) == len(set(ids))


GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
RANGE = re.compile(r"\[[^\]]*\]|\boffset\s+\S+")
TOKEN = re.compile(r"""(?P<string>"(?:[^"\\]|\\.)*")
                     |(?P<number>\d+(?:\.\d*)?(?:[eE][+-]?\d+)?)
                     |(?P<matchers>\{[^}]*\})
                     |(?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)(?P<call>\s*\()?""", re.X)
MATCHER = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!=|!~|=)\s*"((?:[^"\\]|\\.)*)"')
KEYWORDS = {"and", "or", "unless", "bool", "inf", "nan"}


def selectors(expr: str) -> list[tuple[str, dict[str, str]]]:
    """Every vector selector of a PromQL expression: (metric name, its `=` matchers)."""
    expr = RANGE.sub(" ", GROUPING.sub(" ", expr))
    found: list[tuple[str, dict[str, str]]] = []
    pending: str | None = None  # a metric name whose matchers may follow
    pending_end = 0
    for m in TOKEN.finditer(expr):
        if m["matchers"] is not None:
            if pending is not None and expr[pending_end:m.start()].strip():
                found.append((pending, {}))
                pending = None
            matchers = {k: v for k, op, v in MATCHER.findall(m["matchers"]) if op == "="}
            name = matchers.pop("__name__", pending)
            assert name, f"selector without a metric name in {expr!r}"
            found.append((name, matchers))
            pending = None
            continue
        if pending is not None:
            found.append((pending, {}))
            pending = None
        if m["ident"] is not None and m["call"] is None and m["ident"] not in KEYWORDS:
            pending, pending_end = m["ident"], m.end()
    if pending is not None:
        found.append((pending, {}))
    return found


def test_selectors_are_read_from_promql():
    assert selectors('histogram_quantile(0.95, sum by (le, model_name) (rate('
                     'vllm:x_seconds_bucket{role="gateway", a=~"b|c"}[$__rate_interval])))') == \
        [("vllm:x_seconds_bucket", {"role": "gateway"})]
    assert selectors("sum by (role) (up) / count without (instance) (up offset 5m)") == \
        [("up", {}), ("up", {})]
    assert selectors('rate(meshlm:y_total[5m]) and on (job) {__name__="z", role="scheduler"}') \
        == [("meshlm:y_total", {}), ("z", {"role": "scheduler"})]
    assert selectors('a + {__name__="b"}') == [("a", {}), ("b", {})]


def accept_header(protocols: list[str]) -> str:
    """The Accept header Prometheus 2 sends for these scrape protocols (scrape.acceptHeader)."""
    weight = len(PROTOCOL_ACCEPT) + 1
    values = []
    for protocol in protocols:
        values.append(f"{PROTOCOL_ACCEPT[protocol]};q=0.{weight}")
        weight -= 1
    return ",".join([*values, f"*/*;q=0.{weight}"])


def test_accept_header_is_prometheus_2_s():
    assert accept_header(DEFAULT_PROTOCOLS) == (
        "application/openmetrics-text;version=1.0.0;q=0.5,"
        "application/openmetrics-text;version=0.0.1;q=0.4,text/plain;version=0.0.4;q=0.3,"
        "*/*;q=0.2")


async def stored_names(metrics: ServiceMetrics, accept: str) -> set[str]:
    """The sample names a scrape with this Accept header gets (text formats: the name is what
    precedes the labels or the value on every sample line)."""
    body, content_type = await metrics.scrape(accept)
    assert content_type.startswith(("text/plain", "application/openmetrics-text")), content_type
    return {re.match(r"[^{\s]+", line)[0] for line in body.decode().splitlines()
            if line and not line.startswith("#")}


async def exported(accept: str) -> dict[str, set[str]]:
    """Every series name each role serves on its metrics port to a scraper sending `accept`
    (with its request-level histograms and counters observed once, and an engine reporting
    every stats figure)."""
    stats: dict[str, float] = defaultdict(lambda: 1.0)

    async def engine_loads() -> list[tuple[int, dict[str, Any]]]:
        return [(0, stats)]

    gateway = GatewayMetrics(lambda: "m", engine_loads, registry_degraded=lambda: False)
    clock = gateway.track()
    clock.output(prompt_tokens=3, completion_tokens=1, cached_tokens=1)
    clock.output(prompt_tokens=3, completion_tokens=2, cached_tokens=1, finish_reason="stop")
    return {
        "gateway": await stored_names(gateway, accept),
        "tokenizer": await stored_names(TokenizerMetrics("m"), accept),
        "scheduler": await stored_names(SchedulerMetrics("m", lambda: stats), accept),
        "detokenizer": await stored_names(DetokenizerMetrics("m", lambda: 0), accept),
    }


def protocols(prometheus: dict[str, Any], job: dict[str, Any]) -> list[str]:
    return job.get("scrape_protocols",
                   prometheus["global"].get("scrape_protocols", DEFAULT_PROTOCOLS))


async def test_scraped_the_way_prometheus_asks_metrics_keep_their_names(prometheus):
    for role, job in scrape_jobs(prometheus).items():
        names = set().union(*(await exported(accept_header(protocols(prometheus, job)))).values())
        assert "vllm:num_requests_running" in names, f"{role}: {sorted(names)[:8]}..."
        assert not {n for n in names if n.startswith(("vllm_", "sglang_", "meshlm_"))}


async def test_the_dashboard_queries_only_series_that_its_roles_export(dashboard, prometheus):
    jobs = scrape_jobs(prometheus)
    by_role = {}
    for role, job in jobs.items():
        by_role[role] = (await exported(accept_header(protocols(prometheus, job))))[role]
    assert "vllm:time_to_first_token_seconds_bucket" in by_role["gateway"]
    assert "vllm:num_requests_running" in by_role["scheduler"]
    anywhere = set().union(*by_role.values())
    roles = {role_label(job) for job in jobs.values()}
    queried = set()
    for expr in expressions(dashboard):
        found = selectors(expr)
        assert found, expr
        for name, matchers in found:
            queried.add(name)
            if name in SYNTHETIC:
                continue
            role = matchers.get("role")
            if role is None:
                assert name in anywhere, f"no role exports {name} ({expr})"
            else:
                assert role in roles, f"no scrape job labels role={role} ({expr})"
                assert name in by_role[role], f"{role} does not export {name} ({expr})"
        if expr.startswith("histogram_quantile("):
            assert all(name.endswith("_bucket") for name, _ in found), expr
    # The panels this dashboard is for (a dropped or renamed one fails here).
    assert queried >= {
        "vllm:request_success_total", "vllm:num_requests_running", "vllm:num_requests_waiting",
        "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
        "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
        "vllm:e2e_request_latency_seconds_bucket", "vllm:kv_cache_usage_perc",
        "process_cpu_seconds_total", "up"}


def test_latency_panels_show_p50_and_p95(dashboard):
    for metric in ("time_to_first_token", "inter_token_latency", "e2e_request_latency"):
        quantiles = {m["q"] for expr in expressions(dashboard)
                     for m in re.finditer(rf"histogram_quantile\((?P<q>[\d.]+),.*vllm:{metric}_",
                                          expr)}
        assert {float(q) for q in quantiles} == {0.5, 0.95}, metric
