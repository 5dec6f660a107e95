"""Kept for predictor/prediction.py alone, which still imports the errors from here: they live in
predictor/errors.py (below http/, where every other module imports them from). Remove once prediction.py does."""
from kv_preflight.predictor.errors import (BadRequest, EngineUnavailable, IndexUnavailable, NotFound, NotReady,
                                           UnknownModel, clip)

__all__ = ["BadRequest", "EngineUnavailable", "IndexUnavailable", "NotFound", "NotReady", "UnknownModel", "clip"]
