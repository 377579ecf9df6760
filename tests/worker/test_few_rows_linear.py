"""fp32 CPU linears at 1-4 rows (worker/models/few_rows_linear.py): the same products as
``F.linear``, with and without bias, at every row count (other inputs take F.linear), and
the swap keeps tied embeddings tied; the loader swaps only where the GEMM measures faster."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from tiny_llama import TINY, tiny_model
from torch import nn

from hotpool.worker.models import loader
from hotpool.worker.models.few_rows_linear import (
    FEW_ROWS,
    FewRowsLinear,
    few_rows_pay,
    use_few_rows_linears,
)


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


def test_the_gemm_is_swapped_in_only_where_it_measures_faster() -> None:
    """few_rows_pay runs both ways over the model's own linears and the GEMM must win by
    PAY_MARGIN: passes 20% faster say yes, 5% faster or 30% slower say no."""
    model = tiny_model()
    for few_s, pays in ((0.8, True), (0.95, False), (1.3, False)):
        ran: list[str] = []

        def timer(
            way: str, run: Callable[[], None], few_s: float = few_s, ran: list[str] = ran
        ) -> float:
            run()  # the pass really runs: the model's linears at one row
            ran.append(way)
            return few_s if way == "few" else 1.0

        assert few_rows_pay(model, repeats=2, timer=timer) == pays
        assert ran == ["plain", "few"] * 2
    assert not few_rows_pay(nn.Sequential())  # no fp32 linears: nothing to gain


def test_fp32_models_load_with_the_faster_linears(
    smollm2_snapshot_fp32: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loader asks few_rows_pay about fp32 CPU models and swaps only on yes."""
    for pays in (True, False):
        monkeypatch.setattr(loader, "few_rows_pay", lambda model, pays=pays: pays)
        model = loader.load_model(smollm2_snapshot_fp32, torch.device("cpu"), torch.float32)
        assert any(isinstance(m, FewRowsLinear) for m in model.modules()) == pays
