"""An HF folder of every family, as ``hotpool push`` takes it (config + safetensors +
tokenizer), pushed to the object store, loaded by a worker and served, in bf16 (the CPU's
fast path: the fused kernels) and fp32."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from family_models import FAMILIES, hf_model
from starlette.testclient import TestClient
from tokenizers import Tokenizer, models, pre_tokenizers

from hotpool.platform.deployment_schema import parse_deployment
from hotpool.worker.engine.llm_engine import EngineConfig
from hotpool.worker.server import build_worker_app
from hotpool.worker.service import WorkerService
from hotpool.worker.snapshot.cache import SnapshotCache
from hotpool.worker.snapshot.push import push_folder

pytest.importorskip("transformers")

TOKEN = "t"
AUTH = {"authorization": f"Bearer {TOKEN}"}
NEW = ("qwen3", "qwen3-moe", "phi3-longrope", "phi3-sliding-window", "gemma3")


def _hf_folder(family: str, folder: Path) -> Path:
    config_class, overrides = FAMILIES[family]
    hf_model(config_class, **overrides).save_pretrained(folder)
    # A word-level tokenizer over the tiny vocabulary (100 ids): words w0..w98, eos w99.
    vocab = {f"w{i}": i for i in range(100)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "w99"}))
    return folder


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("family", NEW)
def test_pushed_hf_folder_of_each_family_serves(family: str, dtype: str, tmp_path: Path) -> None:
    folder = _hf_folder(family, tmp_path / "hf")
    uri = f"file://{tmp_path / 'store' / family}"
    manifest, _ = push_folder(folder, uri)
    assert manifest.architecture == json.loads((folder / "config.json").read_text())["model_type"]
    # The control plane takes it as a deployment (it checks a local snapshot's model type).
    spec = parse_deployment({"name": "d", "snapshot_uri": uri}, 300.0, tmp_path / "store")
    assert spec.snapshot_uri == uri
    service = WorkerService(SnapshotCache(tmp_path / "cache"), torch.device("cpu"),
                            EngineConfig(kv_cache_bytes=8 << 20))  # fmt: skip
    with TestClient(build_worker_app(service, TOKEN, "w")) as client:
        r = client.post("/load", json={"deployment": "d", "snapshot_uri": uri, "dtype": dtype},
                        headers=AUTH)  # fmt: skip
        assert r.status_code == 200, r.text
        prompt = " ".join(f"w{(7 * i) % 97 + 1}" for i in range(40))  # past every window
        body = {"request_id": "g", "prompt": prompt,
                "params": {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}}  # fmt: skip
        with client.stream("POST", "/generate", json=body, headers=AUTH) as resp:
            assert resp.status_code == 200
            events = [json.loads(line) for line in resp.iter_lines() if line]
    final = events[-1]
    assert final["finish_reason"] == "length", final
    assert final["usage"]["prompt_tokens"] == 40
    assert final["usage"]["completion_tokens"] == 8
    assert sum(len(e["token_ids"]) for e in events) == 8
