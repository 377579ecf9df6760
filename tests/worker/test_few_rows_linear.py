"""fp32 CPU linears at 1-4 rows (worker/models/few_rows_linear.py): the same products as
``F.linear``, with and without bias, at every row count (other inputs take F.linear), and
the swap keeps tied embeddings tied."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from tiny_llama import TINY, tiny_model
from torch import nn

from hotpool.worker.models.few_rows_linear import FEW_ROWS, FewRowsLinear, use_few_rows_linears


@pytest.mark.parametrize("bias", [False, True])
def test_every_row_count_matches_f_linear(bias: bool) -> None:
    torch.manual_seed(0)
    layer = nn.Linear(96, 200, bias=bias)
    weight = layer.weight.detach().clone()
    b = None if layer.bias is None else layer.bias.detach().clone()
    assert use_few_rows_linears(layer) == 1 and isinstance(layer, FewRowsLinear)
    with torch.inference_mode():
        for m in range(1, 2 * FEW_ROWS + 2):
            x = torch.randn(m, 96)
            y = layer(x)
            assert y.shape == (m, 200) and y.is_contiguous()
            torch.testing.assert_close(y, F.linear(x, weight, b), rtol=1e-5, atol=1e-5)
        x = torch.randn(2, 3, 96)  # not 2-D: F.linear's
        torch.testing.assert_close(layer(x), F.linear(x, weight, b))


def test_swapped_in_place_keeping_ties() -> None:
    model = tiny_model(cfg=replace(TINY, tie_word_embeddings=True))
    model.lm_head.weight = model.embed.weight  # tied as the loader ties them
    linears = sum(type(m) is nn.Linear for m in model.modules())
    x = torch.randint(0, TINY.vocab_size, (3,))
    with torch.inference_mode():
        before = model.lm_head(model.embed(x))
    assert use_few_rows_linears(model) == linears > 0
    assert model.lm_head.weight is model.embed.weight
    with torch.inference_mode():
        torch.testing.assert_close(model.lm_head(model.embed(x)), before)
    assert use_few_rows_linears(model) == 0  # already swapped
