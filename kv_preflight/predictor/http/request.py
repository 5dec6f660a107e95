"""Kept for predictor/prediction.py alone, which still imports the request types from here: they live in
predictor/request.py (below http/, where every other module imports them from). Remove once prediction.py does."""
from kv_preflight.predictor.request import KeyedRequest, PredictRequest, check_mm_items, check_token_count

__all__ = ["KeyedRequest", "PredictRequest", "check_mm_items", "check_token_count"]
