"""Errors the predictor answers with, each carrying its HTTP status and a counter kind.

Raising one of these anywhere on the request path turns into a JSON
``{"error": message}`` response, so a bad input can never surface as a 500.
"""
from __future__ import annotations


class PredictorError(Exception):
    status: int = 500
    kind: str = "internal"

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class BadRequest(PredictorError):
    status = 400
    kind = "bad_request"


class UnknownModel(BadRequest):
    kind = "unknown_model"


class BodyTooLarge(PredictorError):
    status = 413
    kind = "body_too_large"


class EngineRejected(BadRequest):
    """The engine's /tokenize refused the prompt or messages (its 4xx): the input is at fault."""

    kind = "engine_rejected"


class IndexUnavailable(PredictorError):
    status = 503
    kind = "valkey"


class EngineUnavailable(PredictorError):
    status = 503
    kind = "engine"
