"""The Ray backend's pure parts: resources, addresses, the worker's command and environment.

The backend against a real two-node cluster is tests/e2e/test_ray_backend.py."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from hotpool.platform.server import control_plane_url
from hotpool.pool import ray_backend as rb
from hotpool.pool.backend import WorkerHandle
from hotpool.settings import load_settings


def test_an_unset_address_starts_a_private_local_cluster() -> None:
    # Not None: ray.init(None) would join a cluster RAY_ADDRESS or /tmp/ray points at.
    assert rb.init_address(None) == "local"
    for address in ("auto", "10.0.0.5:6379", "ray://ray-head:10001"):
        assert rb.init_address(address) == address


@pytest.mark.parametrize(
    ("device", "cluster_gpus", "gpu"),
    [
        ("auto", 8.0, True),
        ("auto", 0.0, False),
        ("cuda", 0.0, True),  # an autoscaler may still add GPU nodes
        ("cuda", 2.0, True),
        ("cpu", 8.0, False),  # never takes a GPU, even on a GPU cluster
    ],
)
def test_gpu_workers_only_when_asked_or_available(
    device: str, cluster_gpus: float, gpu: bool
) -> None:
    assert rb.wants_gpu(device, cluster_gpus) is gpu


def test_a_worker_holds_one_gpu_on_gpu_clusters_and_cpus_on_cpu_clusters() -> None:
    assert rb.actor_resources(True, 1.0) == {"num_cpus": 1.0, "num_gpus": 1}
    assert rb.actor_resources(False, 4.0) == {"num_cpus": 4.0, "num_gpus": 0}


def test_worker_threads_follow_the_cpus_it_holds_unless_set() -> None:
    assert rb.worker_threads(None, 4.0) == 4
    assert rb.worker_threads(None, 0.5) == 1  # a fractional CPU still runs one thread
    assert rb.worker_threads(2, 8.0) == 2


def test_remote_workers_get_the_control_planes_settings_but_not_its_token() -> None:
    env = {
        "HOTPOOL_KV_CACHE_BYTES": "64m",
        "HOTPOOL_S3_ENDPOINT_URL": "http://minio:9000",
        "HOTPOOL_WORKER_TOKEN": "secret",  # the backend sets it itself
        "HOTPOOL_DATABASE_URL": "postgresql://hotpool:pw@db/hotpool",  # the ledger's password
        "HOTPOOL_API_KEY": "hp_the_clis_own",
        "AWS_SECRET_ACCESS_KEY": "not-forwarded",
        "PATH": "/usr/bin",
    }
    assert rb.forwarded_env(env) == {
        "HOTPOOL_KV_CACHE_BYTES": "64m",
        "HOTPOOL_S3_ENDPOINT_URL": "http://minio:9000",
    }


def test_a_nodes_own_settings_win_over_the_control_planes() -> None:
    node = {"PATH": "/usr/bin", "CUDA_VISIBLE_DEVICES": "3", "HOTPOOL_CACHE_DIR": "/nvme/cache",
            "OMP_NUM_THREADS": "64", "HOTPOOL_WORKER_TOKEN": "stale"}  # fmt: skip
    forwarded = {"HOTPOOL_CACHE_DIR": "/srv/cache", "HOTPOOL_KV_CACHE_BYTES": "8g"}
    env = rb.worker_env(node, forwarded, "token", threads=4)
    assert env == {
        "PATH": "/usr/bin",
        "CUDA_VISIBLE_DEVICES": "3",  # the GPU Ray gave the actor
        "HOTPOOL_CACHE_DIR": "/nvme/cache",
        "HOTPOOL_KV_CACHE_BYTES": "8g",
        "HOTPOOL_WORKER_TOKEN": "token",
        "OMP_NUM_THREADS": "4",
        "MKL_NUM_THREADS": "4",
    }


def test_worker_binds_its_node_ip_and_watches_its_actor() -> None:
    cmd = rb.worker_command(
        "/venv/bin/python", "w-1", "http://10.0.0.1:8000", "cuda", "info", "10.0.0.7", 42
    )
    assert cmd[:4] == ["/venv/bin/python", "-m", "hotpool", "worker"]
    opts = dict(zip(cmd[4::2], cmd[5::2], strict=True))
    assert opts == {
        "--worker-id": "w-1",
        "--control-plane": "http://10.0.0.1:8000",
        "--device": "cuda",
        "--log-level": "info",
        "--host": "10.0.0.7",  # the address it registers: reachable from the control plane
        "--parent-pid": "42",  # exits when its actor is killed
    }
    assert "secret" not in " ".join(cmd)


def test_actors_are_named_after_their_worker() -> None:
    assert rb.actor_name("w-abc") == "hotpool-worker-w-abc"
    assert rb.NAMESPACE == "hotpool"


def test_the_reason_of_a_dead_actor_is_rays_last_line() -> None:
    message = (
        "The actor died unexpectedly before finishing this task.\n\tclass_name: WorkerActor\n"
        "\tip: 10.0.0.7\nThe actor is dead because it was killed by `ray.kill`."
    )
    killed = "The actor is dead because it was killed by `ray.kill`."
    assert rb.death_cause(RuntimeError(message)) == killed
    assert rb.death_cause(RuntimeError("")) == "RuntimeError"


def test_a_worker_the_backend_does_not_know_is_stopped() -> None:
    config = rb.RayWorkerConfig("http://127.0.0.1:8000", "t")
    backend = rb.RayWorkerBackend(config, cluster_gpus=0.0)
    assert backend.exit_reason(WorkerHandle("w-gone")) == "stopped"
    assert backend.gpu is False


@pytest.mark.parametrize(
    ("env", "host", "cluster_ip", "url"),
    [
        ({}, "127.0.0.1", None, "http://127.0.0.1:8000"),
        ({}, "0.0.0.0", None, "http://127.0.0.1:8000"),  # local workers: loopback
        ({}, "0.0.0.0", "10.0.0.1", "http://10.0.0.1:8000"),  # Ray: our IP in the cluster
        ({}, "10.0.0.1", "10.0.0.1", "http://10.0.0.1:8000"),
        ({"HOTPOOL_CONTROL_PLANE_URL": "http://hotpool:8000"}, "0.0.0.0", "10.0.0.1",
         "http://hotpool:8000"),
    ],
)  # fmt: skip
def test_workers_reach_the_control_plane_at(
    tmp_path: Path, env: dict[str, str], host: str, cluster_ip: str | None, url: str
) -> None:
    settings = load_settings({"HOTPOOL_HOME": str(tmp_path), **env})
    assert control_plane_url(settings, host, 8000, cluster_ip) == url


def test_config_is_frozen() -> None:
    config = rb.RayWorkerConfig("http://127.0.0.1:8000", "t")
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.token = "other"  # type: ignore[misc]


def test_ray_is_imported_only_when_the_ray_backend_starts() -> None:
    code = (
        "import sys, hotpool.pool.ray_backend, hotpool.platform.server, hotpool.cli;"
        "print('ray' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
