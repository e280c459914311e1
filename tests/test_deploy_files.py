"""The deployment files of docs/DEPLOY.md agree with each other and with the server: systemd units verify,
the per-replica template made from strata.service by the documented sed verifies, and the router in the
compose file and the Kubernetes manifests lists exactly the replicas defined beside it, at their port."""
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "scripts" / "deploy"
# docs/DEPLOY.md, "Several replicas on one host": the template unit, one config file per instance
TEMPLATE_SED = "s#--config /etc/strata/config.json#--config /etc/strata/%i.json#"


def _verify(unit_text: str, name: str, tmp_path: Path) -> None:
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze is not installed")
    # As tests/test_service_files.py does: no real binary or user here, so every message is about the unit.
    text = re.sub(r"(?m)^ExecStart=.*(\n\s+.*)*$", "ExecStart=/bin/true", unit_text)
    text = re.sub(r"(?m)^(User|Group|EnvironmentFile)=.*\n", "", text)
    (tmp_path / name).write_text(text)
    result = subprocess.run([tool, "verify", str(tmp_path / name)], capture_output=True, text=True, timeout=120)
    output = (result.stdout + result.stderr).strip()
    about_unit = [line for line in output.splitlines() if name.split("@")[0] in line]
    if result.returncode != 0 and not about_unit:
        pytest.skip(f"systemd-analyze cannot verify units here (exit {result.returncode}): {output[:300]}")
    assert about_unit == [] and result.returncode == 0, output


def test_router_unit_verifies(tmp_path):
    _verify((ROOT / "scripts" / "strata-router.service").read_text(), "strata-router.service", tmp_path)


def test_the_documented_template_unit_reads_one_config_per_instance_and_verifies(tmp_path):
    made = subprocess.run(["sed", TEMPLATE_SED, str(ROOT / "scripts" / "strata.service")], capture_output=True,
                          text=True, check=True).stdout
    assert "ExecStart=/opt/strata/.venv/bin/strata serve --config /etc/strata/%i.json" in made
    assert TEMPLATE_SED in (ROOT / "docs" / "DEPLOY.md").read_text()
    (tmp_path / "strata@.service").write_text(made)
    _verify(made, "strata@a.service", tmp_path)


def _yaml_docs(path: Path) -> list[dict]:
    yaml = pytest.importorskip("yaml")
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def _worker_urls(args: list[str]) -> list[str]:
    urls = []
    for arg in args[args.index("--worker-urls") + 1:]:
        if not arg.startswith("http"):
            break
        urls.append(arg)
    return urls


def test_compose_router_lists_every_replica_service_at_the_server_port():
    [compose] = _yaml_docs(DEPLOY / "compose.yaml")
    services = compose["services"]
    replicas = sorted(name for name in services if name.startswith("strata-"))
    urls = _worker_urls(services["router"]["command"])
    assert urls == [f"http://{name}:8100" for name in replicas]
    for name in replicas:
        assert "8100" in services[name]["command"] and services[name]["volumes"] == [f"{name}:/var/lib/strata"]


def test_kubernetes_router_lists_every_statefulset_pod_by_its_stable_name():
    by_kind = {(d["kind"], d["metadata"]["name"]): d for f in ("strata.yaml", "router.yaml")
               for d in _yaml_docs(DEPLOY / "k8s" / f)}
    sts = by_kind[("StatefulSet", "strata")]
    service = by_kind[("Service", "strata")]
    assert sts["spec"]["serviceName"] == "strata" and service["spec"]["clusterIP"] == "None"
    port = service["spec"]["ports"][0]["port"]
    [container] = sts["spec"]["template"]["spec"]["containers"]
    assert container["args"][container["args"].index("--port") + 1] == str(port)
    assert "--conversation-cache-dir" in container["args"]  # the disk tier, on the pod's volume
    [router] = by_kind[("Deployment", "strata-router")]["spec"]["template"]["spec"]["containers"]
    urls = _worker_urls(router["args"])
    assert urls == [f"http://strata-{i}.strata:{port}" for i in range(sts["spec"]["replicas"])]
    assert sts["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= 90
