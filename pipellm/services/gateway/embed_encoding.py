"""How pooled vectors travel back to the client: vLLM's `encoding_format`, `embed_dtype` and
`endianness` (for /v1/embeddings and /pooling).

- `float` (default): JSON numbers. `base64`: each vector's bytes in base64 (OpenAI's default:
  float32, little-endian, which `native` is on every CPU pipellm runs on).
- `bytes`: the body is every vector's bytes, one after another (application/octet-stream), and
  the `metadata` header a JSON object: `id`, `created`, `model`, `usage`, and `data`, per
  input its `index`, `embed_dtype`, `endianness`, `start` and `end` (byte offsets in the body)
  and `shape`. `bytes_only`: the same body without the header.
- `embed_dtype`: float32 (default), float16, bfloat16, fp8_e4m3, fp8_e5m2: the float32 vectors
  rounded to nearest even, as torch's casts do (ml_dtypes gives numpy those types);
  `endianness`: native (default), little, big.
"""

from __future__ import annotations

import base64
import json
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np
from aiohttp import web

from pipellm.services.gateway.errors import bad_request
from pipellm.services.gateway.validation import get_str
from pipellm.shared.messages import EmbedResult

FORMATS = ("float", "base64", "bytes", "bytes_only")
DTYPES = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16",  # its type's
          "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}  # name in numpy or ml_dtypes
ENDIANNESS = ("native", "little", "big")
KEYS = frozenset({"encoding_format", "embed_dtype", "endianness"})


@dataclass(frozen=True)
class Encoding:
    """A request's encoding of its vectors."""

    format: str = "float"
    dtype: str = "float32"
    endianness: str = "native"

    @property
    def binary(self) -> bool:
        """Whether the answer is the vectors' bytes rather than JSON."""
        return self.format in ("bytes", "bytes_only")

    def to_bytes(self, values: np.ndarray) -> bytes:
        """`values` (float32) cast to the dtype, in the byte order asked for."""
        out = values.astype(numpy_dtype(self.dtype))
        if self.endianness not in ("native", sys.byteorder):
            out = out.byteswap()
        return out.tobytes()

    def json_value(self, values: np.ndarray) -> Any:
        """`values` as a JSON answer carries them: floats, or base64 of their bytes (None for
        a bytes encoding: they go in the body)."""
        if self.binary:
            return None
        if self.format == "base64":
            return base64.b64encode(self.to_bytes(values)).decode("ascii")
        return values.tolist()


def numpy_dtype(name: str) -> type:
    """The numpy type of an `embed_dtype`: numpy's own, else ml_dtypes' (bfloat16 and fp8),
    imported on first use: a slow import that the gateway's start-up need not pay."""
    if hasattr(np, DTYPES[name]):
        return getattr(np, DTYPES[name])
    import ml_dtypes

    return getattr(ml_dtypes, DTYPES[name])


def rows_of(result: EmbedResult, per_token: bool = False) -> list[np.ndarray]:
    """Each input's float32 values of `result`: [dim], or with `per_token` [tokens, dim]."""
    flat = np.frombuffer(result.vectors, dtype=np.float32)
    out, at = [], 0
    for n in result.num_tokens:
        rows = n if per_token else 1
        values = flat[at * result.dim:(at + rows) * result.dim]
        out.append(values.reshape(rows, result.dim) if per_token else values)
        at += rows
    return out


def parse_encoding(body: dict) -> Encoding:
    """The body's encoding; a 400 on a field outside its choices."""
    fields = [get_str(body, key, default) for key, default in
              (("encoding_format", "float"), ("embed_dtype", "float32"),
               ("endianness", "native"))]
    for key, value, choices in zip(("encoding_format", "embed_dtype", "endianness"), fields,
                                   (FORMATS, tuple(DTYPES), ENDIANNESS), strict=True):
        if value not in choices:
            raise bad_request(f"{key} must be one of {', '.join(choices)}, got {value!r}"[:200],
                              key)
    return Encoding(*fields)


def binary_body(encoding: Encoding, rows: list[np.ndarray], head: dict, usage: dict
                ) -> tuple[bytes, dict[str, str]]:
    """(the body, its headers) of a bytes answer: `rows` (each input's float32 values, any
    shape) one after another; `head` the answer's id, created and model."""
    chunks, items, at = [], [], 0
    for i, values in enumerate(rows):
        chunk = encoding.to_bytes(values)
        items.append({"index": i, "embed_dtype": encoding.dtype,
                      "endianness": encoding.endianness, "start": at, "end": at + len(chunk),
                      "shape": list(values.shape)})
        chunks.append(chunk)
        at += len(chunk)
    if encoding.format == "bytes_only":
        return b"".join(chunks), {}
    return b"".join(chunks), {"metadata": json.dumps({**head, "data": items, "usage": usage})}


def respond(encoding: Encoding, rows: list[np.ndarray], answer: dict) -> web.Response:
    """The HTTP answer: `answer` (a JSON answer whose `data` holds `rows`, as `json_value`
    wrote them) as JSON, or for a bytes encoding the rows' bytes with the rest of it in the
    `metadata` header."""
    if not encoding.binary:
        return web.json_response(answer)
    head = {k: answer[k] for k in ("id", "created", "model")}
    body, headers = binary_body(encoding, rows, head, answer["usage"])
    return web.Response(body=body, headers=headers, content_type="application/octet-stream")
