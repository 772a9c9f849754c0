"""The OpenAI embeddings API, as far as this server speaks it: the request checked, the reply
built, and errors in OpenAI's shape.

    POST /v1/embeddings  {"input": "text" | ["text", ...], "model": MODEL_NAMES (or none),
                          "encoding_format": "float" | "base64", "dimensions": 384, "user": ...}
    200  {"object": "list", "model": ..., "data": [{"object": "embedding", "index": i,
          "embedding": [...] | "<base64 of little-endian float32>"}],
          "usage": {"prompt_tokens": n, "total_tokens": n}}
    4xx/5xx  {"error": {"message": ..., "type": ..., "param": ..., "code": ...}}
             (another model: 404, code "model_not_found", as OpenAI answers)

The official ``openai`` client asks for base64 unless told otherwise (and decodes it), so both
encodings are served. Token-id inputs (lists of ints) are refused: they would be ids of
OpenAI's tokenizer, not this model's. Every check here runs before anything is queued, so a bad
request costs the model nothing.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from unison.serve import MODEL_NAMES

__all__ = ["APIError", "EmbeddingRequest", "embedding_reply", "error_body", "parse_request"]


class APIError(Exception):
    """An answer other than 200, with OpenAI's error body; ``headers`` (e.g. Retry-After)
    go with it."""

    def __init__(self, status: int, message: str, *, kind: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None,
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.code = code
        self.param = param
        self.headers = dict(headers or {})

    def body(self) -> bytes:
        return error_body(self.message, self.kind, self.code, self.param)


def error_body(message: str, kind: str, code: str | None = None,
               param: str | None = None) -> bytes:
    """OpenAI's error JSON."""
    return json.dumps({"error": {"message": message, "type": kind, "param": param,
                                 "code": code}}).encode()


@dataclass(frozen=True)
class EmbeddingRequest:
    """A checked request: the texts in order, and how the reply encodes the vectors."""

    inputs: list[str]
    base64: bool


def _bad(message: str, param: str | None = None, code: str = "invalid_request") -> APIError:
    return APIError(400, message, param=param, code=code)


def parse_request(body: bytes, *, max_inputs: int, dimensions: int) -> EmbeddingRequest:
    """Check an embeddings request body; APIError (400) says what is wrong and where."""
    try:
        doc = json.loads(body)
    except RecursionError:  # [[[[...]]]] nested deeper than the parser's stack
        raise _bad("the request body is nested too deeply to be read", code="invalid_json") \
            from None
    except ValueError as exc:  # JSONDecodeError, or bytes that are not UTF-8
        raise _bad(f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(doc, dict):
        raise _bad(f"the request body must be a JSON object, not {_kind(doc)}")
    if "input" not in doc:
        raise _bad("'input' is required: a string or a list of strings", "input")
    raw = doc["input"]
    if isinstance(raw, str):
        inputs = [raw]
    elif isinstance(raw, list):
        if not raw:
            raise _bad("'input' is an empty list: give at least one string", "input")
        for i, item in enumerate(raw):
            if not isinstance(item, str):
                hint = (" (token ids are not accepted: send the text)"
                        if isinstance(item, (int, list)) else "")
                raise _bad(f"'input[{i}]' must be a string, not {_kind(item)}{hint}", "input")
        inputs = raw
    else:
        raise _bad(f"'input' must be a string or a list of strings, not {_kind(raw)}", "input")
    if len(inputs) > max_inputs:
        raise _bad(f"'input' holds {len(inputs)} strings; this server takes at most "
                   f"{max_inputs} per request (--max-inputs)", "input", "too_many_inputs")
    for i, text in enumerate(inputs):
        if not text.isascii():
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:  # a lone surrogate, e.g. "\ud800" in the JSON
                raise _bad(f"'input[{i}]' is not valid Unicode (it holds a lone surrogate)",
                           "input") from None
    model = doc.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad(f"'model' must be a string, not {_kind(model)}", "model")
    if model is not None and model not in MODEL_NAMES:
        raise APIError(404, f"The model {model!r} does not exist: this server serves "
                       f"{' or '.join(map(repr, MODEL_NAMES))}", param="model",
                       code="model_not_found")
    fmt = doc.get("encoding_format", "float")
    if fmt is None:
        fmt = "float"
    if fmt not in ("float", "base64"):
        raise _bad(f"'encoding_format' must be 'float' or 'base64', not {fmt!r}",
                   "encoding_format")
    dims = doc.get("dimensions")
    if dims is not None and (isinstance(dims, bool) or dims != dimensions):
        raise _bad(f"'dimensions' must be {dimensions} (this model's size; it cannot be "
                   f"shortened), not {dims!r}", "dimensions")
    user = doc.get("user")
    if user is not None and not isinstance(user, str):
        raise _bad(f"'user' must be a string, not {_kind(user)}", "user")
    return EmbeddingRequest(inputs, fmt == "base64")


def _kind(value: Any) -> str:
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean",
             int: "a number", float: "a number", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def embedding_reply(rows: np.ndarray, *, b64: bool, model: str, prompt_tokens: int) -> bytes:
    """The 200 body: one entry per row, in input order. Floats are the float32 values exactly
    (as doubles in JSON, or the raw little-endian float32 bytes in base64)."""
    if b64:
        le = rows.astype("<f4", copy=False)
        vectors: list[Any] = [base64.b64encode(row.tobytes()).decode("ascii") for row in le]
    else:
        vectors = rows.tolist()
    data = [{"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(vectors)]
    return json.dumps({
        "object": "list",
        "data": data,
        "model": model,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }, separators=(",", ":")).encode()
