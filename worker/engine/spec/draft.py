"""Draft-model proposals: a smaller model of the same tokenizer decodes ``k`` tokens ahead.

The draft runs in an engine of its own (``LLMEngine``: its own small paged KV cache,
scheduler and batch), so every request's drafts for a step come from one batched prefill
of what the draft has not seen yet and ``k - 1`` batched decode steps. Its prefix cache
carries each request's context from one step to the next: the draft recomputes only the
tail past its last full cached block and the tokens accepted since (at most
``block_size - 1 + k + 1`` tokens), never the whole sequence.

The draft decodes greedily, so its guesses are a deterministic function of the context:
the verifier treats them as one-hot proposals (``rejection``), which keeps every sampling
parameter's exact distribution; a draft that disagrees with the target costs speed only.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hotpool.worker.engine.base import EngineRequest, RequestRejected
from hotpool.worker.engine.spec.proposer import ProposalInput, Proposer
from hotpool.worker.models.llama import LlamaModel
from hotpool.worker.protocol import SamplingParams


class DraftModelProposer(Proposer):
    def __init__(
        self,
        draft: LlamaModel,
        device: torch.device,
        *,
        kv_cache_bytes: int = 64 << 20,
        max_num_seqs: int = 64,
        block_size: int = 16,
        target_vocab_size: int | None = None,
    ) -> None:
        """``target_vocab_size``: the target's vocabulary; a draft whose own is larger
        could propose ids the target has not, so it is refused (a smaller one is fine:
        a model family's sizes often pad the vocabulary differently)."""
        # Imported here: the engine imports this package, and this module builds an engine.
        from hotpool.worker.engine.llm_engine import EngineConfig, LLMEngine

        vocab = draft.config.vocab_size
        if target_vocab_size is not None and vocab > target_vocab_size:
            raise ValueError(
                f"the draft model's vocabulary ({vocab} tokens) is larger than the target's "
                f"({target_vocab_size}): it must share the target's tokenizer"
            )
        self.engine = LLMEngine(
            draft,
            device,
            EngineConfig(
                block_size=block_size,
                kv_cache_bytes=kv_cache_bytes,
                max_num_seqs=max_num_seqs,
                enable_prefix_caching=True,
            ),
        )
        self.vocab_size = vocab
        self._step_ids = 0

    def propose(self, requests: Sequence[ProposalInput], k: int) -> list[list[int]]:
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
        out: list[list[int]] = [[] for _ in requests]
        if not k or not requests:
            return out
        engine = self.engine
        params = SamplingParams(max_tokens=k, temperature=0.0, ignore_eos=True)
        ids: dict[str, int] = {}
        self._step_ids += 1
        for i, r in enumerate(requests):
            rid = f"{r.request_id}#{self._step_ids}"  # fresh: this step's drafts only
            tokens = tuple(r.prompt_token_ids) + tuple(r.output_token_ids)
            if max(tokens) >= self.vocab_size:
                continue  # a token the draft's (smaller) vocabulary lacks: no guess
            try:
                engine.add_request(EngineRequest(rid, tokens, params, frozenset()))
            except RequestRejected:
                continue  # longer than the draft's context or its KV budget: no guess
            ids[rid] = i
        while engine.has_unfinished():
            for o in engine.step():
                i = ids.get(o.request_id)
                if i is not None:
                    out[i].extend(o.new_token_ids)
                    if o.finish_reason == "error":
                        out[i] = []  # the draft's own fault (NaN logits): no guess
        return out

    def release(self, request_id: str) -> None:
        # Nothing per request outlives a step; the prefix cache forgets by eviction.
        return None

    def reset(self) -> None:
        # A failed step may have left drafts in the draft's engine, and its cache holds
        # what they wrote.
        self.engine.fail_all()

    def capture_decode_graphs(self) -> float:
        """The draft's k greedy steps a verification replay as the target's decodes do."""
        return self.engine.capture_decode_graphs()
