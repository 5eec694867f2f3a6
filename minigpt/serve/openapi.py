"""The OpenAPI 3.1 document of ``minigpt serve``, published at ``GET /openapi.json``: every endpoint, the request
fields it accepts (the same rules :mod:`minigpt.serve.schemas` enforces, as far as JSON Schema can say them) and
the shape of each answer, errors included.

What JSON Schema cannot say is still checked by the server and answered with a documented 400: the prompt and
``max_tokens`` against the context, token ids against the vocabulary, the total length of the stop strings.
The request and response shapes follow OpenAI's public API reference for the legacy Completions and the Chat
Completions endpoints.
"""
from __future__ import annotations

from typing import Any, Optional

from minigpt.serve.schemas import MAX_STOP_CHARS, MAX_STOP_STRINGS


def _nullable(schema: dict) -> dict:
    return {"anyOf": [schema, {"type": "null"}]}


def _ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def _sampling_fields(context: int) -> dict[str, Any]:
    """Fields both generating endpoints take (:data:`~minigpt.serve.schemas.COMMON_FIELDS` and the neutral ones)."""
    stop = {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS}
    return {
        "model": _nullable({"type": "string", "description": "the served model's id (GET /v1/models)"}),
        "max_tokens": _nullable({"type": "integer", "minimum": 1, "maximum": max(1, context - 1)}),
        "temperature": _nullable({"type": "number", "minimum": 0, "maximum": 2,
                                  "description": "0 (or below 1e-5): greedy"}),
        "top_p": _nullable({"type": "number", "exclusiveMinimum": 0, "maximum": 1}),
        "top_k": _nullable({"type": "integer", "minimum": -1, "description": "0 or -1: off (an extension)"}),
        "stop": _nullable({"anyOf": [stop, {"type": "array", "items": stop, "maxItems": MAX_STOP_STRINGS}]}),
        "seed": _nullable({"type": "integer", "minimum": -2**63, "maximum": 2**64 - 1}),
        "stream": _nullable({"type": "boolean"}),
        "stream_options": _nullable({"type": "object", "additionalProperties": False,
                                     "properties": {"include_usage": _nullable({"type": "boolean"})}}),
        "user": _nullable({"type": "string", "description": "accepted and ignored"}),
        # Accepted only with the value that asks for nothing this server does not do.
        "n": _nullable({"const": 1}), "best_of": _nullable({"const": 1}), "logprobs": _nullable({"const": False}),
        "top_logprobs": _nullable({"const": 0}), "echo": _nullable({"const": False}),
        "suffix": _nullable({"const": ""}), "presence_penalty": _nullable({"const": 0}),
        "frequency_penalty": _nullable({"const": 0}),
        "logit_bias": _nullable({"type": "object", "maxProperties": 0}),
        "tools": _nullable({"type": "array", "maxItems": 0}), "tool_choice": _nullable({"const": "none"}),
        "functions": _nullable({"type": "array", "maxItems": 0}), "function_call": _nullable({"const": "none"}),
        "response_format": _nullable({"type": "object", "required": ["type"], "additionalProperties": False,
                                      "properties": {"type": {"const": "text"}}}),
        "parallel_tool_calls": _nullable({"type": "boolean"}),
    }


def _schemas(context: int) -> dict[str, Any]:
    token_ids = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}
    text_part = {"type": "object", "required": ["type", "text"],
                 "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}
    message = {"type": "object", "required": ["role", "content"], "additionalProperties": False, "properties": {
        "role": {"enum": ["system", "developer", "user", "assistant"]},
        "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": text_part}]},
        "name": {"type": "string"}}}
    usage = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"], "properties": {
        k: {"type": "integer", "minimum": 0} for k in ("prompt_tokens", "completion_tokens", "total_tokens")}}
    finish = {"enum": ["stop", "length"]}

    def chunk(obj: str, choice: dict) -> dict:
        """One streamed chunk: a choice, or (``stream_options.include_usage``) no choice and the usage."""
        return {"type": "object", "required": ["id", "object", "created", "model", "choices"], "properties": {
            "id": {"type": "string"}, "object": {"const": obj}, "created": {"type": "integer"},
            "model": {"type": "string"}, "usage": usage,
            "choices": {"type": "array", "maxItems": 1, "items": {
                "type": "object", "required": ["index", *choice, "logprobs", "finish_reason"],
                "properties": {"index": {"const": 0}, **choice, "logprobs": {"type": "null"},
                               "finish_reason": {"anyOf": [finish, {"type": "null"}]}}}}}}

    def answer(obj: str, choice: dict) -> dict:
        return {"type": "object", "required": ["id", "object", "created", "model", "choices", "usage"], "properties": {
            "id": {"type": "string"}, "object": {"const": obj}, "created": {"type": "integer"},
            "model": {"type": "string"}, "usage": usage,
            "choices": {"type": "array", "minItems": 1, "maxItems": 1, "items": {
                "type": "object", "required": ["index", *choice, "logprobs", "finish_reason"],
                "properties": {"index": {"const": 0}, **choice, "logprobs": {"type": "null"},
                               "finish_reason": finish}}}}}

    return {
        "CompletionRequest": {
            "type": "object", "required": ["prompt"], "additionalProperties": False,
            "properties": {"prompt": {"anyOf": [
                {"type": "string"}, token_ids,
                {"type": "array", "minItems": 1, "maxItems": 1, "items": {"anyOf": [{"type": "string"}, token_ids]}},
            ], "description": "a string or token ids (a batch of one of either)"}, **_sampling_fields(context)}},
        "ChatCompletionRequest": {
            "type": "object", "required": ["messages"], "additionalProperties": False,
            "properties": {"messages": {"type": "array", "minItems": 1, "items": message},
                           "max_completion_tokens": _nullable({"type": "integer", "minimum": 1,
                                                               "maximum": max(1, context - 1)}),
                           **_sampling_fields(context)}},
        "Completion": answer("text_completion", {"text": {"type": "string"}}),
        "ChatCompletion": answer("chat.completion", {"message": {
            "type": "object", "required": ["role", "content"],
            "properties": {"role": {"const": "assistant"}, "content": {"type": "string"}}}}),
        "CompletionChunk": chunk("text_completion", {"text": {"type": "string"}}),
        "ChatCompletionChunk": chunk("chat.completion.chunk", {"delta": {
            "type": "object", "additionalProperties": False,
            "properties": {"role": {"const": "assistant"}, "content": {"type": "string"}}}}),
        "ModelList": {"type": "object", "required": ["object", "data"], "properties": {
            "object": {"const": "list"}, "data": {"type": "array", "items": {
                "type": "object", "required": ["id", "object", "created", "owned_by"],
                "properties": {"id": {"type": "string"}, "object": {"const": "model"},
                               "created": {"type": "integer"}, "owned_by": {"type": "string"}}}}}},
        "Health": {"type": "object", "required": ["status"], "properties": {"status": {"enum": ["ok", "unavailable"]}}},
        "Error": {"type": "object", "required": ["error"], "properties": {"error": {
            "type": "object", "required": ["message", "type", "param", "code"], "properties": {
                "message": {"type": "string"}, "type": {"type": "string"},
                "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}},
    }


ERRORS = {
    "400": "invalid request: malformed JSON, a wrong type or range, an unknown field, the prompt or max_tokens "
           "beyond the context",
    "401": "missing or wrong API key",
    "413": "the body is larger than --max-body-bytes",
    "415": "the body is not sent as application/json",
    "429": "the wait queue is full",
    "503": "the server is shutting down",
    "504": "the request timed out",
}


def _event(chunk: str) -> dict:
    """One Server-Sent Event (OpenAPI 3.1: the ``text/event-stream`` schema describes each event): a chunk, the
    error that ends a failed stream, or the final ``[DONE]``."""
    return {"type": "object", "required": ["data"], "properties": {"data": {"anyOf": [
        {"const": "[DONE]"},
        {"type": "string", "contentMediaType": "application/json",
         "contentSchema": {"anyOf": [_ref(chunk), _ref("Error")]}}]}}}


def _generate(summary: str, request: str, answer: str, secured: bool) -> dict:
    error = {"content": {"application/json": {"schema": _ref("Error")}}}
    op = {
        "summary": summary,
        "requestBody": {"required": True, "content": {"application/json": {"schema": _ref(request)}}},
        "responses": {
            "200": {"description": "the answer; with \"stream\": true, Server-Sent Events ending with "
                                   "'data: [DONE]'",
                    "content": {"application/json": {"schema": _ref(answer)},
                                "text/event-stream": {"schema": _event(answer + "Chunk")}}},
            **{code: {"description": text, **error} for code, text in ERRORS.items()
               if secured or code != "401"},
        },
    }
    if secured:
        op["security"] = [{"bearer": []}]
    return op


def openapi_document(model_name: str, context: int, api_key: Optional[str]) -> dict:
    """The OpenAPI 3.1 document of a server serving ``model_name`` with a ``context``-token context; ``api_key``
    set: the ``/v1`` operations declare bearer authentication."""
    secured = api_key is not None
    models = {"summary": "the served model", "responses": {
        "200": {"description": "one model", "content": {"application/json": {"schema": _ref("ModelList")}}}}}
    if secured:
        models["security"] = [{"bearer": []}]
        models["responses"]["401"] = {"description": ERRORS["401"],
                                      "content": {"application/json": {"schema": _ref("Error")}}}
    health = {"content": {"application/json": {"schema": _ref("Health")}}}
    doc = {
        "openapi": "3.1.0",
        "info": {"title": "MiniGPT", "version": "1",
                 "description": f"An OpenAI-compatible server for '{model_name}' ({context}-token context)."},
        "paths": {
            "/v1/completions": {"post": _generate("complete a prompt", "CompletionRequest", "Completion", secured)},
            "/v1/chat/completions": {"post": _generate("answer a conversation", "ChatCompletionRequest",
                                                       "ChatCompletion", secured)},
            "/v1/models": {"get": models},
            "/health": {"get": {"summary": "liveness", "responses": {
                "200": {"description": "serving", **health},
                "503": {"description": "shutting down or the model worker died", **health}}}},
            "/metrics": {"get": {"summary": "Prometheus metrics", "responses": {
                "200": {"description": "text exposition format", "content": {"text/plain": {
                    "schema": {"type": "string"}}}}}}},
            "/": {"get": {"summary": "the chat page", "responses": {
                "200": {"description": "HTML", "content": {"text/html": {"schema": {"type": "string"}}}}}}},
        },
        "components": {"schemas": _schemas(context)},
    }
    if secured:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    return doc
