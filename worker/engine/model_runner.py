"""Turn a scheduler step into tensors, run the model once, sample.

Every step is one forward pass over a flat batch: the decode tokens first (one per
sequence), then the prefill chunks. Block tables and slot mapping are built once per step
and shared by every layer.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from hotpool.kernels import cpu_ops
from hotpool.kernels.paged_attention import decode_key_bias
from hotpool.kernels.sampling import NonFiniteLogitsError, SamplingRow, sample
from hotpool.worker.engine.base import SampledToken
from hotpool.worker.engine.decode_graphs import DecodeGraphs, DecodeRow
from hotpool.worker.engine.grammar import token_bitmask
from hotpool.worker.engine.request import Request
from hotpool.worker.engine.scheduler import ScheduledRequest, SchedulerOutput
from hotpool.worker.engine.spec.rejection import verify_batch
from hotpool.worker.models.attention import (
    PagedAttention,
    PagedAttentionMetadata,
    PagedKVCache,
    PrefillSpan,
    attention_kernels,
)
from hotpool.worker.models.llama import LlamaModel

_NON_FINITE = "the model produced NaN or infinite logits; generation stopped"


@dataclass(frozen=True)
class StepOutput:
    # request id -> its new tokens: one, or with speculation the accepted proposals and one
    sampled: dict[str, list[SampledToken]]
    failed: dict[str, str]  # request id -> why it cannot go on (e.g. NaN logits)


class ModelRunner:
    def __init__(
        self,
        model: LlamaModel,
        kv: PagedKVCache,
        device: torch.device,
        attention_backend: str | None = None,
        sampler_backend: str | None = None,
        layer_group: tuple[int, ...] = (),
    ) -> None:
        self.model = model
        self.kv = kv
        # Which layer group's block table each layer reads (``kv_groups``); () = one group.
        self.layer_group = layer_group
        self.num_groups = max(layer_group, default=0) + 1
        self.device = device
        self.attention = attention_kernels(kv.k[0], model.native_ops, attention_backend)
        self.sampler_backend = sampler_backend
        self._rows: dict[str, SamplingRow] = {}  # each request's row, built once
        # Wall time spent sampling (logits to tokens, penalties and logprobs included): the
        # sampler's share of a step, which benchmarks/bench_sampling.py holds to 5%. On a GPU
        # it also holds the wait for the forward pass (the results' copy to the host waits).
        self.sampler_seconds = 0.0
        # Set once captured (``LLMEngine.capture_decode_graphs``): plain decode steps replay.
        self.graphs: DecodeGraphs | None = None

    def release(self, request_id: str) -> None:
        self._rows.pop(request_id, None)

    @torch.inference_mode()
    def execute(self, step: SchedulerOutput) -> StepOutput:
        if (replayed := self._graph_step(step.scheduled)) is not None:
            graph_logits, first_rows = replayed
            plain: list[tuple[ScheduledRequest, int]] = []
            specs: list[tuple[ScheduledRequest, int]] = []
            for s, r in zip(step.scheduled, first_rows, strict=True):
                if s.samples:
                    (specs if s.spec_token_ids else plain).append((s, r))
            if not plain and not specs:
                return StepOutput({}, {})
            return self._sampled(plain, specs, graph_logits)
        # Eagerly, a request verifying proposals is a span of several tokens, as a prefill
        # chunk is.
        decodes = [s for s in step.scheduled if s.num_new_tokens == 1]
        prefills = [s for s in step.scheduled if s.num_new_tokens > 1]
        ordered = decodes + prefills
        ids: list[int] = []
        positions: list[int] = []
        slots: list[list[int]] = [[] for _ in range(self.num_groups)]  # per layer group
        sample_rows: list[int] = []  # flat-batch rows whose logits the samplers need
        bs = self.kv.block_size
        for s in ordered:
            k = len(s.spec_token_ids)
            ids.extend(_tokens(s.request, s.start, s.start + s.num_new_tokens - k))
            ids.extend(s.spec_token_ids)
            span = range(s.start, s.start + s.num_new_tokens)
            positions.extend(span)
            for group_slots, table in zip(slots, s.group_block_ids, strict=True):
                group_slots.extend(table[pos // bs] * bs + pos % bs for pos in span)
            if s.samples:
                # The last known token and each proposal: k + 1 distributions to verify.
                sample_rows.extend(range(len(ids) - 1 - k, len(ids)))
        dev = self.device
        metas = self._metadata(
            decodes, prefills, [torch.tensor(g, dtype=torch.long, device=dev) for g in slots]
        )
        hidden = self.model(
            torch.tensor(ids, dtype=torch.long, device=dev),
            torch.tensor(positions, dtype=torch.long, device=dev),
            PagedAttention(self.kv, metas, self.attention, self.layer_group),
        )
        samplers = [s for s in ordered if s.samples]
        if not samplers:
            return StepOutput({}, {})
        logits = self.model.logits(hidden[torch.tensor(sample_rows, device=dev)])
        plain, specs = [], []  # (request, its logits row), (request, its first logits row)
        row = 0
        for s in samplers:
            (specs if s.spec_token_ids else plain).append((s, row))
            row += len(s.spec_token_ids) + 1
        return self._sampled(plain, specs, logits)

    def _graph_step(
        self, scheduled: tuple[ScheduledRequest, ...]
    ) -> tuple[torch.Tensor, list[int]] | None:
        """The logits of a step replayed from a captured graph (or kernel program), with
        each request's first row in them; None where this step runs eagerly (no graphs, a
        prefill chunk, or more rows than the largest graph).

        A request verifying ``k`` proposals is ``k + 1`` decode rows of one sequence: row
        ``i`` is the token at ``start + i``, its KV written with the step's other rows before
        any attention reads, attending to ``start + i + 1`` keys. That is the causal span the
        eager step computes, so speculative steps replay as plain decode batches do."""
        graphs = self.graphs
        if graphs is None or not scheduled:
            return None
        if any(s.num_new_tokens != len(s.spec_token_ids) + 1 for s in scheduled):
            return None
        n = sum(s.num_new_tokens for s in scheduled)
        width = max(len(t) for s in scheduled for t in s.group_block_ids)
        if not graphs.fits(n, width):
            return None
        bs = self.kv.block_size
        rows: list[DecodeRow] = []
        first_rows: list[int] = []
        for s in scheduled:
            first_rows.append(len(rows))
            tables = tuple(s.group_block_ids)
            (known,) = _tokens(s.request, s.start, s.start + 1)
            for pos, token in enumerate((known, *s.spec_token_ids), start=s.start):
                slots = tuple(t[pos // bs] * bs + pos % bs for t in tables)
                rows.append(DecodeRow(token, pos, slots, tables))
        return graphs.run(rows), first_rows

    def _sampled(
        self,
        plain: list[tuple[ScheduledRequest, int]],
        specs: list[tuple[ScheduledRequest, int]],
        logits: torch.Tensor,
    ) -> StepOutput:
        sampled: dict[str, list[SampledToken]] = {}
        failed: dict[str, str] = {}
        t0 = time.perf_counter()
        try:
            if plain:
                self._sample(plain, logits, sampled, failed)
            if specs:
                self._verify(specs, logits, sampled, failed)
        finally:
            self.sampler_seconds += time.perf_counter() - t0
        return StepOutput(sampled, failed)

    def _sample(
        self,
        plain: list[tuple[ScheduledRequest, int]],
        all_logits: torch.Tensor,
        sampled: dict[str, list[SampledToken]],
        failed: dict[str, str],
    ) -> None:
        """One token for each request that verifies nothing: the sampler's batch."""
        rows = [self._row(s.request) for s, _ in plain]
        if self._greedy(plain, rows, all_logits, sampled, failed):
            return
        dev = self.device
        samplers = [s for s, _ in plain]
        logits = all_logits[torch.tensor([r for _, r in plain], device=dev)]
        constrained = [(s.request.grammar, i) for i, s in enumerate(samplers) if s.request.grammar]
        bitmask = (
            token_bitmask(constrained, len(samplers), logits.shape[1]) if constrained else None
        )
        try:
            out = sample(logits, rows, backend=self.sampler_backend, token_bitmask=bitmask)
        except NonFiniteLogitsError as exc:
            # A numerical fault in some rows fails those requests, not the whole batch.
            bad = set(exc.rows)
            keep = [i for i in range(len(samplers)) if i not in bad]
            for i in sorted(bad):
                failed[samplers[i].request.request_id] = _NON_FINITE
            samplers, rows = [samplers[i] for i in keep], [rows[i] for i in keep]
            if not samplers:
                return
            kept = torch.tensor(keep, device=dev)
            out = sample(
                logits[kept], rows, backend=self.sampler_backend,
                token_bitmask=None if bitmask is None else bitmask[kept.cpu()],
            )  # fmt: skip
        tokens = out.token_ids.tolist()
        logprobs = out.logprobs.tolist()
        tops: list[list[tuple[int, float]]] = [[] for _ in samplers]
        if out.top_logprobs is not None:
            values, top_ids = out.top_logprobs
            for i, s in enumerate(samplers):
                n = s.request.params.logprobs or 0
                tops[i] = list(zip(top_ids[i, :n].tolist(), values[i, :n].tolist(), strict=True))
        for i, s in enumerate(samplers):
            sampled[s.request.request_id] = [SampledToken(tokens[i], logprobs[i], tuple(tops[i]))]

    def _greedy(
        self,
        plain: list[tuple[ScheduledRequest, int]],
        rows: list[SamplingRow],
        all_logits: torch.Tensor,
        sampled: dict[str, list[SampledToken]],
        failed: dict[str, str],
    ) -> bool:
        """The batch's tokens in one C pass over the logits (``cpu_ops.greedy``) where every
        request is greedy with no penalty, grammar or logprobs and the logits are on the
        CPU: the tokens the sampler would pick, without its copies of the logits (half a
        millisecond of a few-millisecond CPU step). False, having done nothing, elsewhere."""
        if self.sampler_backend not in (None, "torch") or all_logits.device.type != "cpu":
            return False
        if all_logits.dtype not in (torch.float32, torch.bfloat16) or all_logits.stride(1) != 1:
            return False
        for (s, _), row in zip(plain, rows, strict=True):
            if not row.greedy or row.has_penalty or row.logprob or row.num_logprobs:
                return False
            if s.request.grammar:
                return False
        ops = cpu_ops.load()
        if ops is None:
            return False
        tokens = ops.greedy(all_logits, torch.tensor([r for _, r in plain])).tolist()
        for (s, _), token in zip(plain, tokens, strict=True):
            if token < 0:  # NaN or +inf, or nothing but -inf: as the sampler fails it
                failed[s.request.request_id] = _NON_FINITE
            else:
                sampled[s.request.request_id] = [SampledToken(token, math.nan, ())]
        return True

    def _verify(
        self,
        specs: list[tuple[ScheduledRequest, int]],
        all_logits: torch.Tensor,
        sampled: dict[str, list[SampledToken]],
        failed: dict[str, str],
    ) -> None:
        """The accepted proposals and one more token for each request that verifies some
        (``spec.rejection``); logprobs are the raw ones at each emitted position, as the
        sampler gives them."""
        logits = all_logits.detach().float().cpu()
        while specs:
            spans = [logits[r : r + len(s.spec_token_ids) + 1] for s, r in specs]
            rows = [self._row(s.request) for s, _ in specs]
            try:
                emitted = verify_batch(
                    torch.cat(spans), [s.spec_token_ids for s, _ in specs], None, rows
                )
                break
            except NonFiniteLogitsError as exc:
                for i in exc.rows:
                    failed[specs[i][0].request.request_id] = _NON_FINITE
                specs = [sr for i, sr in enumerate(specs) if i not in set(exc.rows)]
        else:
            return
        for (s, _), span, tokens in zip(specs, spans, emitted, strict=True):
            want = s.request.params.logprobs
            if want is None:
                sampled[s.request.request_id] = [SampledToken(t, math.nan) for t in tokens]
                continue
            lp = torch.log_softmax(span[: len(tokens)], dim=1)
            chosen = lp.gather(1, torch.tensor(tokens)[:, None]).squeeze(1).tolist()
            tops: list[tuple[tuple[int, float], ...]] = [()] * len(tokens)
            if want:
                values, top_ids = lp.topk(min(want, lp.shape[1]), dim=1)
                tops = [
                    tuple(zip(i.tolist(), v.tolist(), strict=True))
                    for i, v in zip(top_ids, values, strict=True)
                ]
            sampled[s.request.request_id] = [
                SampledToken(t, c, top) for t, c, top in zip(tokens, chosen, tops, strict=True)
            ]

    def _metadata(
        self,
        decodes: list[ScheduledRequest],
        prefills: list[ScheduledRequest],
        slot_mappings: list[torch.Tensor],
    ) -> list[PagedAttentionMetadata]:
        """One metadata per layer group: its slots and block tables; the sequence lengths and
        the key bias are the same for every group (their tables span the same positions)."""
        dev = self.device
        bs = self.kv.block_size
        width = max((len(s.block_ids) for s in decodes), default=1)
        seq_lens = torch.tensor([s.start + 1 for s in decodes], dtype=torch.long, device=dev)
        mask = None
        if decodes and self.attention.needs_key_bias:
            mask = decode_key_bias(seq_lens, width * bs)
        metas = []
        for g, slot_mapping in enumerate(slot_mappings):
            tables = torch.tensor(
                [list(t) + [0] * (width - len(t)) for t in (s.group_block_ids[g] for s in decodes)]
                or [[0]],
                dtype=torch.long,
                device=dev,
            )[: len(decodes)]
            spans = []
            q_start = len(decodes)
            for s in prefills:
                n_blocks = -(-(s.start + s.num_new_tokens) // bs)
                table = torch.tensor(s.group_block_ids[g][:n_blocks], dtype=torch.long, device=dev)
                spans.append(PrefillSpan(q_start, s.num_new_tokens, s.start, table))
                q_start += s.num_new_tokens
            metas.append(
                PagedAttentionMetadata(
                    slot_mapping, len(decodes), tables, seq_lens, mask, tuple(spans)
                )
            )
        return metas

    def _row(self, req: Request) -> SamplingRow:
        """The request's sampling row at this step. Its parameters, seeded generator and
        token lists (live references, so penalties see every new token) are fixed at the
        first step; later steps only move the offset."""
        offset = len(req.output_token_ids)
        row = self._rows.get(req.request_id)
        if row is not None:
            return row.with_offset(offset)
        p = req.params
        gen = None if p.seed is None else torch.Generator().manual_seed(p.seed)
        penalized = p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0
        row = self._rows[req.request_id] = SamplingRow(
            temperature=p.temperature,
            top_k=p.top_k,
            top_p=p.top_p,
            min_p=p.min_p,
            presence_penalty=p.presence_penalty,
            frequency_penalty=p.frequency_penalty,
            repetition_penalty=p.repetition_penalty,
            generator=gen,
            seed=p.seed,
            offset=offset,
            num_logprobs=p.logprobs or 0,
            logprob=p.logprobs is not None,
            prompt_token_ids=req.prompt_token_ids if penalized else (),
            output_token_ids=req.output_token_ids if penalized else (),
        )
        return row


def _tokens(req: Request, a: int, b: int) -> list[int]:
    """Tokens ``[a, b)`` of prompt + output without building the whole list."""
    n = req.num_prompt_tokens
    if b <= n:
        return list(req.prompt_token_ids[a:b])
    if a >= n:
        return req.output_token_ids[a - n : b - n]
    return [*req.prompt_token_ids[a:], *req.output_token_ids[: b - n]]
