"""The prefill (TTFT) model and its least-squares fit: pure, checked on data with known answers."""
from __future__ import annotations

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_preflight.predictor.scoring.ttft import (
    Observation, PrefillModel, TtftModels, errors, fit_by_model, fit_prefill_model, merge_into, parse_observations,
    solve_least_squares,
)


def synth(model: PrefillModel, n: int = 60, seed: int = 1, noise: float = 0.0, name: str | None = None):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt = rng.randrange(16, 4000)
        cached = rng.randrange(0, prompt) // 16 * 16
        ms = model.estimate_ms(prompt, cached) * (1 + rng.uniform(-noise, noise))
        out.append(Observation(prompt, cached, ms, name))
    return out


def test_estimate_counts_only_uncached_tokens_and_attention_pairs():
    m = PrefillModel(overhead_ms=10, prefill_tokens_per_s=1000, attention_ms_per_mpair=2)
    assert m.estimate_ms(1000, 0) == pytest.approx(10 + 1000 + 2 * 1e6 / 2e6)
    assert m.estimate_ms(1000, 600) == pytest.approx(10 + 400 + 2 * (1e6 - 360_000) / 2e6)
    assert m.estimate_ms(100, 500) == 10  # cached beyond the prompt is clamped
    assert PrefillModel().estimate_ms(100, 0) > PrefillModel().estimate_ms(100, 64)


def test_invalid_models_are_refused():
    with pytest.raises(ValueError):
        PrefillModel(prefill_tokens_per_s=0)
    with pytest.raises(ValueError):
        PrefillModel(overhead_ms=-1)


def test_fit_recovers_exact_parameters():
    truth = PrefillModel(overhead_ms=35.0, prefill_tokens_per_s=5000.0, attention_ms_per_mpair=3.0)
    fit = fit_prefill_model(synth(truth))
    assert fit.terms == ("overhead", "per_token", "attention")
    assert fit.model.overhead_ms == pytest.approx(35.0, abs=0.05)
    assert fit.model.prefill_tokens_per_s == pytest.approx(5000.0, rel=1e-3)
    assert fit.model.attention_ms_per_mpair == pytest.approx(3.0, rel=1e-2)
    assert fit.mae_ms < 0.05 and fit.p90_rel_error < 1e-3


def test_fit_drops_a_term_that_would_be_negative():
    # linear data plus noise: an unconstrained fit may give a small negative attention term
    truth = PrefillModel(overhead_ms=5.0, prefill_tokens_per_s=20_000.0)
    fit = fit_prefill_model(synth(truth, noise=0.05, seed=4))
    assert fit.model.attention_ms_per_mpair >= 0 and fit.model.overhead_ms >= 0
    assert fit.model.prefill_tokens_per_s == pytest.approx(20_000, rel=0.1)
    assert fit.p90_rel_error < 0.1
    linear = fit_prefill_model(synth(truth), quadratic=False)
    assert "attention" not in linear.terms


@settings(max_examples=40, deadline=None)
@given(overhead=st.floats(0, 200), tps=st.floats(100, 100_000), attn=st.floats(0, 50), seed=st.integers(0, 99))
def test_fit_is_exact_on_noise_free_data(overhead, tps, attn, seed):
    truth = PrefillModel(overhead_ms=overhead, prefill_tokens_per_s=tps, attention_ms_per_mpair=attn)
    data = synth(truth, n=30, seed=seed)
    fit = fit_prefill_model(data)
    # estimates are rounded to 0.01 ms, so the fit is exact to about that
    assert fit.mae_ms <= 0.02 + 1e-6 * max(o.ttft_ms for o in data)


def test_robust_fit_leaves_slow_outliers_out():
    truth = PrefillModel(overhead_ms=18.0, prefill_tokens_per_s=40_000.0)
    data = synth(truth, n=40, seed=9, noise=0.02)
    slowed = [Observation(o.prompt_tokens, o.cached_tokens, o.ttft_ms + 150.0) if i % 10 == 3 else o
              for i, o in enumerate(data)]  # four requests that waited in a queue
    plain = fit_prefill_model(slowed, robust=False)
    robust = fit_prefill_model(slowed)
    assert robust.outliers == 4 and robust.n == 36
    assert robust.model.overhead_ms == pytest.approx(18.0, rel=0.1)
    assert robust.model.prefill_tokens_per_s == pytest.approx(40_000, rel=0.15)
    assert robust.mae_ms < plain.mae_ms and robust.all_mae_ms > robust.mae_ms
    assert robust.as_json()["fit"]["outliers"] == 4
    # clean data loses nothing
    assert fit_prefill_model(synth(truth, n=40, seed=9)).outliers == 0


def test_fit_needs_variation():
    with pytest.raises(ValueError, match="at least 2"):
        fit_prefill_model([Observation(10, 0, 5.0)])
    with pytest.raises(ValueError, match="same number of uncached"):
        fit_prefill_model([Observation(10, 0, 5.0), Observation(20, 10, 6.0)])
    # TTFT falling with more tokens: only the proportional model stays non-negative, and its error says so
    shrinking = fit_prefill_model([Observation(100, 0, 50.0), Observation(1000, 0, 10.0), Observation(2000, 0, 5.0)])
    assert shrinking.terms == ("per_token",) and shrinking.p90_rel_error > 0.9


def test_solver_and_errors():
    assert solve_least_squares([[1, 0], [0, 1], [1, 1]], [1, 2, 3]) == pytest.approx([1, 2])
    assert solve_least_squares([[1, 2], [2, 4]], [1, 2]) is None  # singular
    m = PrefillModel(overhead_ms=0, prefill_tokens_per_s=1000)
    mae, p90 = errors(m, [Observation(10, 0, 10.0), Observation(10, 0, 20.0)])
    assert mae == pytest.approx(5.0) and p90 == pytest.approx(0.5)


def test_per_model_fits_and_model_file_round_trip(tmp_path):
    a = PrefillModel(overhead_ms=10, prefill_tokens_per_s=8000)
    b = PrefillModel(overhead_ms=50, prefill_tokens_per_s=2000)
    data = synth(a, name="a", seed=1) + synth(b, name="b", seed=2) + synth(b, seed=3)
    fits = fit_by_model(data, quadratic=False)
    assert set(fits) == {"a", "b", "*"}
    only_b = fit_by_model(data, "b", quadratic=False)
    assert only_b["b"].model.prefill_tokens_per_s == pytest.approx(2000, rel=1e-3)
    doc = merge_into({"models": {"keep": {"overhead_ms": 1, "prefill_tokens_per_s": 1}}}, fits)
    path = tmp_path / "m.json"
    path.write_text(json.dumps(doc))
    models = TtftModels.load(path)
    assert models.for_model("a").prefill_tokens_per_s == pytest.approx(8000, rel=1e-3)
    assert models.for_model("keep").overhead_ms == 1
    assert models.for_model("unknown") == models.default  # the '*' fit
    assert models.default.overhead_ms == pytest.approx(50, abs=0.1)
    assert TtftModels.load(None).for_model("x") == PrefillModel()
    with pytest.raises(ValueError, match="models"):
        TtftModels.from_json({"overhead_ms": 1})


def test_parse_observations():
    rows = ['{"prompt_tokens": 100, "cached_tokens": 64, "ttft_ms": 12.5, "model": "m"}', "",
            '{"prompt_tokens": 50, "ttft_ms": 9}']
    got = parse_observations(rows)
    assert got == [Observation(100, 64, 12.5, "m"), Observation(50, 0, 9.0, None)]
    for bad in ('{"prompt_tokens": 10}', '{"prompt_tokens": 10, "cached_tokens": 20, "ttft_ms": 1}', "nope"):
        with pytest.raises(ValueError, match="input:1"):
            parse_observations([bad])


@given(st.floats(0, 100), st.floats(1, 1e6), st.floats(0, 50), st.integers(-5, 70_000), st.integers(-100, 80_000))
@settings(max_examples=300, deadline=None)
def test_estimates_for_one_prompt_are_estimate_ms_to_the_bit(overhead, tps, attn, prompt, cached):
    model = PrefillModel(overhead_ms=overhead, prefill_tokens_per_s=tps, attention_ms_per_mpair=attn)
    assert model.estimates_for(prompt)(cached) == model.estimate_ms(prompt, cached)
