"""``HOTPOOL_*`` settings: defaults under the data dir, and one clear error per bad value."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from hotpool.settings import Settings, SettingsError, load_settings


def test_defaults_live_under_hotpool_home(tmp_path: Path) -> None:
    s = load_settings({"HOTPOOL_HOME": str(tmp_path)})
    assert s.home == tmp_path.resolve()
    assert s.database_url == f"sqlite:///{tmp_path.resolve() / 'hotpool.db'}"
    assert s.object_store_url == f"file://{tmp_path.resolve() / 'objects'}"
    assert s.snapshots_dir == tmp_path.resolve() / "objects" / "snapshots"
    assert s.cache_dir == tmp_path.resolve() / "cache"
    assert (s.host, s.port, s.device, s.log_level) == ("127.0.0.1", 8000, "auto", "info")
    assert s.max_workers == 2
    assert s.warm_workers == 1
    assert s.default_idle_timeout_s == 300.0
    assert s.worker_token is None


def test_default_home_is_in_the_users_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    s = load_settings({})
    assert s.home == (tmp_path / ".hotpool").resolve()
    assert s.cache_dir == s.home / "cache"


def test_home_expands_tilde(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    assert load_settings({"HOTPOOL_HOME": "~/data"}).home == (tmp_path / "data").resolve()


def test_reads_the_process_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HOTPOOL_HOME", str(tmp_path))
    monkeypatch.setenv("HOTPOOL_PORT", "9123")
    s = load_settings()
    assert (s.home, s.port) == (tmp_path.resolve(), 9123)


def test_every_setting_is_read(tmp_path: Path) -> None:
    s = load_settings(
        {
            "HOTPOOL_HOME": str(tmp_path),
            "HOTPOOL_DATABASE_URL": "postgresql://u@db/hotpool",
            "HOTPOOL_OBJECT_STORE": "/srv/objects/",
            "HOTPOOL_CACHE_DIR": str(tmp_path / "c"),
            "HOTPOOL_HOST": "0.0.0.0",
            "HOTPOOL_PORT": "0",
            "HOTPOOL_DEVICE": " CUDA ",
            "HOTPOOL_MAX_WORKERS": "8",
            "HOTPOOL_WARM_WORKERS": "3",
            "HOTPOOL_WORKER_START_TIMEOUT_S": "30",
            "HOTPOOL_IDLE_TIMEOUT_S": "0.5",
            "HOTPOOL_QUEUE_TIMEOUT_S": "10",
            "HOTPOOL_MAX_QUEUE": "3",
            "HOTPOOL_HEARTBEAT_TIMEOUT_S": "6",
            "HOTPOOL_SCALE_DOWN_WINDOW_S": "0",
            "HOTPOOL_PREEMPT_AFTER_S": "2.5",
            "HOTPOOL_WORKER_THREADS": "4",
            "HOTPOOL_LOG_LEVEL": "DEBUG",
            "HOTPOOL_WORKER_TOKEN": "secret",
        }
    )
    assert s.database_url == "postgresql://u@db/hotpool"
    assert s.object_store_url == "file:///srv/objects"  # a bare path becomes a file:// URL
    assert s.cache_dir == (tmp_path / "c").resolve()
    assert (s.host, s.port, s.device, s.log_level) == ("0.0.0.0", 0, "cuda", "debug")
    assert (s.max_workers, s.warm_workers, s.max_queue) == (8, 3, 3)
    assert (s.worker_start_timeout_s, s.default_idle_timeout_s, s.queue_timeout_s) == (30, 0.5, 10)
    assert (s.heartbeat_timeout_s, s.scale_down_window_s, s.preempt_after_s) == (6, 0, 2.5)
    assert s.worker_threads == 4
    assert s.worker_token == "secret"


def test_empty_values_mean_default(tmp_path: Path) -> None:
    s = load_settings({"HOTPOOL_HOME": str(tmp_path), "HOTPOOL_PORT": "", "HOTPOOL_DEVICE": ""})
    assert (s.port, s.device) == (8000, "auto")


def test_settings_are_frozen_and_hide_the_token(tmp_path: Path) -> None:
    s = load_settings({"HOTPOOL_HOME": str(tmp_path), "HOTPOOL_WORKER_TOKEN": "hunter2"})
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.port = 1  # type: ignore[misc]
    assert "hunter2" not in repr(s)
    assert isinstance(s, Settings)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("HOTPOOL_PORT", "70000"),
        ("HOTPOOL_PORT", "-1"),
        ("HOTPOOL_PORT", "abc"),
        ("HOTPOOL_PORT", "80.5"),
        ("HOTPOOL_MAX_WORKERS", "0"),
        ("HOTPOOL_MAX_WORKERS", "two"),
        ("HOTPOOL_MAX_QUEUE", "-3"),
        ("HOTPOOL_WARM_WORKERS", "-1"),
        ("HOTPOOL_WARM_WORKERS", "one"),
        ("HOTPOOL_DEVICE", "tpu"),
        ("HOTPOOL_LOG_LEVEL", "verbose"),
        ("HOTPOOL_IDLE_TIMEOUT_S", "-1"),
        ("HOTPOOL_IDLE_TIMEOUT_S", "0"),
        ("HOTPOOL_IDLE_TIMEOUT_S", "nan"),
        ("HOTPOOL_IDLE_TIMEOUT_S", "inf"),
        ("HOTPOOL_QUEUE_TIMEOUT_S", "soon"),
        ("HOTPOOL_WORKER_START_TIMEOUT_S", "0"),
        ("HOTPOOL_HEARTBEAT_TIMEOUT_S", "0"),
        ("HOTPOOL_SCALE_DOWN_WINDOW_S", "-1"),
        ("HOTPOOL_PREEMPT_AFTER_S", "inf"),
        ("HOTPOOL_WORKER_THREADS", "0"),
        ("HOTPOOL_OBJECT_STORE", "relative/path"),
        ("HOTPOOL_OBJECT_STORE", "s3://bucket/prefix"),
        ("HOTPOOL_LOG_PROMPTS", "yes"),
        ("HOTPOOL_LOG_PROMPTS", "-5"),
    ],
)
def test_bad_value_names_the_variable(tmp_path: Path, name: str, value: str) -> None:
    with pytest.raises(SettingsError) as info:
        load_settings({"HOTPOOL_HOME": str(tmp_path), name: value})
    message = str(info.value)
    assert message.startswith(f"{name}={value!r} is invalid")
    assert "\n" not in message
    assert isinstance(info.value, ValueError)


def test_messages_say_what_is_expected(tmp_path: Path) -> None:
    def error(name: str, value: str) -> str:
        with pytest.raises(SettingsError) as info:
            load_settings({"HOTPOOL_HOME": str(tmp_path), name: value})
        return str(info.value)

    assert "65535" in error("HOTPOOL_PORT", "70000")
    assert "cpu" in error("HOTPOOL_DEVICE", "tpu")
    assert ">= 1" in error("HOTPOOL_MAX_WORKERS", "0")
    assert ">= 0" in error("HOTPOOL_WARM_WORKERS", "-1")
    assert "> 0" in error("HOTPOOL_IDLE_TIMEOUT_S", "-1")
    assert "absolute path" in error("HOTPOOL_OBJECT_STORE", "relative/path")


def test_warm_workers_can_be_turned_off(tmp_path: Path) -> None:
    s = load_settings({"HOTPOOL_HOME": str(tmp_path), "HOTPOOL_WARM_WORKERS": "0"})
    assert s.warm_workers == 0


def test_the_host_memory_tier_can_be_turned_off_but_not_made_tiny(tmp_path: Path) -> None:
    def host(value: str) -> int:
        env = {"HOTPOOL_HOME": str(tmp_path), "HOTPOOL_HOST_CACHE_BYTES": value}
        return load_settings(env).host_cache_bytes

    assert (host("0"), host("512m"), host("2GiB")) == (0, 512 << 20, 2 << 30)
    with pytest.raises(SettingsError, match="must be 0 \\(off\\) or at least 1m"):
        host("100k")


def test_prompts_stay_out_of_the_log_unless_a_length_is_given(tmp_path: Path) -> None:
    def prompts(value: str | None) -> int:
        env = {"HOTPOOL_HOME": str(tmp_path)}
        if value is not None:
            env["HOTPOOL_LOG_PROMPTS"] = value
        return load_settings(env).log_prompts

    assert (prompts(None), prompts("off"), prompts(" OFF "), prompts("0")) == (0, 0, 0, 0)
    assert (prompts("1"), prompts("2000")) == (1, 2000)
    with pytest.raises(SettingsError, match="must be off \\(or 0\\), or an integer >= 1"):
        prompts("on")


# --- worker backend (issue 10) ---------------------------------------------------------------


def test_backend_defaults_to_local_processes(tmp_path: Path) -> None:
    s = load_settings({"HOTPOOL_HOME": str(tmp_path)})
    assert (s.backend, s.ray_address, s.ray_worker_cpus) == ("local", None, 1.0)
    assert s.control_plane_url is None


@pytest.mark.parametrize(
    "address", ["auto", "10.0.0.5:6379", "ray-head.hotpool.svc:6379", "ray://ray-head:10001"]
)
def test_ray_settings_are_read(tmp_path: Path, address: str) -> None:
    s = load_settings(
        {
            "HOTPOOL_HOME": str(tmp_path),
            "HOTPOOL_BACKEND": " Ray ",
            "HOTPOOL_RAY_ADDRESS": address,
            "HOTPOOL_RAY_WORKER_CPUS": "0.5",
            "HOTPOOL_CONTROL_PLANE_URL": "http://hotpool.hotpool.svc:8000/",
        }
    )
    assert (s.backend, s.ray_address, s.ray_worker_cpus) == ("ray", address, 0.5)
    assert s.control_plane_url == "http://hotpool.hotpool.svc:8000"


@pytest.mark.parametrize(
    ("name", "value", "expected"),
    [
        ("HOTPOOL_BACKEND", "kubernetes", "local, ray"),
        ("HOTPOOL_RAY_ADDRESS", "ray-head", "host:port"),
        ("HOTPOOL_RAY_ADDRESS", "http://ray-head:8265", "host:port"),
        ("HOTPOOL_RAY_ADDRESS", "ray://ray-head:port", "host:port"),
        ("HOTPOOL_RAY_ADDRESS", "ray-head:99999", "host:port"),
        ("HOTPOOL_RAY_WORKER_CPUS", "0", "> 0"),
        ("HOTPOOL_RAY_WORKER_CPUS", "many", "float"),
        ("HOTPOOL_CONTROL_PLANE_URL", "hotpool:8000", "http://"),
    ],
)
def test_bad_backend_settings_name_the_variable(
    tmp_path: Path, name: str, value: str, expected: str
) -> None:
    env = {"HOTPOOL_HOME": str(tmp_path), "HOTPOOL_BACKEND": "ray", name: value}
    with pytest.raises(SettingsError) as info:
        load_settings(env)
    assert str(info.value).startswith(f"{name}={value!r} is invalid")
    assert expected in str(info.value)


def test_ray_address_without_the_ray_backend_is_an_error(tmp_path: Path) -> None:
    # Ignoring it would quietly run every worker on this machine instead of the cluster.
    with pytest.raises(SettingsError, match="HOTPOOL_BACKEND=ray"):
        load_settings({"HOTPOOL_HOME": str(tmp_path), "HOTPOOL_RAY_ADDRESS": "auto"})
