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

from minigpt.infer.sampling import MAX_LOGPROBS, MAX_REPETITION_PENALTY, MIN_REPETITION_PENALTY
from minigpt.serve.schemas import MAX_LOGIT_BIAS, MAX_N, MAX_STOP_CHARS, MAX_STOP_STRINGS


def _nullable(schema: dict) -> dict:
    return {"anyOf": [schema, {"type": "null"}]}


def _ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def _logprob_fields(chat: bool) -> dict[str, Any]:
    """``logprobs`` / ``top_logprobs`` (and completions' ``echo``): their meaning differs between the endpoints."""
    top = {"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS}
    if chat:
        return {"logprobs": _nullable({"type": "boolean", "description": "log-probabilities of the generated "
                                       "tokens (the model's own, before penalties and temperature)"}),
                "top_logprobs": _nullable({**top, "description": "alternatives per token; needs logprobs: true"}),
                "echo": _nullable({"const": False})}
    return {"logprobs": _nullable({**top, "description": "log-probabilities of the tokens with this many "
                                   "alternatives (the model's own, before penalties and temperature)"}),
            "echo": _nullable({"type": "boolean", "description": "the answer starts with the prompt (with "
                               "logprobs: the prompt's too, the first token's null); max_tokens 0 only scores"}),
            "top_logprobs": _nullable({"const": 0})}


def _sampling_fields(context: int, chat: bool = False) -> dict[str, Any]:
    """Fields both generating endpoints take (:data:`~minigpt.serve.schemas.COMMON_FIELDS` and the neutral ones)."""
    stop = {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS}
    penalty = {"type": "number", "minimum": -2, "maximum": 2}
    return {
        "model": _nullable({"type": "string", "description": "the served model's id (GET /v1/models)"}),
        "max_tokens": _nullable({"type": "integer", "minimum": 0 if not chat else 1, "maximum": max(1, context - 1),
                                 **({} if chat else {"description": "0 only with echo: true"})}),
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
        "n": _nullable({"type": "integer", "minimum": 1, "maximum": MAX_N,
                        "description": "choices; choice i samples with seed + i"}),
        **_logprob_fields(chat),
        "presence_penalty": _nullable({**penalty, "description": "logit -= presence_penalty if the token was "
                                       "generated (OpenAI)"}),
        "frequency_penalty": _nullable({**penalty, "description": "logit -= frequency_penalty * times the token "
                                        "was generated (OpenAI)"}),
        "repetition_penalty": _nullable({"type": "number", "minimum": MIN_REPETITION_PENALTY,
                                         "maximum": MAX_REPETITION_PENALTY, "description": "an extension "
                                         "(vLLM, CTRL): logits of tokens in the prompt or output divided by it "
                                         "when positive, multiplied when negative; 1: off"}),
        "logit_bias": _nullable({"type": "object", "maxProperties": MAX_LOGIT_BIAS,
                                 "propertyNames": {"pattern": "^[0-9]{1,12}$"},
                                 "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
                                 "description": "token id (a string) -> value added to its logit"}),
        "min_p": _nullable({"type": "number", "minimum": 0, "maximum": 1, "description": "an extension (vLLM): "
                            "drop tokens less likely than min_p times the most likely one; 0: off"}),
        "stop_token_ids": _nullable({"type": "array", "maxItems": MAX_LOGIT_BIAS,
                                     "items": {"type": "integer", "minimum": 0},
                                     "description": "an extension (vLLM): token ids that end the generation"}),
        # Accepted only with the value that asks for nothing this server does not do.
        "best_of": _nullable({"const": 1}), "suffix": _nullable({"const": ""}),
        "functions": _nullable({"type": "array", "maxItems": 0}), "function_call": _nullable({"const": "none"}),
        **_structured_fields(chat),
    }


def _structured_fields(chat: bool) -> dict[str, Any]:
    """``response_format`` and chat's tool fields (:mod:`minigpt.serve.tools`)."""
    name = {"type": "string", "pattern": "^[a-zA-Z0-9_-]{1,64}$"}
    schema = {"type": "object", "description": "a JSON schema"}
    fields = {"response_format": _nullable({"anyOf": [
        {"type": "object", "required": ["type"], "additionalProperties": False,
         "properties": {"type": {"enum": ["text", "json_object"]}}},
        {"type": "object", "required": ["type", "json_schema"], "additionalProperties": False, "properties": {
            "type": {"const": "json_schema"}, "json_schema": {
                "type": "object", "required": ["name"], "additionalProperties": False, "properties": {
                    "name": name, "schema": schema, "description": {"type": "string"},
                    "strict": _nullable({"type": "boolean"})}}}}],
        "description": "json_object / json_schema: decoding constrained by the grammar (the structured extra)"})}
    if not chat:
        return fields
    function = {"type": "object", "required": ["name"], "additionalProperties": False, "properties": {
        "name": name, "description": {"type": "string"}, "parameters": schema, "strict": _nullable({"type": "boolean"})}}
    return {**fields,
            "tools": _nullable({"type": "array", "items": {
                "type": "object", "required": ["type", "function"], "additionalProperties": False,
                "properties": {"type": {"const": "function"}, "function": function}}}),
            "tool_choice": _nullable({"anyOf": [{"enum": ["none", "auto", "required"]}, {
                "type": "object", "required": ["type", "function"], "properties": {
                    "type": {"const": "function"}, "function": {"type": "object", "required": ["name"],
                                                                "properties": {"name": name}}}}],
                "description": "needs tools; required or a named function forces a call (the structured extra)"}),
            "parallel_tool_calls": _nullable({"type": "boolean"})}


def _schemas(context: int) -> dict[str, Any]:
    token_ids = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}
    text_part = {"type": "object", "required": ["type", "text"],
                 "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}
    call = {"type": "object", "required": ["id", "type", "function"], "properties": {
        "id": {"type": "string"}, "type": {"const": "function"}, "function": {
            "type": "object", "required": ["name", "arguments"],
            "properties": {"name": {"type": "string"}, "arguments": {"type": "string"}}}}}
    content = {"anyOf": [{"type": "string"}, {"type": "array", "items": text_part}]}
    message = {"anyOf": [
        {"type": "object", "required": ["role", "content"], "additionalProperties": False, "properties": {
            "role": {"enum": ["system", "developer", "user", "assistant"]}, "content": content,
            "name": {"type": "string"}}},
        {"type": "object", "required": ["role", "tool_calls"], "additionalProperties": False, "properties": {
            "role": {"const": "assistant"}, "content": {"anyOf": [content, {"type": "null"}]},
            "name": {"type": "string"}, "tool_calls": {"type": "array", "items": call}}},
        {"type": "object", "required": ["role", "content", "tool_call_id"], "additionalProperties": False,
         "properties": {"role": {"const": "tool"}, "content": content, "tool_call_id": {"type": "string"},
                        "name": {"type": "string"}}}]}
    usage = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"], "properties": {
        k: {"type": "integer", "minimum": 0} for k in ("prompt_tokens", "completion_tokens", "total_tokens")}}
    finish = {"enum": ["stop", "length"]}
    chat_finish = {"enum": ["stop", "length", "tool_calls"]}
    index = {"type": "integer", "minimum": 0, "maximum": MAX_N - 1}
    # Logprobs (minigpt.serve.responses): completions' token-parallel lists, chat's list of token objects.
    listed = {"type": "array", "items": {"type": "string"}}
    completion_logprobs = {"type": "object", "required": ["tokens", "token_logprobs", "top_logprobs", "text_offset"],
                           "properties": {"tokens": listed,
                                          "token_logprobs": {"type": "array", "items": {"type": ["number", "null"]}},
                                          "top_logprobs": {"type": "array", "items": {"anyOf": [
                                              {"type": "object", "additionalProperties": {"type": "number"}},
                                              {"type": "null"}]}},
                                          "text_offset": {"type": "array", "items": {"type": "integer"}}}}
    token = {"token": {"type": "string"}, "logprob": {"type": "number"},
             "bytes": {"type": ["array", "null"], "items": {"type": "integer", "minimum": 0, "maximum": 255}}}
    chat_logprobs = {"type": "object", "required": ["content"], "properties": {"content": {"type": "array", "items": {
        "type": "object", "required": ["token", "logprob", "bytes", "top_logprobs"], "properties": {
            **token, "top_logprobs": {"type": "array", "items": {
                "type": "object", "required": ["token", "logprob", "bytes"], "properties": token}}}}}}}

    def logprobs(obj: str) -> dict:
        return {"anyOf": [chat_logprobs if obj.startswith("chat") else completion_logprobs, {"type": "null"}]}

    def chunk(obj: str, choice: dict) -> dict:
        """One streamed chunk: a choice, or (``stream_options.include_usage``) no choice and the usage."""
        return {"type": "object", "required": ["id", "object", "created", "model", "choices"], "properties": {
            "id": {"type": "string"}, "object": {"const": obj}, "created": {"type": "integer"},
            "model": {"type": "string"}, "usage": usage,
            "choices": {"type": "array", "maxItems": 1, "items": {
                "type": "object", "required": ["index", *choice, "logprobs", "finish_reason"],
                "properties": {"index": index, **choice, "logprobs": logprobs(obj),
                               "finish_reason": {"anyOf": [chat_finish if obj.startswith("chat") else finish,
                                                           {"type": "null"}]}}}}}}

    def answer(obj: str, choice: dict) -> dict:
        return {"type": "object", "required": ["id", "object", "created", "model", "choices", "usage"], "properties": {
            "id": {"type": "string"}, "object": {"const": obj}, "created": {"type": "integer"},
            "model": {"type": "string"}, "usage": usage,
            "choices": {"type": "array", "minItems": 1, "maxItems": MAX_N, "items": {
                "type": "object", "required": ["index", *choice, "logprobs", "finish_reason"],
                "properties": {"index": index, **choice, "logprobs": logprobs(obj),
                               "finish_reason": chat_finish if obj.startswith("chat") else finish}}}}}

    return {
        "CompletionRequest": {
            "type": "object", "required": ["prompt"], "additionalProperties": False,
            "properties": {"prompt": {"anyOf": [
                {"type": "string"}, token_ids,
                {"type": "array", "minItems": 1, "maxItems": MAX_N,
                 "items": {"anyOf": [{"type": "string"}, token_ids]}},
            ], "description": f"a string or token ids, or a list of those (prompts x n <= {MAX_N} choices; "
                              "choice k * n + j is the j-th of prompt k)"}, **_sampling_fields(context)}},
        "ChatCompletionRequest": {
            "type": "object", "required": ["messages"], "additionalProperties": False,
            "properties": {"messages": {"type": "array", "minItems": 1, "items": message},
                           "max_completion_tokens": _nullable({"type": "integer", "minimum": 1,
                                                               "maximum": max(1, context - 1)}),
                           **_sampling_fields(context, chat=True)}},
        "Completion": answer("text_completion", {"text": {"type": "string"}}),
        "ChatCompletion": answer("chat.completion", {"message": {
            "type": "object", "required": ["role", "content"],
            "properties": {"role": {"const": "assistant"}, "content": {"type": ["string", "null"]},
                           "tool_calls": {"type": "array", "items": call}}}}),
        "CompletionChunk": chunk("text_completion", {"text": {"type": "string"}}),
        "ChatCompletionChunk": chunk("chat.completion.chunk", {"delta": {
            "type": "object", "additionalProperties": False,
            "properties": {"role": {"const": "assistant"}, "content": {"type": "string"},
                           "tool_calls": {"type": "array", "items": {**call, "required": ["index", *call["required"]],
                                          "properties": {"index": {"type": "integer"}, **call["properties"]}}}}}}),
        "Model": {"type": "object", "required": ["id", "object", "created", "owned_by"],
                  "properties": {"id": {"type": "string"}, "object": {"const": "model"},
                                 "created": {"type": "integer"}, "owned_by": {"type": "string"},
                                 "parent": {"type": "string"}}},
        "ModelList": {"type": "object", "required": ["object", "data"], "properties": {
            "object": {"const": "list"}, "data": {"type": "array", "items": _ref("Model")}}},
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
    model = {"summary": "one served model, by name", "parameters": [
        {"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}], "responses": {
        "200": {"description": "the model", "content": {"application/json": {"schema": _ref("Model")}}},
        "404": {"description": "no model of that name", "content": {"application/json": {"schema": _ref("Error")}}},
        **{k: v for k, v in models["responses"].items() if k == "401"}}}
    if secured:
        model["security"] = [{"bearer": []}]
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
            "/v1/models/{model}": {"get": model},
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
