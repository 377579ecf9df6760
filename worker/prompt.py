"""A request's prompt as token ids: the one function the worker tokenizes with, and the
control plane's router too (to find the replica that caches the prompt's prefix), so both
see the same ids. No torch here: the control plane imports it."""

from __future__ import annotations

import json
from typing import Any

from hotpool.worker.protocol import GenerateRequest
from hotpool.worker.tokenizer import TextTokenizer


def parse_tools(req: GenerateRequest) -> list[dict[str, Any]] | None:
    """The tools a chat request lets the model call (OpenAI's tool dicts); None without
    tools or with ``tool_choice`` "none" (then the tools are not even rendered, as vLLM).
    ValueError names what is wrong with them."""
    if not req.tools or req.tool_choice == "none" or req.messages is None:
        return None
    try:
        tools = json.loads(req.tools)
    except ValueError:
        raise ValueError("`tools` is not JSON") from None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise ValueError("`tools` must be a list of tool objects")
    return tools or None


def prompt_token_ids(
    tok: TextTokenizer, req: GenerateRequest, tools: list[dict[str, Any]] | None
) -> tuple[int, ...]:
    """The prompt the engine runs: the chat template over ``req.messages`` (with ``tools``,
    :func:`parse_tools` of ``req``), or ``req.prompt``. Raises TemplateError."""
    if req.messages is not None:
        return tuple(tok.encode_chat(req.messages, tools))
    return tuple(tok.encode(req.prompt or ""))


# Text normalization may shrink a text before it is tokenized (a compatibility form, spaces
# collapsed): the bound below allows for it by this factor.
NORMALIZATION_SLACK = 2


def prompt_bytes(req: GenerateRequest) -> int:
    """The UTF-8 bytes of the text in ``req``'s prompt or messages (what the template adds
    only adds tokens)."""
    if req.messages is not None:
        return sum(len(m.content.encode()) for m in req.messages)
    return len((req.prompt or "").encode())


def fewest_tokens(nbytes: int, max_token_bytes: int) -> int:
    """The fewest tokens that ``nbytes`` bytes of text can be: what bounds a prompt against
    the context before it is tokenized (tokenizing megabytes takes seconds)."""
    return nbytes // (max(max_token_bytes, 1) * NORMALIZATION_SLACK)
