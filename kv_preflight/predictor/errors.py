"""Errors the predictor answers with, each carrying its HTTP status and a counter kind.

Raising one of these anywhere on the request path turns into a JSON
``{"error": message}`` response, so a bad input can never surface as a 500.
Whatever a client sent is echoed back only through ``clip``: a 5 MB model name
must not come back as a 5 MB error (nor land whole in a log line).
"""
from __future__ import annotations

ECHO_LIMIT = 256  # characters of any client input an error message may carry
# A message is fixed text plus a few clipped inputs; this caps it even if an echo site forgot ``clip``.
MESSAGE_LIMIT = 4 * ECHO_LIMIT


def clip(text: object, limit: int = ECHO_LIMIT) -> str:
    """``text`` (``str()`` of it) cut to ``limit`` characters, saying how long it was when cut.

    Quote an input with ``clip(repr(value))``: the quotes show where it starts, and the cut
    still applies to the whole of what is echoed.
    """
    s = text if isinstance(text, str) else str(text)
    if len(s) <= limit:
        return s
    return f"{s[:limit]}... ({len(s)} characters, cut to {limit})"


class PredictorError(Exception):
    status: int = 500
    kind: str = "internal"

    def __init__(self, message: str):
        message = clip(message, MESSAGE_LIMIT)
        super().__init__(message)
        self.message = message


class BadRequest(PredictorError):
    status = 400
    kind = "bad_request"


class UnknownModel(BadRequest):
    kind = "unknown_model"


class NotFound(PredictorError):
    status = 404
    kind = "not_found"


class RequestTimeout(PredictorError):
    """The body did not arrive within request_read_timeout_s: the connection is closed after the answer."""

    status = 408
    kind = "request_timeout"


class BodyTooLarge(PredictorError):
    status = 413
    kind = "body_too_large"


class UnsupportedMediaType(PredictorError):
    """A Content-Type that says the body is not JSON (form data, plain text): refused before reading it."""

    status = 415
    kind = "unsupported_media_type"


class EngineRejected(BadRequest):
    """The engine's /tokenize judged the prompt or messages bad (its 400, 413 or 422): the input is at fault.
    Its other 4xx (an API key it wants, a wrong URL, its rate limit) are the server's: EngineUnavailable."""

    kind = "engine_rejected"


class IndexUnavailable(PredictorError):
    status = 503
    kind = "valkey"


class EngineUnavailable(PredictorError):
    """No engine (or tokenizer service) could tokenize for the model: a dependency of the server, never the
    client's mistake, so retryable (a router takes a 400 for its own bug)."""

    status = 503
    kind = "engine"


class NotReady(PredictorError):
    """The predictor cannot judge the request yet: it has not read the fleet records, or no ingester has
    reported any pod. Retryable; ``GET /ready`` answers 503 meanwhile."""

    status = 503
    kind = "not_ready"
