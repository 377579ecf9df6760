"""How long an answer may be: a deployment's ``default_max_tokens`` (what a request that
gives no ``max_tokens`` gets) and ``max_tokens_limit`` (the most one may ask for).

Without them a chat request with no ``max_tokens`` runs to the end of the context: a small
model that repeats itself held a replica's slot for thousands of tokens. Applied once, in
the invoker, for every endpoint (OpenAI's and the native invoke), before admission.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from hotpool.billing.deployments import DeploymentSpec
from hotpool.platform.errors import APIError
from hotpool.platform.schemas import CompletionCall

# OpenAI's default for /v1/completions (a prompt); chat's is "up to the context".
PROMPT_DEFAULT_MAX_TOKENS = 16


def bounded(call: CompletionCall, spec: DeploymentSpec) -> CompletionCall:
    """``call`` with its ``max_tokens`` resolved against ``spec``'s bounds; a request that
    asks for more than the limit is a 400 (cutting it silently would pass for a model that
    stopped), as is a ``min_tokens`` above what it will get."""
    params = call.params
    asked, limit = params.max_tokens, spec.max_tokens_limit
    prefix = "params." if call.endpoint == "invoke" else ""
    if asked is not None:
        if limit is not None and asked > limit:
            raise APIError(
                400,
                f"`{prefix}max_tokens` is {asked}, above the most deployment {spec.name!r} "
                f"allows ({limit}, its max_tokens_limit): ask for at most {limit}",
                param=f"{prefix}max_tokens",
                code="integer_above_max_value",
            )
        return call
    default = spec.default_max_tokens
    if default is None and call.prompt is not None:
        default = PROMPT_DEFAULT_MAX_TOKENS
    if limit is not None:
        default = limit if default is None else min(default, limit)
    if default is not None and params.min_tokens > default:
        raise APIError(
            400,
            f"`{prefix}min_tokens` ({params.min_tokens}) is above the {default} tokens a "
            f"request without `max_tokens` gets from deployment {spec.name!r}: give "
            "`max_tokens` too",
            param=f"{prefix}min_tokens",
        )
    return replace(call, params=replace(params, max_tokens=default))


def answer_bounds_json(spec: DeploymentSpec) -> dict[str, Any]:
    """The bounds as ``/v1/models`` and the deployments API report them (null: none)."""
    return {
        "default_max_tokens": spec.default_max_tokens,
        "max_tokens_limit": spec.max_tokens_limit,
    }
