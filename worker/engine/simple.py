"""A deliberately simple engine: one sequence per forward pass, contiguous KV per request.

It is correct and small, and it already counts work in tokens (``num_computed`` catches up
with prompt + output), so the batched scheduler over a paged cache (issue 3) can replace it
behind :class:`~hotpool.worker.engine.base.Engine` without changing its callers.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from hotpool.kernels.sampling import RowParams, sample
from hotpool.worker.engine.base import Engine, EngineRequest, RequestOutput, RequestRejected
from hotpool.worker.models.attention import ContiguousAttention, SequenceKVCache
from hotpool.worker.models.llama import LlamaModel
from hotpool.worker.protocol import FinishReason


@dataclass
class _Sequence:
    request: EngineRequest
    cache: SequenceKVCache
    generator: torch.Generator | None
    max_new: int
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0

    @property
    def token_ids(self) -> list[int]:
        return [*self.request.prompt_token_ids, *self.output_ids]


class SimpleEngine(Engine):
    def __init__(
        self,
        model: LlamaModel,
        device: torch.device,
        max_model_len: int | None = None,
        max_num_seqs: int = 8,
    ) -> None:
        cfg = model.config
        self.model = model
        self.device = device
        self.dtype = model.embed.weight.dtype
        self.max_model_len = min(
            max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings
        )
        self.max_num_seqs = max_num_seqs
        self._waiting: deque[EngineRequest] = deque()
        self._running: dict[str, _Sequence] = {}

    def add_request(self, request: EngineRequest) -> None:
        n = len(request.prompt_token_ids)
        if n == 0:
            raise RequestRejected("the prompt is empty")
        want = request.params.max_tokens
        if n + (want or 1) > self.max_model_len:
            raise RequestRejected(
                f"this model's maximum context length is {self.max_model_len} tokens; the request "
                f"has {n} prompt tokens and asks for {want or 1} more"
            )
        self._waiting.append(request)

    def abort(self, request_id: str) -> None:
        self._running.pop(request_id, None)
        self._waiting = deque(r for r in self._waiting if r.request_id != request_id)

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running)

    def step(self) -> list[RequestOutput]:
        while self._waiting and len(self._running) < self.max_num_seqs:
            self._admit(self._waiting.popleft())
        outputs = []
        for seq in list(self._running.values()):
            outputs.append(self._advance(seq))
            if outputs[-1].finished:
                del self._running[seq.request.request_id]
        return outputs

    def _admit(self, request: EngineRequest) -> None:
        cfg = self.model.config
        n = len(request.prompt_token_ids)
        max_new = request.params.max_tokens or self.max_model_len - n
        capacity = n + max_new
        cache = SequenceKVCache(
            cfg.num_hidden_layers,
            capacity,
            cfg.num_key_value_heads,
            cfg.head_dim,
            self.dtype,
            self.device,
        )
        gen = None
        if request.params.seed is not None:
            gen = torch.Generator().manual_seed(request.params.seed)
        self._running[request.request_id] = _Sequence(request, cache, gen, max_new)

    @torch.inference_mode()
    def _advance(self, seq: _Sequence) -> RequestOutput:
        tokens = seq.token_ids
        todo = tokens[seq.num_computed :]
        ids = torch.tensor(todo, dtype=torch.long, device=self.device)
        positions = torch.arange(seq.num_computed, len(tokens), device=self.device)
        attn = ContiguousAttention(seq.cache, seq.num_computed, len(todo))
        hidden = self.model(ids, positions, attn)
        logits = self.model.logits(hidden[-1:])
        p = seq.request.params
        row = RowParams(p.temperature, p.top_k, p.top_p, seq.generator)
        token = int(sample(logits.cpu(), [row])[0])
        seq.num_computed = len(tokens)
        seq.output_ids.append(token)
        return RequestOutput(
            request_id=seq.request.request_id,
            new_token_ids=(token,),
            finish_reason=self._finish_reason(seq, token),
            num_prompt_tokens=len(seq.request.prompt_token_ids),
        )

    def _finish_reason(self, seq: _Sequence, token: int) -> FinishReason | None:
        p = seq.request.params
        if not p.ignore_eos and token in seq.request.eos_token_ids:
            return "stop"
        if len(seq.output_ids) >= seq.max_new:
            return "length"
        return None
