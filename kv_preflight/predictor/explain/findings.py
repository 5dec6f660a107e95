"""What a finding is: one reason a prompt misses (or will miss) the prefix cache, and the closed set of kinds.

Shared by the explain answer (predictor/explain/rules.py) and the ``warnings`` of predict and route
answers (predictor/explain/warnings.py); docs/explain.md says what each kind means and what to do.
"""
from __future__ import annotations

import msgspec

# Every kind a finding or a divergence cause can have; docs/explain.md says what each means and what to do.
DUPLICATE_BOS = "duplicate_bos"
MISSING_BOS = "missing_bos"
WHITESPACE = "whitespace"
UNICODE = "unicode_normalization"
TEMPLATE_DRIFT = "template_drift"
ROLLING_CONTEXT = "rolling_context"
OTHER_MODEL = "other_model"
EXTRA_TOKENS = "extra_tokens"
CONTENT = "content_changed"
TOKENIZER_DRIFT = "tokenizer_drift"
FINDING_KINDS = (DUPLICATE_BOS, MISSING_BOS, WHITESPACE, UNICODE, TEMPLATE_DRIFT, ROLLING_CONTEXT, OTHER_MODEL,
                 EXTRA_TOKENS, CONTENT, TOKENIZER_DRIFT)


class Finding(msgspec.Struct, frozen=True):
    kind: str
    token_index: int | None  # the first token it concerns (None: the whole prompt)
    detail: str
