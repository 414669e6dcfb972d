"""POST /v1/embeddings' request model and response shapes, after the official OpenAI spec's
CreateEmbeddingRequest / CreateEmbeddingResponse (tests/openai_schemas.json holds the latter):
`input` is a string, a list of strings, a list of token ids or a list of token-id lists (at most
MAX_INPUTS); `encoding_format` float or base64 (little-endian float32 bytes); `dimensions` must be
the model's hidden size (decoder LMs are not Matryoshka-trained: a truncated vector would be a
worse embedding, not a smaller one); `user` is accepted and unused. One extension, as vLLM's
pooling fields: `pooling_type` (last | mean; default: the server's --pooling-type).
server/embeddings_api.py serves it."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field
from typing_extensions import TypedDict

MAX_INPUTS = 2048      # the spec's maxItems


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None
    pooling_type: Literal["last", "mean"] | None = None


class EmbeddingUsage(TypedDict):
    prompt_tokens: int
    total_tokens: int


class EmbeddingData(TypedDict):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str      # str: base64 of little-endian float32


class EmbeddingList(TypedDict):
    object: Literal["list"]
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage
