"""``GET /openapi.json``: the OpenAPI 3.1 document of the public API, built once at import.

Bounds, enums and field names come from the parsers' own constants, so the document moves
with them; ``tests/platform/test_openapi.py`` checks that each request schema names exactly
the fields its parser accepts and that every public route is documented, then fuzzes the app
against the document. ``/internal/*`` (workers only) is left out on purpose.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from hotpool import __version__
from hotpool.billing.deployments import (
    MAX_KV_CACHE_BYTES,
    MIN_KV_CACHE_BYTES,
    MIN_MAX_MODEL_LEN,
)
from hotpool.billing.keys import KEY_NAME_MAX_LEN, SCOPES
from hotpool.billing.models import QUANTIZATIONS, STATUSES
from hotpool.billing.prices import DEFAULT_CURRENCY, DEPLOYMENT_MAX_LEN, MAX_PRICE_MICROS
from hotpool.billing.tenants import TENANT_NAME_MAX_LEN
from hotpool.billing.usage import BUCKET_WIDTHS
from hotpool.platform import deployment_schema as dep
from hotpool.platform import schemas, tools
from hotpool.platform.auth import MAX_SESSION_CHARS, SESSION_HEADER
from hotpool.platform.deployments_api import MAX_EVENT_ID, MAX_EVENTS_PAGE
from hotpool.platform.middleware import CLIENT_REQUEST_ID
from hotpool.platform.prices_api import AMOUNTS
from hotpool.platform.services import MAX_BODY_BYTES
from hotpool.platform.usage_api import GROUPS, MAX_LIMIT, MAX_TIMESTAMP
from hotpool.pool.replica import ReplicaState
from hotpool.snapshot_names import SNAPSHOT_NAME
from hotpool.worker.protocol import (
    DEFAULT_MAX_BATCH,
    MAX_LOGPROBS,
    MAX_N,
    MAX_SPEC_TOKENS,
    SPEC_METHODS,
)

JSON = "application/json"
Schema = dict[str, Any]

# --- schema helpers -----------------------------------------------------------------------


def ref(name: str) -> Schema:
    return {"$ref": f"#/components/schemas/{name}"}


def null(schema: Schema) -> Schema:
    """``schema`` or null (the parsers read null as "not given" for optional fields)."""
    return {"anyOf": [schema, {"type": "null"}]}


def obj(props: dict[str, Schema], required: tuple[str, ...] = (), closed: bool = True) -> Schema:
    """An object; ``closed``: unknown fields are a 400 (requests) or never sent (responses)."""
    out: Schema = {"type": "object", "properties": props, "required": list(required)}
    return {**out, "additionalProperties": False} if closed else out


def every(props: dict[str, Schema]) -> Schema:
    """A response object that always has all of ``props`` and nothing else."""
    return obj(props, tuple(props))


def arr(items: Schema, **bounds: int) -> Schema:
    return {"type": "array", "items": items, **bounds}


def integer(lo: int | None = None, hi: int | None = None, **extra: Any) -> Schema:
    bounds = {k: v for k, v in (("minimum", lo), ("maximum", hi)) if v is not None}
    return {"type": "integer", **bounds, **extra}


def number(lo: float, hi: float, open_lo: bool = False) -> Schema:
    return {"type": "number", "exclusiveMinimum" if open_lo else "minimum": lo, "maximum": hi}


def const(value: Any) -> Schema:
    return {"const": value}


def strings(*values: str) -> Schema:
    return {"type": "string", "enum": list(values)}


def text(pattern: str | None = None, **extra: Any) -> Schema:
    return {"type": "string", **({"pattern": pattern} if pattern else {}), **extra}


def unsupported(schema: Schema) -> Schema:
    """A parameter hotpool does not support yet: only what ``schema`` allows passes."""
    return {**schema, "description": "Not supported yet: only the values allowed here pass."}


STR, NUM, BOOL = text(), {"type": "number"}, {"type": "boolean"}
NULL: Schema = {"type": "null"}
# A deployment's speculative decoding policy: in a request (defaults filled in when stored)
# and as stored, every default filled in (``SpeculativeConfig.to_json``).
SPEC_NGRAM = obj({"min_n": integer(1, 64), "max_n": integer(1, 64)})
SPECULATIVE_IN: Schema = {
    **null(
        obj(
            {
                "method": strings(*SPEC_METHODS),
                "num_tokens": integer(1, MAX_SPEC_TOKENS),
                "max_batch": integer(0, (1 << 31) - 1),
                "ngram": SPEC_NGRAM,
                "draft_snapshot": text(),
            }
        )
    ),
    "description": "Speculative decoding: `ngram` (prompt lookup, no second model) or "
    "`draft` (`draft_snapshot`: a smaller model of the same tokenizer, a URI or a local "
    "snapshot's name) proposes `num_tokens` (default 4) tokens a step, verified exactly (the "
    "output's distribution is the model's own). Off while more than `max_batch` (default "
    f"{DEFAULT_MAX_BATCH}; 0: never off) requests decode at once. null: no speculation.",
}
SPECULATIVE_OUT: Schema = null(
    obj(
        {
            "method": strings(*SPEC_METHODS),
            "num_tokens": integer(1, MAX_SPEC_TOKENS),
            "max_batch": integer(0),
            "ngram": every({"min_n": integer(1), "max_n": integer(1)}),
            "draft_snapshot": STR,
        },
        ("method", "num_tokens", "max_batch"),
    )
)
COUNT = integer(0)
UNIX = integer(description="Unix time in seconds")
PHASES = null({"type": "object", "additionalProperties": NUM})
# hotpool.platform.answer_bounds: how long an answer may be (null: no bound but the context)
ANSWERS = every({"default_max_tokens": null(integer(1)), "max_tokens_limit": null(integer(1))})
BYTES = arr(integer(0, 255))
TOKEN_LOGPROB = {"token": STR, "logprob": NUM, "bytes": BYTES}
FINISH = strings("stop", "length")
CHAT_FINISH = strings("stop", "length", "tool_calls")
FUNCTION_NAME = text(f"^{tools.NAME.pattern}$")
ARGUMENTS = {**STR, "description": "The arguments: the JSON text of an object."}
TOOL_CALL = every(
    {
        "id": text(minLength=1, maxLength=tools.MAX_CALL_ID),
        "type": const("function"),
        "function": every({"name": FUNCTION_NAME, "arguments": ARGUMENTS}),
    }
)
# A streamed piece of a call: the first has its id, type and name (and empty arguments),
# the next ones more of its arguments.
TOOL_CALL_PIECE = obj(
    {
        "index": COUNT,
        "id": STR,
        "type": const("function"),
        "function": obj({"name": FUNCTION_NAME, "arguments": STR}),
    },
    ("index", "function"),
)


def completion(prefix: str, obj_name: str, choice: dict[str, Schema], chunk: bool) -> Schema:
    """A chat or text completion (``chunk``: one server-sent event of a stream)."""
    props = {
        "id": text(f"^{prefix}-"),
        "object": const(obj_name),
        "created": UNIX,
        "model": STR,
        "choices": arr(every(choice)),
        "usage": null(ref("Usage")) if chunk else ref("Usage"),
    }
    if not chunk:
        return every(props)
    props["usage"]["description"] = (
        "Only with `stream_options.include_usage`: null on every chunk but the last, which "
        "has no choices."
    )
    return obj(props, ("id", "object", "created", "model", "choices"))


API_KEY = {
    "object": const("api_key"),
    "id": integer(1),
    "prefix": text("^hp_[A-Za-z0-9]{8}$"),
    "name": null(STR),
    "tenant": null(STR),
    "scopes": arr(strings(*SCOPES)),
    "created_at": null(UNIX),
    "last_used_at": null(UNIX),
    "revoked_at": null(UNIX),
}

# --- components: what answers are made of -------------------------------------------------

COMPONENTS: dict[str, Schema] = {
    "ErrorObject": every({"message": STR, "type": STR, "param": null(STR), "code": null(STR)}),
    "ErrorResponse": every({"error": ref("ErrorObject")}),
    "StreamError": obj({"error": ref("ErrorObject"), "usage": NULL}, ("error",)),
    "Usage": every(
        {
            "prompt_tokens": COUNT,
            "completion_tokens": COUNT,
            "total_tokens": COUNT,
            "prompt_tokens_details": every({"cached_tokens": COUNT}),
        }
    ),
    "ChatMessage": obj(
        {
            "role": strings(*schemas.ROLES),
            "content": {
                "anyOf": [
                    STR,
                    arr(obj({"type": const("text"), "text": STR}, ("type", "text"), False)),
                    NULL,
                ],
                "description": "Required, but for an assistant's `tool_calls` turn.",
            },
            "name": {**STR, "description": "Accepted for OpenAI compatibility; not used."},
            "tool_calls": {
                **null(arr(TOOL_CALL, maxItems=tools.MAX_TOOLS)),
                "description": "An assistant's calls; its `content` may then be null.",
            },
            "tool_call_id": {
                **text(minLength=1, maxLength=tools.MAX_CALL_ID),
                "description": "A `tool` message's (required there): the call it answers.",
            },
        },
        ("role",),
    ),
    "Tool": every(
        {
            "type": const("function"),
            "function": obj(
                {
                    "name": FUNCTION_NAME,
                    "description": null(STR),
                    "parameters": null(
                        {
                            **obj({"type": const("object")}, closed=False),
                            "description": "A JSON Schema of the arguments (an object).",
                        }
                    ),
                    "strict": null(BOOL),
                },
                ("name",),
            ),
        }
    ),
    "ResponseFormat": {
        "anyOf": [
            every({"type": const("text")}),
            every({"type": const("json_object")}),
            every(
                {
                    "type": const("json_schema"),
                    "json_schema": obj(
                        {
                            "name": text("^[A-Za-z0-9_-]{1,64}$"),
                            "schema": {
                                "type": ["object", "boolean"],
                                "description": "A JSON Schema (draft 2020-12); none: any JSON.",
                            },
                            "strict": null(BOOL),
                            "description": STR,
                        },
                        ("name",),
                    ),
                }
            ),
        ]
    },
    "Stop": null(
        {
            "anyOf": [
                text(minLength=1),
                arr(text(minLength=1), maxItems=schemas.MAX_STOP),
            ]
        }
    ),
    "TokenLogprob": every(TOKEN_LOGPROB),
    "ChatLogprobs": every(
        {"content": arr(every({**TOKEN_LOGPROB, "top_logprobs": arr(ref("TokenLogprob"))}))}
    ),
    "CompletionLogprobs": every(
        {
            "tokens": arr(STR),
            "token_logprobs": arr(NUM),
            "top_logprobs": arr({"type": "object", "additionalProperties": NUM}),
            "text_offset": arr(COUNT),
        }
    ),
    "ChatCompletion": completion(
        "chatcmpl",
        "chat.completion",
        {
            "index": COUNT,
            "message": obj(
                {
                    "role": const("assistant"),
                    "content": null(STR),
                    "tool_calls": arr(TOOL_CALL),
                },
                ("role", "content"),
            ),
            "logprobs": null(ref("ChatLogprobs")),
            "finish_reason": CHAT_FINISH,
        },
        chunk=False,
    ),
    "ChatCompletionChunk": completion(
        "chatcmpl",
        "chat.completion.chunk",
        {
            "index": COUNT,
            "delta": obj(
                {
                    "role": const("assistant"),
                    "content": null(STR),
                    "tool_calls": arr(TOOL_CALL_PIECE),
                }
            ),
            "logprobs": null(ref("ChatLogprobs")),
            "finish_reason": null(CHAT_FINISH),
        },
        chunk=True,
    ),
    "TextCompletion": completion(
        "cmpl",
        "text_completion",
        {
            "index": COUNT,
            "text": STR,
            "logprobs": null(ref("CompletionLogprobs")),
            "finish_reason": FINISH,
        },
        chunk=False,
    ),
    "TextCompletionChunk": completion(
        "cmpl",
        "text_completion",
        {
            "index": COUNT,
            "text": STR,
            "logprobs": null(ref("CompletionLogprobs")),
            "finish_reason": null(FINISH),
        },
        chunk=True,
    ),
    "Model": every(
        {
            "id": STR,
            "object": const("model"),
            "created": UNIX,
            "owned_by": const("hotpool"),
            "answers": ANSWERS,
        }
    ),
    "ModelList": every({"object": const("list"), "data": arr(ref("Model"))}),
    "NativeLogprob": every(
        {
            "token_id": COUNT,
            **TOKEN_LOGPROB,
            "top_logprobs": arr(every({"token_id": COUNT, **TOKEN_LOGPROB})),
        }
    ),
    "Invocation": every(
        {
            "object": const("invocation"),
            "id": STR,
            "deployment": STR,
            "outputs": arr(
                obj(
                    {
                        "index": COUNT,
                        "text": STR,
                        "token_ids": arr(COUNT),
                        "finish_reason": strings("stop", "length", "abort"),
                        "logprobs": {
                            **arr(ref("NativeLogprob")),
                            "description": "Only when `params.logprobs` is set.",
                        },
                    },
                    ("index", "text", "token_ids", "finish_reason"),
                )
            ),
            "usage": ref("Usage"),
        }
    ),
    "InvocationLine": {
        "description": "One line of a streamed invocation: a delta, then the summary; or an "
        "error, which ends the stream.",
        "anyOf": [
            obj(
                {
                    "index": COUNT,
                    "text": STR,
                    "token_ids": arr(COUNT),
                    "logprobs": arr(ref("NativeLogprob")),
                },
                ("index", "text", "token_ids"),
            ),
            every(
                {
                    "usage": ref("Usage"),
                    "finish_reasons": arr(null(strings("stop", "length", "abort"))),
                }
            ),
            ref("ErrorResponse"),
        ],
    },
    "Replica": every(
        {
            "id": STR,
            "state": strings(*(s.value for s in ReplicaState)),
            "worker_id": STR,
            "pid": null(integer()),
            "inflight": COUNT,
            "created_at": UNIX,
            "cold_start_seconds": null(NUM),
            "cold_start_phases": PHASES,
            "snapshot_cache_hit": null(BOOL),
            "weights_tier": null(strings("remote", "disk", "host")),
            "generation": integer(1),
            "version": {**integer(1), "description": "The deployment version it runs."},
        }
    ),
    "Deployment": every(
        {
            "object": const("deployment"),
            "name": STR,
            "snapshot_uri": STR,
            "generation": integer(1),
            "version": {**integer(1), "description": "The stable version (= `generation`)."},
            "previous_version": {
                **null(integer(1)),
                "description": "The stable version before the last change: what a rollback "
                "without a canary returns to.",
            },
            "canary": {
                **null(every({"version": integer(1), "percent": number(0, 100)})),
                "description": "The version taking `percent` percent of the requests.",
            },
            "scaling": every(
                {
                    "min_replicas": COUNT,
                    "max_replicas": integer(1),
                    "target_concurrency": integer(1),
                    "idle_timeout_s": NUM,
                    "max_queue": integer(1),
                    "queue_timeout_s": NUM,
                }
            ),
            "engine": every(
                {
                    "dtype": null(strings(*dep.DTYPES)),
                    "quantization": strings(*QUANTIZATIONS),
                    "speculative": SPECULATIVE_OUT,
                    "max_model_len": null(integer(MIN_MAX_MODEL_LEN)),
                    "kv_cache_bytes": integer(1),
                }
            ),
            "answers": ANSWERS,
            "created_at": null(UNIX),
            "queued_requests": COUNT,
            "replicas": arr(ref("Replica")),
            "last_cold_start": null(every({"seconds": NUM, "phases": PHASES})),
        }
    ),
    "DeploymentList": every({"object": const("list"), "data": arr(ref("Deployment"))}),
    "DeploymentVersion": every(
        {
            "object": const("deployment.version"),
            "version": integer(1),
            "role": {
                **null(strings("stable", "canary", "previous")),
                "description": "Its part now.",
            },
            "traffic_percent": {**null(number(0, 100)), "description": "Its share of requests."},
            "snapshot_uri": STR,
            "engine": every(
                {
                    "dtype": null(strings(*dep.DTYPES)),
                    "quantization": strings(*QUANTIZATIONS),
                    "speculative": SPECULATIVE_OUT,
                    "max_model_len": null(integer(1)),
                    "kv_cache_bytes": null(integer(1)),
                }
            ),
            "created_at": null(UNIX),
            "created_by": {**null(STR), "description": "The key prefix, or `local`."},
            "changes": {
                **null({"type": "object", "additionalProperties": arr({}, minItems=2, maxItems=2)}),
                "description": "What it changed from the stable version it was made from: "
                "`{field: [old, new]}`.",
            },
        }
    ),
    "DeploymentVersionList": every(
        {"object": const("list"), "data": arr(ref("DeploymentVersion"))}
    ),
    "DeletedDeployment": every({"id": STR, "object": const("deployment"), "deleted": const(True)}),
    "ScaleEvent": every(
        {
            "object": const("scale_event"),
            "id": integer(1),
            "deployment": STR,
            "from_replicas": COUNT,
            "to_replicas": COUNT,
            "reason": STR,
            "cold_start_seconds": null(NUM),
            "phases": PHASES,
            "error": null(STR),
            "created_at": null(UNIX),
        }
    ),
    "CapacityPoint": every({"step_tokens": integer(1), "tokens_per_second": NUM}),
    "ReplicaCapacity": every(
        {
            "id": STR,
            "version": integer(1),
            "device": {
                **null(STR),
                "description": "What its worker runs on, as it registered: `cuda` or `cpu`.",
            },
            "curve": arr(ref("CapacityPoint")),
            "inflight": COUNT,
            "queued_prompt_tokens": integer(),
            "queued_output_tokens": integer(),
            "backlog_seconds": null(NUM),
            "kv_cache_usage": null(NUM),
        }
    ),
    "DeploymentCapacity": every(
        {
            "deployment": STR,
            "replicas": arr(ref("ReplicaCapacity")),
            "curve": arr(ref("CapacityPoint")),
            "measured_replicas": COUNT,
            "output_tokens_mean": null(NUM),
            "scale_backlog_s": NUM,
            "target_concurrency": integer(1),
        }
    ),
    "ScaleEventList": every(
        {
            "object": const("list"),
            "data": arr(ref("ScaleEvent")),
            "has_more": BOOL,
            "next_before": null(integer(1)),
        }
    ),
    "UsageResult": every(
        {
            "object": const("organization.usage.completions.result"),
            "input_tokens": COUNT,
            "input_cached_tokens": COUNT,
            "output_tokens": COUNT,
            "num_model_requests": COUNT,
            "model": {**null(STR), "description": "The deployment, when grouped by it."},
            "project_id": NULL,
            "user_id": NULL,
            "api_key_id": {**null(STR), "description": "The key's prefix, grouped by key."},
            "batch": NULL,
            "cost": {
                **null(every({"value": text(r"^-?[0-9]+\.[0-9]{6}$"), "currency": STR})),
                "description": "null when none of the requests had a price in force.",
            },
            "cost_micros": null(integer()),
            "version": {**null(integer(1)), "description": "The serving version, grouped by it."},
        }
    ),
    "UsageBucket": every(
        {
            "object": const("bucket"),
            "start_time": UNIX,
            "end_time": UNIX,
            "results": arr(ref("UsageResult")),
        }
    ),
    "Principal": every(
        {
            "object": const("principal"),
            "auth": strings("keys", "off"),
            "tenant": every({"id": integer(1), "name": null(STR)}),
            "key": null(every({"prefix": STR, "name": null(STR), "scopes": arr(strings(*SCOPES))})),
            "admin": BOOL,
            "operator": BOOL,
        }
    ),
    "Percentiles": every({"p50": null(NUM), "p95": null(NUM)}),
    "UsageSummary": every(
        {
            "object": const("usage.summary"),
            "start_time": UNIX,
            "end_time": UNIX,
            "tenant": {**null(STR), "description": "The tenant asked for; null: every tenant."},
            "requests": ref("RequestsByStatus"),
            "deployments": arr(
                every(
                    {
                        "name": STR,
                        "tenant": null(STR),
                        "live": {**BOOL, "description": "false: deleted, only in the ledger."},
                        "min_replicas": null(COUNT),
                        "max_replicas": null(COUNT),
                        "replicas": every({s.value: COUNT for s in ReplicaState}),
                        "requests": ref("RequestsByStatus"),
                        "ttft_seconds": ref("Percentiles"),
                        "total_seconds": ref("Percentiles"),
                        "last_request_at": null(UNIX),
                        "quantization": {
                            **null(strings(*QUANTIZATIONS)),
                            "description": "How live replicas hold weights; null once deleted.",
                        },
                        "speculation": {
                            **null(
                                every(
                                    {
                                        "method": strings(*SPEC_METHODS),
                                        "num_tokens": integer(1),
                                        "proposed": COUNT,
                                        "accepted": COUNT,
                                        "acceptance_rate": null(number(0, 1)),
                                        "replicas": COUNT,
                                        "enabled_replicas": COUNT,
                                    }
                                )
                            ),
                            "description": "Speculative decoding on the ready replicas, as "
                            "their workers last reported (tokens since each replica loaded; "
                            "`enabled_replicas`: those whose automatic switch has it on now); "
                            "null without speculation.",
                        },
                        "version": {**null(integer(1)), "description": "The stable version."},
                        "canary": null(every({"version": integer(1), "percent": number(0, 100)})),
                        "versions": {
                            **null(arr(ref("VersionSummary"))),
                            "description": "While a canary runs: the stable and the canary "
                            "version side by side, then others that served in the range.",
                        },
                    }
                )
            ),
            "scale_events": arr(ref("ScaleEvent")),
            "scale_events_truncated": BOOL,
        }
    ),
    "RequestsByStatus": every({s: COUNT for s in STATUSES}),
    "VersionSummary": every(
        {
            "version": integer(1),
            "role": null(strings("stable", "canary")),
            "traffic_percent": number(0, 100),
            "replicas": COUNT,
            "requests": ref("RequestsByStatus"),
            "input_tokens": integer(),
            "input_cached_tokens": integer(),
            "output_tokens": integer(),
            "ttft_seconds": ref("Percentiles"),
            "total_seconds": ref("Percentiles"),
        }
    ),
    "UsagePage": every(
        {
            "object": const("page"),
            "data": arr(ref("UsageBucket")),
            "has_more": BOOL,
            "next_page": null(text("^[0-9]+$")),
        }
    ),
    "Price": every(
        {
            "object": const("price"),
            "id": integer(1),
            "deployment": null(STR),
            "currency": text("^[A-Z]{3}$"),
            **{name: integer(0, MAX_PRICE_MICROS) for name in AMOUNTS},
            "effective_from": UNIX,
            "created_at": null(UNIX),
        }
    ),
    "PriceList": every({"object": const("list"), "data": arr(ref("Price"))}),
    "Tenant": every(
        {"object": const("tenant"), "id": integer(1), "name": STR, "created_at": null(UNIX)}
    ),
    "TenantList": every({"object": const("list"), "data": arr(ref("Tenant"))}),
    "ApiKey": every(API_KEY),
    "CreatedApiKey": every(
        {
            **API_KEY,
            "key": text("^hp_[A-Za-z0-9]{40}$", description="The key: shown in this answer only."),
        }
    ),
    "ApiKeyList": every({"object": const("list"), "data": arr(ref("ApiKey"))}),
    "Health": every({"status": const("ok")}),
    "Readiness": every(
        {
            "status": strings("ready", "not_ready"),
            "checks": {
                "type": "object",
                "required": ["database", "ledger_writer"],
                "additionalProperties": STR,
                "description": '"ok", or why not.',
            },
        }
    ),
}

# --- request bodies: what each parser accepts ---------------------------------------------

NUL_INT_1 = null(integer(1))
SAMPLING: dict[str, Schema] = {
    "max_tokens": {
        **NUL_INT_1,
        "description": "Default: the deployment's `default_max_tokens`, else up to the context "
        "length. Above the deployment's `max_tokens_limit`: 400.",
    },
    "temperature": null(number(0.0, 2.0)),
    "top_p": null(number(0.0, 1.0, open_lo=True)),
    "n": null(integer(1, MAX_N)),
    "stop": ref("Stop"),
    "seed": null(integer(schemas.MIN_SEED, schemas.MAX_SEED)),
    "presence_penalty": null(number(-2.0, 2.0)),
    "frequency_penalty": null(number(-2.0, 2.0)),
    "top_k": null(integer(-1, description="-1 or 0: no top-k filter (vLLM extension)")),
    "min_p": null(number(0.0, 1.0)),
    "repetition_penalty": null(number(0.0, 10.0, open_lo=True)),
    "min_tokens": null(integer(0, description="At most `max_tokens`.")),
    "ignore_eos": null(BOOL),
}
OPENAI_COMMON: dict[str, Schema] = {
    "model": text(description="A deployment's name."),
    **SAMPLING,
    "stream": null(BOOL),
    "stream_options": {
        **null(obj({"include_usage": BOOL})),
        "description": "Only with `stream: true`.",
    },
    "user": null(text(maxLength=schemas.MAX_USER)),
    "logit_bias": unsupported(null({"type": "object", "maxProperties": 0})),
}
CHAT_REQUEST = obj(
    {
        **OPENAI_COMMON,
        "messages": arr(ref("ChatMessage"), minItems=1),
        "max_completion_tokens": {
            **NUL_INT_1,
            "description": "The newer name of `max_tokens`; given both, they must be equal.",
        },
        "logprobs": null(BOOL),
        "top_logprobs": null(integer(0, MAX_LOGPROBS, description="Needs `logprobs: true`.")),
        "tools": null(arr(ref("Tool"), maxItems=tools.MAX_TOOLS)),
        "tool_choice": {
            **null(
                {
                    "anyOf": [
                        strings(*tools.CHOICES),
                        every(
                            {
                                "type": const("function"),
                                "function": every({"name": FUNCTION_NAME}),
                            }
                        ),
                    ]
                }
            ),
            "description": "Default `auto` with tools, `none` without; `required` and a "
            "function need `tools` (naming one of them).",
        },
        "parallel_tool_calls": null(BOOL),
        "response_format": null(ref("ResponseFormat")),
    },
    ("model", "messages"),
)
COMPLETION_REQUEST = obj(
    {
        **OPENAI_COMMON,
        "prompt": {
            "anyOf": [text(minLength=1), arr(text(minLength=1), minItems=1, maxItems=1)],
            "description": "One prompt (batches and token arrays are not supported yet).",
        },
        "max_tokens": {
            **NUL_INT_1,
            "description": "Default: the deployment's `default_max_tokens`, else 16. Above its "
            "`max_tokens_limit`: 400.",
        },
        "logprobs": null(integer(0, schemas.MAX_LEGACY_LOGPROBS)),
        "echo": unsupported({"enum": [False, None]}),
        "suffix": unsupported(NULL),
        "best_of": unsupported({"enum": [1, None]}),
    },
    ("model", "prompt"),
)
INVOKE_PARAMS = {
    **SAMPLING,
    "max_tokens": {
        **NUL_INT_1,
        "description": "Default: the deployment's `default_max_tokens`, else 16 for a prompt "
        "and up to the context length for messages. Above its `max_tokens_limit`: 400.",
    },
    "logprobs": null(integer(0, MAX_LOGPROBS)),
    "response_format": null(ref("ResponseFormat")),
}
INVOKE_REQUEST: Schema = {
    **obj(
        {
            "prompt": null(text(minLength=1)),
            "messages": null(arr(ref("ChatMessage"), minItems=1)),
            "params": null(obj(INVOKE_PARAMS)),
            "stream": null(BOOL),
        }
    ),
    "description": "Exactly one of `prompt` and `messages`.",
    "oneOf": [
        {"required": ["prompt"], "properties": {"prompt": STR}},
        {"required": ["messages"], "properties": {"messages": {"type": "array"}}},
    ],
}
INT = dep.MAX_INT
DEPLOYMENT_NAME = text(dep.NAME.pattern)
DEPLOYMENT_FIELDS: dict[str, Schema] = {
    "snapshot_uri": text(
        f"^(file:///|s3://)|^({SNAPSHOT_NAME.pattern})$",
        description="file:///absolute/path (checked now: 422 if it holds no runnable "
        "snapshot), s3://bucket/prefix, or the name of a snapshot in the server's local object "
        "store (`hotpool models pull`'s and `hotpool snapshot push`'s; 400 if it is not there), "
        "stored as its file:// URI",
    ),
    "min_replicas": integer(
        0, INT, description="At most `max_replicas` and the server's `HOTPOOL_MAX_WORKERS`."
    ),
    "max_replicas": integer(1, INT),
    "target_concurrency": integer(1, INT),
    "idle_timeout_s": number(0, dep.MAX_IDLE_TIMEOUT_S, open_lo=True),
    "max_queue": null(integer(1, INT)),
    "queue_timeout_s": null(number(0, dep.MAX_QUEUE_TIMEOUT_S, open_lo=True)),
    "dtype": {"enum": [*dep.DTYPES, None], "description": "null: the snapshot's own"},
    "quantization": {
        "enum": [*QUANTIZATIONS, None],
        "description": "How replicas hold the linear weights: `none` (default, null too) in "
        "the activation dtype; `int8` per-channel weight-only int8 made at load; `gguf` the "
        "GGUF blocks the snapshot keeps as they are (400 for a local snapshot that keeps none).",
    },
    "speculative": SPECULATIVE_IN,
    "max_model_len": null(integer(MIN_MAX_MODEL_LEN, INT)),
    "kv_cache_bytes": null(integer(MIN_KV_CACHE_BYTES, MAX_KV_CACHE_BYTES)),
    "default_max_tokens": {
        **null(integer(1, INT)),
        "description": "What a request without `max_tokens` gets (null: OpenAI's defaults, 16 "
        "for a prompt and up to the context for chat). At most `max_tokens_limit`.",
    },
    "max_tokens_limit": {
        **null(integer(1, INT)),
        "description": "The most `max_tokens` a request may ask for (400 above it); null: the "
        "context length.",
    },
}
CREATE_DEPLOYMENT = obj({"name": DEPLOYMENT_NAME, **DEPLOYMENT_FIELDS}, ("name", "snapshot_uri"))
CANARY = {
    **null(obj({"version": integer(1, INT), "percent": number(0, 100)}, ("percent",))),
    "description": "`{version, percent}` sends `percent`% of requests to an existing version; "
    "`{percent}` with a new `snapshot_uri` or engine option in the same request makes them a "
    "new version taking that share (instead of rolling out to all); null ends the canary. "
    "Sticky per `user` when requests give one.",
}
UPDATE_DEPLOYMENT = {
    **obj(
        {
            "name": text(description="If given, its own name."),
            **DEPLOYMENT_FIELDS,
            "canary": CANARY,
        }
    ),
    "minProperties": 1,
    "description": "The fields to change; null resets an optional one to the server's default.",
}
CREATE_TENANT = obj(
    {"name": text(f"^[a-z0-9][a-z0-9._-]{{0,{TENANT_NAME_MAX_LEN - 1}}}$")}, ("name",)
)
CREATE_KEY = obj(
    {
        "tenant": text(
            description="The tenant's name (default: the caller's own; another tenant's "
            "needs an operator key)."
        ),
        "scopes": arr(strings(*SCOPES), minItems=1),
        "name": null(text(minLength=1, maxLength=KEY_NAME_MAX_LEN)),
    },
    ("scopes",),
)
PRICED_DEPLOYMENT = text(f"^[!-~]{{1,{DEPLOYMENT_MAX_LEN}}}$")  # printable ASCII, no spaces
CREATE_PRICE = obj(
    {
        "deployment": {**null(PRICED_DEPLOYMENT), "description": "null: the default price."},
        "currency": {**text("^[A-Z]{3}$"), "default": DEFAULT_CURRENCY},
        "effective_from": {**null(integer(0, MAX_TIMESTAMP - 1)), "description": "Default: now."},
        **{
            name: integer(0, MAX_PRICE_MICROS, description="Micro-units per million tokens.")
            for name in AMOUNTS
        },
    },
    AMOUNTS,
)

# --- operations ---------------------------------------------------------------------------

HEADERS = {
    "x-request-id": {
        "description": "The client's own well-formed `x-request-id`, echoed; else the same "
        "as `x-hotpool-request-id`.",
        "required": True,
        "schema": STR,
    },
    "x-hotpool-request-id": {
        "description": "The id hotpool minted for this request: the ledger's key.",
        "required": True,
        "schema": text("^req_[0-9a-f]{32}$"),
    },
    "x-hotpool-auth": {
        "description": "`off` on every response in local-only mode (`HOTPOOL_AUTH=none`, or `auto` "
        "on a loopback-only server).",
        "schema": const("off"),
    },
    "x-hotpool-version": {
        "description": "On invocations: the deployment version that served the request.",
        "schema": text("^[1-9][0-9]*$"),
    },
    "Retry-After": {
        "description": "Seconds to wait before retrying.",
        "required": True,
        "schema": integer(0),
    },
}
ERROR_RESPONSES = {  # status: (component name, when)
    400: ("BadRequest", "The request is malformed or a parameter is invalid (`param` names it)."),
    401: ("Unauthorized", "No API key, or an unknown or revoked one."),
    403: ("Forbidden", "The API key lacks the scope this operation needs."),
    404: ("NotFound", "Not found (another tenant's objects do not exist for you)."),
    409: ("Conflict", "It exists already, or conflicts with what does."),
    413: ("TooLarge", f"The request body is larger than {MAX_BODY_BYTES} bytes."),
    422: ("BadSnapshot", "The snapshot is missing, unreadable or of a model type not run."),
    429: (
        "TooManyRequests",
        "The deployment already has `max_queue` requests waiting for a replica (`queue_full`), "
        "or runs its `max_replicas` with more prompt tokens queued than they prefill in "
        "`queue_timeout_s` at their measured rate (`overloaded`); retry after `Retry-After` "
        "seconds.",
    ),
    502: ("BadGateway", "The replica serving the request failed before the answer started."),
    503: (
        "Unavailable",
        "No replica became ready in time, or its cold start failed; retry after `Retry-After` "
        "seconds.",
    ),
}


def answer(why: str, content: dict[str, Schema], retry: bool = False) -> Schema:
    headers = {n: {"$ref": f"#/components/headers/{n}"} for n in HEADERS if n != "Retry-After"}
    if retry:
        headers["Retry-After"] = {"$ref": "#/components/headers/Retry-After"}
    return {
        "description": why,
        "headers": headers,
        "content": {media: {"schema": schema} for media, schema in content.items()},
    }


def ok(why: str, schema: str, status: str = "200") -> dict[str, Schema]:
    return {status: answer(why, {JSON: ref(schema)})}


def op(
    summary: str,
    scope: str | None,
    responses: dict[str, Schema],
    errors: tuple[int, ...] = (),
    body: Schema | None = None,
    params: tuple[Schema, ...] = (),
    description: str | None = None,
) -> Schema:
    """One operation; ``scope``: what its API key needs (None: no key)."""
    codes = set(errors) | ({401, 403} if scope else set()) | ({400, 413} if body else set())
    out: Schema = {
        "summary": summary,
        "operationId": "".join(w.capitalize() if i else w for i, w in enumerate(summary.split())),
        "tags": [TAGS[scope]],
        "security": [{"bearerAuth": [scope]}] if scope else [],
        "parameters": [{"$ref": "#/components/parameters/RequestId"}, *params],
        "responses": {
            **responses,
            **{
                str(c): {"$ref": f"#/components/responses/{ERROR_RESPONSES[c][0]}"}
                for c in sorted(codes)
            },
        },
    }
    if description:
        out["description"] = description
    if body is not None:
        out["requestBody"] = {"required": True, "content": {JSON: {"schema": body}}}
    return out


TAGS = {"invoke": "invocations", "deploy": "deployments", "usage": "usage", "admin": "admin",
        "operator": "admin", None: "operations"}  # fmt: skip


def param(where: str, name: str, schema: Schema, why: str) -> Schema:
    return {"name": name, "in": where, "required": where == "path", "schema": schema,
            "description": why}  # fmt: skip


def sse(chunk: str) -> Schema:
    """One server-sent event (OpenAPI 3.1 has a stream's ``schema`` describe each event)."""
    data = {"type": "string", "contentMediaType": JSON,
            "contentSchema": {"anyOf": [ref(chunk), ref("StreamError")]}}  # fmt: skip
    return {
        "type": "object",
        "required": ["data"],
        "properties": {"event": const("message"), "data": {"anyOf": [const("[DONE]"), data]}},
        "description": f"Each event's `data` is a JSON `{chunk}` (or a `StreamError`, which "
        "ends the stream); the last is `[DONE]`.",
    }


SESSION = param(
    "header",
    SESSION_HEADER,
    text(minLength=1, maxLength=MAX_SESSION_CHARS),
    "A conversation's id: before its prefix is cached anywhere, its turns go to one replica "
    "(where the next turn then finds the earlier ones cached); `user` does the same without it.",
)


def invocation(summary: str, answers: str, json: str, stream: Schema, **kw: Any) -> Schema:
    return op(
        summary,
        "invoke",
        {"200": answer(answers, {JSON: ref(json), **stream})},
        (400, 404, 429, 502, 503),
        description="Errors found before the first token are JSON error answers; with "
        "`stream: true`, later ones arrive in the stream.",
        params=(*kw.pop("params", ()), SESSION),
        **kw,
    )


NAME = param("path", "name", DEPLOYMENT_NAME, "The deployment's name.")
TIME = integer(0, MAX_TIMESTAMP - 1)
GROUP_BY = arr(strings(*GROUPS))
GROUPING = "Split each bucket by deployment (`model`, `deployment`), `api_key` and/or the " + (
    "serving deployment `version`: repeated or comma-separated."
)
MODELS = arr(text("^[ -~]+$"))
TENANT = param(
    "query",
    "tenant",
    text(maxLength=TENANT_NAME_MAX_LEN),
    "Only this tenant's usage: any tenant for an operator key, else the key's own (404 otherwise).",
)

PATHS: dict[str, dict[str, Schema]] = {
    "/v1/chat/completions": {
        "post": invocation(
            "create chat completion",
            "A chat completion, or its chunks as server-sent events (`stream: true`).",
            "ChatCompletion",
            {"text/event-stream": sse("ChatCompletionChunk")},
            body=CHAT_REQUEST,
        )
    },
    "/v1/completions": {
        "post": invocation(
            "create completion",
            "A text completion, or its chunks as server-sent events (`stream: true`).",
            "TextCompletion",
            {"text/event-stream": sse("TextCompletionChunk")},
            body=COMPLETION_REQUEST,
        )
    },
    "/v1/models": {"get": op("list models", "invoke", ok("Your deployments.", "ModelList"))},
    "/v1/models/{model}": {
        "get": op(
            "retrieve model",
            "invoke",
            ok("The model.", "Model"),
            (404,),
            params=(param("path", "model", STR, "A deployment's name."),),
        )
    },
    "/v1/deployments": {
        "get": op("list deployments", "deploy", ok("Your deployments.", "DeploymentList")),
        "post": op(
            "create deployment",
            "deploy",
            ok("The deployment, scaled to zero until its first request.", "Deployment", "201"),
            (409, 422),
            CREATE_DEPLOYMENT,
        ),
    },
    "/v1/deployments/{name}": {
        "get": op("retrieve deployment", "deploy", ok("It.", "Deployment"), (404,), params=(NAME,)),
        "patch": op(
            "update deployment",
            "deploy",
            ok("The updated deployment.", "Deployment"),
            (404, 409, 422),
            UPDATE_DEPLOYMENT,
            (NAME,),
            "Changing what replicas run (snapshot, dtype, quantization, speculation, context "
            "length, KV budget) makes a new version. Without `canary` it is rolled out: old "
            "replicas drain once a new one is ready. With `canary` it takes a share of the "
            "requests beside the stable one.",
        ),
        "delete": op(
            "delete deployment",
            "deploy",
            ok("Deleted; its replicas drain, its usage stays.", "DeletedDeployment"),
            (404,),
            params=(NAME,),
        ),
    },
    "/v1/deployments/{name}/events": {
        "get": op(
            "list scale events",
            "deploy",
            ok("Scale events, newest first.", "ScaleEventList"),
            (400, 404),
            params=(
                NAME,
                param("query", "limit", integer(1, MAX_EVENTS_PAGE, default=100), "Page size."),
                param("query", "before", integer(1, MAX_EVENT_ID), "A page's `next_before`."),
            ),
        )
    },
    "/v1/deployments/{name}/capacity": {
        "get": op(
            "get deployment capacity",
            "deploy",
            ok(
                "Each ready replica's measured tokens/s by step size (from its engine's own "
                "steps), the backlog it holds, and the mean replica's curve: what `hotpool "
                "plan` sizes a deployment with.",
                "DeploymentCapacity",
            ),
            (404,),
            params=(NAME,),
        )
    },
    "/v1/deployments/{name}/versions": {
        "get": op(
            "list versions",
            "deploy",
            ok(
                "Every version, oldest first, with its role and share of traffic.",
                "DeploymentVersionList",
            ),
            (404,),
            params=(NAME,),
        )
    },
    "/v1/deployments/{name}/promote": {
        "post": op(
            "promote canary",
            "deploy",
            ok(
                "The deployment: the canary is its stable version; the old one drains.",
                "Deployment",
            ),
            (404, 409),
            params=(NAME,),
        )
    },
    "/v1/deployments/{name}/rollback": {
        "post": op(
            "roll back",
            "deploy",
            ok(
                "The deployment: all traffic on the previous stable version (during a canary, "
                "the stable one). In-flight requests finish where they started.",
                "Deployment",
            ),
            (404, 409),
            params=(NAME,),
        )
    },
    "/v1/deployments/{name}/invoke": {
        "post": invocation(
            "invoke deployment",
            "The outputs, or newline-delimited JSON lines (`stream: true`).",
            "Invocation",
            {
                "application/x-ndjson": {
                    **arr(ref("InvocationLine")),
                    "description": "The stream's lines, in order, one JSON value each.",
                }
            },
            body=INVOKE_REQUEST,
            params=(NAME,),
        )
    },
    "/v1/usage": {
        "get": op(
            "get usage",
            "usage",
            ok(
                "Tokens and cost per time bucket, shaped like OpenAI's organization usage API; "
                "an operator key sees every tenant's.",
                "UsagePage",
            ),
            (400, 404),
            params=(
                param("query", "start_time", TIME, "Unix seconds, inclusive."),
                param("query", "end_time", TIME, "Unix seconds, exclusive."),
                param(
                    "query",
                    "bucket_width",
                    {**strings(*BUCKET_WIDTHS), "default": "1d"},
                    "Bucket size.",
                ),
                param(
                    "query",
                    "limit",
                    integer(1, max(MAX_LIMIT.values())),
                    f"Buckets per page, at most {MAX_LIMIT} by width.",
                ),
                param("query", "page", TIME, "A previous page's `next_page`."),
                param("query", "group_by", GROUP_BY, GROUPING),
                param(
                    "query", "group_by[]", GROUP_BY, "`group_by`, as the openai client sends it."
                ),
                param("query", "models", MODELS, "Only these deployments."),
                param("query", "models[]", MODELS, "`models`, as the openai client sends it."),
                TENANT,
            ),
        )
    },
    "/v1/usage/summary": {
        "get": op(
            "get usage summary",
            "usage",
            ok(
                "Requests by status, latency percentiles (nearest rank) and live replicas per "
                "deployment, and the scale events, over [start_time, end_time).",
                "UsageSummary",
            ),
            (400, 404),
            params=(
                param("query", "start_time", TIME, "Unix seconds, inclusive; default 24 h back."),
                param("query", "end_time", TIME, "Unix seconds, exclusive; default now."),
                TENANT,
            ),
        )
    },
    "/v1/me": {
        "get": {
            **op(
                "get me",
                None,
                ok("The key's tenant and scopes (any valid key may ask).", "Principal"),
                (401,),
            ),
            "tags": ["usage"],
            "security": [{"bearerAuth": []}],  # a key, of any scope
        }
    },
    "/v1/prices": {
        "get": op(
            "list prices",
            "admin",
            ok("Prices, by deployment and time.", "PriceList"),
            (400,),
            params=(param("query", "deployment", PRICED_DEPLOYMENT, "Only its prices."),),
        ),
        "post": op(
            "set price",
            "admin",
            ok("The price, in force from `effective_from`.", "Price", "201"),
            (409,),
            CREATE_PRICE,
            description="Amounts are integer micro-units of the currency per million tokens "
            "(150000 is 0.15 per 1M tokens).",
        ),
    },
    "/v1/tenants": {
        "get": op("list tenants", "operator", ok("Every tenant.", "TenantList")),
        "post": op(
            "create tenant", "operator", ok("The tenant.", "Tenant", "201"), (409,), CREATE_TENANT
        ),
    },
    "/v1/keys": {
        "get": op(
            "list keys",
            "admin",
            ok(
                "The tenant's keys (an operator's: every key), revoked too, newest first.",
                "ApiKeyList",
            ),
        ),
        "post": op(
            "create key",
            "admin",
            ok("The key, shown this once.", "CreatedApiKey", "201"),
            (404,),
            CREATE_KEY,
        ),
    },
    "/v1/keys/{prefix}": {
        "delete": op(
            "revoke key",
            "admin",
            ok("The revoked key (revoking twice changes nothing).", "ApiKey"),
            (404,),
            params=(param("path", "prefix", STR, "The key's prefix (`hp_` + 8) or the key."),),
        )
    },
    "/healthz": {"get": op("liveness", None, ok("The process answers.", "Health"))},
    "/readyz": {
        "get": op(
            "readiness",
            None,
            {
                **ok("The database answers and the ledger writer runs.", "Readiness"),
                **ok("Not ready: `checks` says why.", "Readiness", "503"),
            },
        )
    },
    "/metrics": {
        "get": op("metrics", None, {"200": answer("Prometheus text format.", {"text/plain": STR})})
    },
}

DESCRIPTION = """\
hotpool's public API: OpenAI-compatible completions, deployments, a native invoke API, usage,
prices and administration. Errors have OpenAI's shape, `{"error": {"message", "type",
"param", "code"}}`, and every response carries `x-request-id` and `x-hotpool-request-id`.

Send an API key as `Authorization: Bearer hp_...` (`hotpool keys create` makes one). Each
operation names the scope its key needs: `deploy`, `invoke`, `usage`, `admin` (which has
them all, in its own tenant) or `operator` (every scope in every tenant: tenants, every
tenant's keys and usage). In local-only mode (`HOTPOOL_AUTH=none`, or the default
`HOTPOOL_AUTH=auto` on a server that listens on loopback only) no key is needed: every
caller is the default tenant with every scope, and every response carries
`x-hotpool-auth: off`.
"""

DOCUMENT: dict[str, Any] = {
    "openapi": "3.1.0",
    "info": {
        "title": "hotpool",
        "version": __version__,
        "description": DESCRIPTION,
        "license": {"name": "Apache-2.0", "identifier": "Apache-2.0"},
    },
    "tags": [{"name": tag} for tag in dict.fromkeys(TAGS.values())],  # operator: admin too
    "security": [{"bearerAuth": []}],
    "paths": PATHS,
    "components": {
        "schemas": COMPONENTS,
        "responses": {
            name: answer(why, {JSON: ref("ErrorResponse")}, retry=status in (429, 503))
            for status, (name, why) in ERROR_RESPONSES.items()
        },
        "headers": HEADERS,
        "parameters": {
            "RequestId": {
                **param("header", "x-request-id", text(CLIENT_REQUEST_ID.pattern), ""),
                "description": "Your own id for correlation: echoed, and kept in the ledger "
                "beside hotpool's; ignored unless well-formed.",
            }
        },
        "securitySchemes": {
            "bearerAuth": {
                "type": "http",
                "scheme": "bearer",
                "bearerFormat": "hp_...",
                "description": "An API key; none is needed in local-only mode.",
            }
        },
    },
}
_BODY = JSONResponse(DOCUMENT).body  # rendered once


async def openapi_json(_: Request) -> Response:
    """The document; no key needed (it describes the API, nobody's data)."""
    return Response(_BODY, media_type=JSON)
