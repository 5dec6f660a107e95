"""Time to first token from the prefix cache: a per-model prefill model, and its least-squares fit.

Why a model at all: what a cache hit is worth to a caller is the prefill it saves.
The first token costs roughly a fixed overhead (scheduling, sampling, the HTTP hop),
plus linear work per *uncached* token (the MLPs), plus attention, which for the ``u``
new tokens of an ``N``-token prompt with ``K = N - u`` cached tokens is one pair per
(new token, earlier token): ``sum_{i=K+1..N} i ~ (N^2 - K^2) / 2``. So

    ttft_ms = overhead_ms + u * 1000 / prefill_tokens_per_s + attention_ms_per_mpair * (N^2 - K^2) / 2e6

The quadratic term matters for long prompts on small models and is often ~0 for short
ones, so the fit keeps it only when it earns its place (non-negative, lower error).
All functions here are pure; ``kv-preflight calibrate`` does the file I/O.
"""
from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from itertools import combinations
from pathlib import Path
from typing import Any

DEFAULT_MODEL_KEY = "*"  # the entry that applies to models without their own


@dataclass(frozen=True)
class PrefillModel:
    # Defaults: a 7-8B model on one modern datacenter GPU, order of magnitude only; calibrate for real use.
    overhead_ms: float = 20.0
    prefill_tokens_per_s: float = 10_000.0
    attention_ms_per_mpair: float = 0.0  # ms per million (new token, earlier token) pairs

    def __post_init__(self) -> None:
        if not (self.prefill_tokens_per_s > 0 and math.isfinite(self.prefill_tokens_per_s)):
            raise ValueError(f"prefill_tokens_per_s must be positive and finite, got {self.prefill_tokens_per_s}")
        if self.overhead_ms < 0 or self.attention_ms_per_mpair < 0:
            raise ValueError("overhead_ms and attention_ms_per_mpair must not be negative")

    def estimate_ms(self, prompt_tokens: int, cached_tokens: int) -> float:
        n = max(prompt_tokens, 0)
        k = min(max(cached_tokens, 0), n)
        u = n - k
        ms = self.overhead_ms + u * 1000.0 / self.prefill_tokens_per_s
        if self.attention_ms_per_mpair:
            ms += self.attention_ms_per_mpair * (n * n - k * k) / 2e6
        return round(ms, 2)

    def estimates_for(self, prompt_tokens: int) -> Callable[[int], float]:
        """``estimate_ms`` for one prompt length, as a function of the cached tokens: the same arithmetic
        (so the same floats), its constants bound once. Scoring a prompt a thousand pods hold at a few
        hundred lengths calls it per length, where the method's lookups were most of its cost."""
        n = max(prompt_tokens, 0)
        overhead, rate, attention, nn = self.overhead_ms, self.prefill_tokens_per_s, self.attention_ms_per_mpair, n * n

        def at(cached_tokens: int) -> float:
            k = cached_tokens if 0 <= cached_tokens <= n else min(max(cached_tokens, 0), n)
            ms = overhead + (n - k) * 1000.0 / rate
            if attention:
                ms += attention * (nn - k * k) / 2e6
            return round(ms, 2)

        return at


@dataclass(frozen=True)
class TtftModels:
    """Per-model prefill models; ``*`` (or the built-in default) for any other model."""

    models: Mapping[str, PrefillModel] = field(default_factory=dict)
    default: PrefillModel = PrefillModel()

    def for_model(self, model: str) -> PrefillModel:
        return self.models.get(model) or self.default

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> "TtftModels":
        raw = doc.get("models") if isinstance(doc.get("models"), Mapping) else None
        if raw is None:
            raise ValueError('a TTFT model file is {"models": {"<model or *>": {"overhead_ms": ..., '
                             '"prefill_tokens_per_s": ..., "attention_ms_per_mpair": ...}}}')
        models = {}
        for name, params in raw.items():
            if not isinstance(params, Mapping):
                raise ValueError(f"model {name!r}: expected an object")
            known = {k: float(params[k]) for k in ("overhead_ms", "prefill_tokens_per_s", "attention_ms_per_mpair")
                     if k in params}
            models[str(name)] = PrefillModel(**known)
        default = models.pop(DEFAULT_MODEL_KEY, PrefillModel())
        return cls(models, default)

    @classmethod
    def load(cls, path: str | Path | None) -> "TtftModels":
        if not path:
            return cls()
        try:
            doc = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"cannot read TTFT model {path}: {exc}") from None
        if not isinstance(doc, Mapping):
            raise ValueError(f"{path}: expected a JSON object")
        return cls.from_json(doc)


# ---------------------------------------------------------------- fitting


@dataclass(frozen=True)
class Observation:
    prompt_tokens: int
    cached_tokens: int
    ttft_ms: float
    model: str | None = None


@dataclass(frozen=True)
class Fit:
    model: PrefillModel
    n: int  # observations the model was fitted on
    mae_ms: float  # on those
    p90_rel_error: float
    terms: tuple[str, ...]
    outliers: int = 0  # slow outliers left out (queueing, hiccups), see fit_prefill_model
    all_mae_ms: float | None = None  # on every observation, outliers included
    all_p90_rel_error: float | None = None

    def as_json(self) -> dict[str, Any]:
        fit: dict[str, Any] = {"n": self.n, "mae_ms": round(self.mae_ms, 3), "p90_rel_error": round(self.p90_rel_error, 4),
                               "terms": list(self.terms), "outliers": self.outliers}
        if self.outliers:
            fit.update(all_mae_ms=round(self.all_mae_ms or 0.0, 3), all_p90_rel_error=round(self.all_p90_rel_error or 0.0, 4))
        return {**asdict(self.model), "fit": fit}


def parse_observations(lines: Iterable[str], source: str = "input") -> list[Observation]:
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            obs = Observation(int(obj["prompt_tokens"]), int(obj.get("cached_tokens") or 0), float(obj["ttft_ms"]),
                              obj.get("model"))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{source}:{n}: need prompt_tokens, cached_tokens, ttft_ms ({type(exc).__name__}: {exc})"
                             ) from None
        if obs.prompt_tokens <= 0 or obs.cached_tokens < 0 or obs.cached_tokens > obs.prompt_tokens or obs.ttft_ms <= 0:
            raise ValueError(f"{source}:{n}: need 0 <= cached_tokens <= prompt_tokens, prompt_tokens > 0, ttft_ms > 0")
        out.append(obs)
    return out


def _features(o: Observation) -> tuple[float, float, float]:
    n, k = o.prompt_tokens, o.cached_tokens
    return 1.0, float(n - k), (n * n - k * k) / 2e6


def solve_least_squares(rows: Sequence[Sequence[float]], ys: Sequence[float]) -> list[float] | None:
    """Normal equations with column scaling and partial pivoting; None when the system is singular."""
    m = len(rows[0])
    scale = [max((abs(r[j]) for r in rows), default=0.0) or 1.0 for j in range(m)]
    a = [[sum(r[i] / scale[i] * r[j] / scale[j] for r in rows) for j in range(m)] for i in range(m)]
    b = [sum(r[i] / scale[i] * y for r, y in zip(rows, ys)) for i in range(m)]
    for col in range(m):
        pivot = max(range(col, m), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) < 1e-12:
            return None
        a[col], a[pivot] = a[pivot], a[col]
        b[col], b[pivot] = b[pivot], b[col]
        for r in range(col + 1, m):
            f = a[r][col] / a[col][col]
            for c in range(col, m):
                a[r][c] -= f * a[col][c]
            b[r] -= f * b[col]
    x = [0.0] * m
    for r in range(m - 1, -1, -1):
        x[r] = (b[r] - sum(a[r][c] * x[c] for c in range(r + 1, m))) / a[r][r]
    return [x[j] / scale[j] for j in range(m)]


def errors(model: PrefillModel, data: Sequence[Observation]) -> tuple[float, float]:
    """(mean absolute error in ms, 90th-percentile relative error)."""
    abs_err = [abs(model.estimate_ms(o.prompt_tokens, o.cached_tokens) - o.ttft_ms) for o in data]
    rel = sorted(e / o.ttft_ms for e, o in zip(abs_err, data))
    p90 = rel[min(len(rel) - 1, math.ceil(0.9 * len(rel)) - 1)] if rel else 0.0
    return (sum(abs_err) / len(abs_err) if abs_err else 0.0), p90


TERMS = ("overhead", "per_token", "attention")


# Slow outliers: residual above the median by more than this many robust standard deviations (MAD x 1.4826).
OUTLIER_SIGMAS = 3.0
MAX_OUTLIER_SHARE = 0.25


def fit_prefill_model(data: Sequence[Observation], *, quadratic: bool = True, robust: bool = True) -> Fit:
    """The least-squares fit; with ``robust``, refitted without slow outliers.

    Observed TTFT includes time a request waited in the engine's queue and the odd
    hiccup (GC, a noisy neighbour); those are always *slower* than prefill, and a
    few of them drag a least-squares line far off. So points whose residual is more
    than OUTLIER_SIGMAS robust deviations above the median are left out and the fit
    redone (at most twice, never more than MAX_OUTLIER_SHARE of the data); the
    error is reported on the kept points and on all of them.
    """
    fit = _least_squares_fit(data, quadratic)
    if not robust or len(data) < 8:
        return fit
    kept = list(data)
    for _ in range(2):
        res = [o.ttft_ms - fit.model.estimate_ms(o.prompt_tokens, o.cached_tokens) for o in kept]
        med = _median(res)
        sigma = 1.4826 * _median([abs(r - med) for r in res])
        if sigma <= 0:
            break
        keep = [o for o, r in zip(kept, res) if r - med <= OUTLIER_SIGMAS * sigma]
        if len(keep) == len(kept) or len(data) - len(keep) > MAX_OUTLIER_SHARE * len(data):
            break
        kept = keep
        fit = _least_squares_fit(kept, quadratic)
    if len(kept) == len(data):
        return fit
    all_mae, all_p90 = errors(fit.model, data)
    return Fit(fit.model, fit.n, fit.mae_ms, fit.p90_rel_error, fit.terms, outliers=len(data) - len(kept),
               all_mae_ms=all_mae, all_p90_rel_error=all_p90)


def _median(xs: Sequence[float]) -> float:
    s = sorted(xs)
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2


def _least_squares_fit(data: Sequence[Observation], quadratic: bool) -> Fit:
    """Least squares over every subset of terms that keeps the per-token term; the best non-negative one wins.

    Coefficients must be non-negative to mean anything (time does not shrink with
    tokens), and with three terms trying each subset is the exact answer to that
    constraint, with no optimizer needed.
    """
    if len(data) < 2:
        raise ValueError("need at least 2 observations to fit")
    if len({o.prompt_tokens - o.cached_tokens for o in data}) < 2:
        raise ValueError("every observation has the same number of uncached tokens: nothing to fit a slope to")
    full = [_features(o) for o in data]
    ys = [o.ttft_ms for o in data]
    allowed = (0, 1, 2) if quadratic else (0, 1)
    best: tuple[float, PrefillModel, tuple[str, ...]] | None = None
    for size in range(1, len(allowed) + 1):
        for cols in combinations(allowed, size):
            if 1 not in cols:
                continue
            coef = solve_least_squares([[r[c] for c in cols] for r in full], ys)
            if coef is None or any(c < 0 for c in coef):
                continue
            params = dict(zip(cols, coef))
            if params[1] <= 0:
                continue
            model = PrefillModel(overhead_ms=params.get(0, 0.0), prefill_tokens_per_s=1000.0 / params[1],
                                 attention_ms_per_mpair=params.get(2, 0.0))
            sse = sum((model.estimate_ms(o.prompt_tokens, o.cached_tokens) - o.ttft_ms) ** 2 for o in data)
            if best is None or sse < best[0] * (1 - 1e-9):
                best = (sse, model, tuple(TERMS[c] for c in cols))
    if best is None:
        raise ValueError("no non-negative fit: ttft_ms does not grow with uncached tokens in this data")
    _, model, terms = best
    mae, p90 = errors(model, data)
    return Fit(model, len(data), mae, p90, terms)


def fit_by_model(data: Sequence[Observation], model: str | None = None, *, quadratic: bool = True,
                 robust: bool = True) -> dict[str, Fit]:
    """One fit per model named in the data (unnamed rows: ``*``), or one for ``model`` from its rows and unnamed rows."""
    if model is not None:
        rows = [o for o in data if o.model in (None, model)]
        if not rows:
            raise ValueError(f"no observation for model {model!r}")
        return {model: fit_prefill_model(rows, quadratic=quadratic, robust=robust)}
    groups: dict[str, list[Observation]] = {}
    for o in data:
        groups.setdefault(o.model or DEFAULT_MODEL_KEY, []).append(o)
    return {name: fit_prefill_model(rows, quadratic=quadratic, robust=robust) for name, rows in sorted(groups.items())}


def merge_into(existing: Mapping[str, Any] | None, fits: Mapping[str, Fit]) -> dict[str, Any]:
    """The model file with these fits added or replaced, other models kept."""
    doc = dict(existing or {})
    models = dict(doc.get("models") or {})
    models.update({name: fit.as_json() for name, fit in fits.items()})
    doc["models"] = models
    doc.setdefault("version", 1)
    return doc
