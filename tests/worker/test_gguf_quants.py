"""Every block type the converter accepts dequantizes to what HF transformers' own
dequantizer computes (Q5_0 and Q5_1, which it lacks, to llama.cpp's reference written out
here); anything else is refused, naming the tensor and its type."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from tiny_gguf import QUANT_TYPES, llama_cpp_q5, random_blocks, write_tiny_gguf
from transformers.integrations.gguf import dequant as hf_dequant

from hotpool.worker.snapshot.errors import SnapshotError
from hotpool.worker.snapshot.gguf import convert_gguf
from hotpool.worker.snapshot.gguf_tensors import SUPPORTED_TYPES

Q = GGMLQuantizationType
ROWS, COLS = 8, 512


@pytest.mark.parametrize("kind", QUANT_TYPES, ids=lambda k: k.name)
def test_dequantization_equals_hf(kind: GGMLQuantizationType) -> None:
    raw = random_blocks(kind, ROWS, COLS, seed=int(kind))
    ours = dequantize(raw, kind)
    assert ours.shape == (ROWS, COLS)
    if kind in (Q.Q5_0, Q.Q5_1):
        expected = llama_cpp_q5(raw, with_min=kind == Q.Q5_1)
    else:
        expected = hf_dequant.dequantize(torch.from_numpy(raw.reshape(-1)), int(kind)).numpy()
    np.testing.assert_array_equal(ours.reshape(-1), expected)
    assert np.isfinite(ours).all() and np.abs(ours).max() > 0


def test_every_tested_type_is_accepted_and_only_those() -> None:
    floats = {Q.F32, Q.F16, Q.BF16}
    assert floats | set(QUANT_TYPES) == SUPPORTED_TYPES


def test_an_unsupported_block_type_is_refused_by_name(tmp_path: Path) -> None:
    gguf = write_tiny_gguf(tmp_path / "iq.gguf", "llama", embedding=Q.IQ4_NL)
    with pytest.raises(SnapshotError) as info:
        convert_gguf(gguf, tmp_path / "out", "fp32")
    message = str(info.value)
    assert "iq.gguf: GGUF tensor 'token_embd.weight' is stored as IQ4_NL" in message
    assert "Q4_K" in message  # the supported ones are listed
    assert not (tmp_path / "out").exists()  # nothing half-written
