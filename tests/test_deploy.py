"""``deploy/kubernetes/`` and the Dockerfile: the manifests validate offline
(``kubernetes-validate --strict``, bundled schemas, no API server), and what no schema checks
holds: names and selectors, ports, probe paths, metric names against what the service really
exports, the token's Secret, the security context, and the grace arithmetic."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import yaml

from toolpool import Pool
from toolpool.metrics import PoolCollector
from toolpool.serve import ServiceOptions, parse_tools
from toolpool.serve._http import ServiceApp
from toolpool.serve._service import Service, ServiceCollector

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy" / "kubernetes"
#: The oldest Kubernetes the manifests are for (securityContext.appArmorProfile: 1.30).
K8S_VERSION = "1.30.0"
#: What the grace arithmetic leaves for SIGKILL, the reaper's report and the answers.
MARGIN_S = 5


def load(name: str) -> dict[str, Any]:
    with open(DEPLOY / name) as f:
        doc = yaml.safe_load(f)
    assert isinstance(doc, dict)
    return doc


def manifests() -> list[Path]:
    listed = load("kustomization.yaml")["resources"]
    return [DEPLOY / name for name in listed] + [DEPLOY / "prometheus-adapter.yaml"]


def validate(*paths: Path) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("kubernetes-validate", path=str(Path(sys.executable).parent))
    assert exe is not None, "kubernetes-validate is in the dev extra"
    return subprocess.run(
        [exe, "--strict", "-k", K8S_VERSION, *map(str, paths)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def container() -> dict[str, Any]:
    (c,) = load("deployment.yaml")["spec"]["template"]["spec"]["containers"]
    assert isinstance(c, dict)
    return c


def args() -> dict[str, str]:
    out = {}
    for a in container()["args"]:
        key, _, value = a.partition("=")
        out[key] = value
    return out


def allowed_hosts() -> set[str]:
    return {a.partition("=")[2] for a in container()["args"] if a.startswith("--allowed-host=")}


# ---------------------------------------------------------------------------- schemas


def test_every_manifest_validates_strictly() -> None:
    paths = manifests()
    done = validate(*paths)
    assert done.returncode == 0, done.stdout + done.stderr
    passed = re.findall(r"^INFO (\S+) passed", done.stdout, re.MULTILINE)
    assert sorted(passed) == sorted(map(str, paths))


def test_strict_validation_catches_a_misspelt_field(tmp_path: Path) -> None:
    """The check above can fail: a typo the schema does not allow is refused."""
    text = (DEPLOY / "deployment.yaml").read_text().replace("readinessProbe:", "readinesProbe:")
    bad = tmp_path / "deployment.yaml"
    bad.write_text(text)
    done = validate(bad)
    assert done.returncode != 0
    assert "readinesProbe" in done.stdout + done.stderr


def test_the_keda_scaled_object() -> None:
    """No schema is bundled for KEDA's custom resource (the validator says so and passes
    it): check what KEDA requires by hand."""
    path = DEPLOY / "keda" / "scaledobject.yaml"
    done = validate(path)
    assert done.returncode == 0
    assert "Couldn't find schema for kind ScaledObject" in done.stdout + done.stderr
    doc = load("keda/scaledobject.yaml")
    assert doc["apiVersion"] == "keda.sh/v1alpha1"
    spec = doc["spec"]
    assert set(spec) <= {
        "scaleTargetRef",
        "minReplicaCount",
        "maxReplicaCount",
        "cooldownPeriod",
        "pollingInterval",
        "triggers",
    }
    (trigger,) = spec["triggers"]
    assert trigger["type"] == "prometheus"
    assert set(trigger["metadata"]) == {"serverAddress", "query", "threshold"}
    assert isinstance(trigger["metadata"]["threshold"], str)  # KEDA wants a string
    assert float(trigger["metadata"]["threshold"]) > 0
    assert 1 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]


# ---------------------------------------------------------------------------- cross-checks


def test_names_and_selectors_agree() -> None:
    deployment = load("deployment.yaml")
    name = deployment["metadata"]["name"]
    namespace = deployment["metadata"]["namespace"]
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    selector = deployment["spec"]["selector"]["matchLabels"]
    assert selector.items() <= pod_labels.items()
    for doc, labels in (
        (load("service.yaml"), load("service.yaml")["spec"]["selector"]),
        (load("pdb.yaml"), load("pdb.yaml")["spec"]["selector"]["matchLabels"]),
        (
            load("networkpolicy.yaml"),
            load("networkpolicy.yaml")["spec"]["podSelector"]["matchLabels"],
        ),
    ):
        assert labels.items() <= pod_labels.items(), doc["kind"]
        assert doc["metadata"]["namespace"] == namespace, doc["kind"]
    for doc in (load("hpa.yaml"), load("keda/scaledobject.yaml")):
        assert doc["spec"]["scaleTargetRef"]["name"] == name
        assert doc["metadata"]["namespace"] == namespace
    assert load("hpa.yaml")["spec"]["scaleTargetRef"]["kind"] == "Deployment"
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    assert volumes["config"]["configMap"]["name"] == load("configmap.yaml")["metadata"]["name"]
    assert "service.toml" in load("configmap.yaml")["data"]


def test_the_config_map_is_a_valid_service_config(tmp_path: Path) -> None:
    from toolpool.serve import load_config

    path = tmp_path / "service.toml"
    path.write_text(load("configmap.yaml")["data"]["service.toml"])
    (provider,) = load_config(str(path))
    assert provider.profile == "untrusted"
    mounts = {m["name"]: m["mountPath"] for m in container()["volumeMounts"]}
    assert args()["--config"] == mounts["config"] + "/service.toml"


def test_ports_agree() -> None:
    c = container()
    (port,) = c["ports"]
    host, _, number = args()["--http"].rpartition(":")
    assert host == "0.0.0.0"
    assert int(number) == port["containerPort"]
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert c[probe]["httpGet"]["port"] == port["name"]
    service = load("service.yaml")
    name, namespace = service["metadata"]["name"], service["metadata"]["namespace"]
    assert {  # the names callers use for the Service are Host values /mcp accepts
        name,
        f"{name}.{namespace}",
        f"{name}.{namespace}.svc",
        f"{name}.{namespace}.svc.cluster.local",
    } <= allowed_hosts()
    (svc_port,) = service["spec"]["ports"]
    assert svc_port["targetPort"] == port["name"]
    (rule,) = load("networkpolicy.yaml")["spec"]["ingress"]
    assert [p["port"] for p in rule["ports"]] == [port["containerPort"]]
    annotations = load("deployment.yaml")["spec"]["template"]["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == port["containerPort"]


def test_probe_paths_are_what_the_service_answers() -> None:
    """The service's own ASGI app, asked the paths the manifest probes and scrapes."""

    class Probes:
        def health(self) -> tuple[bool, dict[str, Any]]:
            return True, {}

        def readiness(self) -> tuple[bool, dict[str, Any]]:
            return True, {}

        def metrics(self) -> tuple[bytes, str]:
            return b"m 1\n", "text/plain"

    app = ServiceApp(Probes(), None)
    c = container()
    annotations = load("deployment.yaml")["spec"]["template"]["metadata"]["annotations"]
    paths = {c[p]["httpGet"]["path"] for p in ("readinessProbe", "livenessProbe", "startupProbe")}
    assert paths == {"/readyz", "/healthz"}
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"

    async def status(path: str) -> int:
        sent: list[dict[str, Any]] = []

        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": b""}

        async def send(message: Any) -> None:
            sent.append(message)

        scope = {"type": "http", "method": "GET", "path": path}
        await app(scope, receive, send)
        return int(sent[0]["status"])

    for path in [*paths, annotations["prometheus.io/path"]]:
        assert anyio.run(status, path) == 200, path
    assert anyio.run(status, "/nope") == 404


def _exported_metric_names() -> set[str]:
    pool = Pool("serve_tools:registry")  # (never started: its families need no worker)
    options = ServiceOptions(providers=parse_tools(["serve_tools:registry"]))
    families = [*PoolCollector(pool).describe(), *ServiceCollector(Service(options)).describe()]
    return {f.name for f in families}


def test_metric_names_are_exported_ones() -> None:
    exported = _exported_metric_names()
    assert {"toolpool_queue_depth", "toolpool_service_busy_ratio", "toolpool_workers"} <= exported
    hpa = load("hpa.yaml")
    used = {m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]}
    assert all(m["type"] == "Pods" for m in hpa["spec"]["metrics"])
    assert used <= exported
    adapter = yaml.safe_load(load("prometheus-adapter.yaml")["data"]["config.yaml"])
    served = {rule["name"]["as"] for rule in adapter["rules"]}
    assert used <= served, "every metric the HPA reads is one the adapter serves"
    for rule in adapter["rules"]:
        series = re.match(r"^(\w+)\{", rule["seriesQuery"])
        assert series is not None
        assert series.group(1) in exported
    query = load("keda/scaledobject.yaml")["spec"]["triggers"][0]["metadata"]["query"]
    names = set(re.findall(r"\b(toolpool_\w+)\{", query))
    assert names
    assert names <= exported
    # A label the query filters on is one the series has.
    assert 'state="busy"' in query


def test_grace_arithmetic() -> None:
    """The pod is given long enough to drain: drain grace, then the cancel grace, then the
    term grace, then a margin, all before Kubernetes' SIGKILL."""
    spec = load("deployment.yaml")["spec"]["template"]["spec"]
    a = args()
    drain, cancel, term = (float(a[f"--{n}-grace"]) for n in ("drain", "cancel", "term"))
    assert spec["terminationGracePeriodSeconds"] >= drain + cancel + term + MARGIN_S
    command = container()["lifecycle"]["preStop"]["exec"]["command"]
    assert command[:3] == ["toolpool", "drain", "--wait"]
    if "--timeout" in command:  # a drain timeout of its own must fit the same budget
        assert float(command[command.index("--timeout") + 1]) <= drain


def test_token_comes_from_a_secret() -> None:
    mounts = {m["name"]: m for m in container()["volumeMounts"]}
    volumes = {v["name"]: v for v in load("deployment.yaml")["spec"]["template"]["spec"]["volumes"]}
    token_file = Path(args()["--token-file"])
    (name,) = [n for n, m in mounts.items() if Path(m["mountPath"]) == token_file.parent]
    assert volumes[name]["secret"]["secretName"] == "toolpool-token"
    assert mounts[name]["readOnly"] is True
    kustomization = (DEPLOY / "kustomization.yaml").read_text()
    assert "create secret generic toolpool-token --from-file=token=" in kustomization


def test_security_context_grants_what_untrusted_needs() -> None:
    c = container()
    ctx = c["securityContext"]
    assert ctx["runAsUser"] == 0  # a uid per worker needs root
    assert ctx["allowPrivilegeEscalation"] is False
    assert ctx["privileged"] is False
    assert ctx["capabilities"]["drop"] == ["ALL"]
    assert {"SETUID", "SETGID", "SYS_ADMIN", "KILL"} <= set(ctx["capabilities"]["add"])
    control = args()["--control"]
    mounts = {m["mountPath"] for m in c["volumeMounts"]}
    assert str(Path(control).parent) in mounts  # a writable place for the socket
    assert {"name": "TOOLPOOL_CONTROL", "value": control} in c["env"]  # (what preStop uses)
    assert "/tmp" in mounts  # read-only root: the pool's private directory goes here
    assert c["resources"]["requests"]
    assert c["resources"]["limits"]


def test_dockerfile_runs_the_service() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["toolpool", "serve"]' in text
    assert ".[serve]" in text
    assert "EXPOSE 8080" in text
    assert "STOPSIGNAL SIGTERM" in text
