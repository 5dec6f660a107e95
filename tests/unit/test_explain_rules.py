"""The pure rules behind explain, warnings and the diagnoses: the classifier, per-pod losses, sessions, fleet."""
from __future__ import annotations

from kv_preflight.predictor.explain import rules
from kv_preflight.engines.vllm import PREFIX_CACHE_METRICS
from kv_preflight.predictor.diagnosis.fleet import EngineCounters, diagnose_fleet, parse_prefix_counters
from kv_preflight.predictor.explain.warnings import hints_from_probe
from kv_preflight.predictor.diagnosis.sessions import TurnRecord, diagnose_sessions
from kv_preflight.predictor.diagnosis.traffic import MAX_FAMILIES, Traffic
from tests.conftest import fixture_path

BOS = 1
BODY = list(range(100, 160))


def cls(ours, theirs, **kw):
    pos = rules.first_divergence(ours, theirs)
    return rules.classify(ours, theirs, pos, bos_id=BOS, **kw)


def test_each_cause_from_the_shape_of_the_difference():
    assert cls([BOS, BOS, *BODY], [BOS, *BODY]).kind == "duplicate_bos"
    assert cls(BODY, [BOS, *BODY]).kind == "missing_bos"
    cut = cls([BOS, *BODY[20:]], [BOS, *BODY])
    assert (cut.kind, cut.tokens_cut) == ("rolling_context", 20)
    cut = cls(BODY[7:], [BOS, *BODY])
    assert (cut.kind, cut.tokens_cut) == ("rolling_context", 8)  # the BOS went with the front
    kept = [BOS, 5, 6, 7]  # a system prompt kept, the history after it cut
    cut = cls(kept + BODY[30:], kept + BODY)
    assert (cut.kind, cut.tokens_cut) == ("rolling_context", 30)
    assert cls([BOS, *BODY, 9], [BOS, *BODY, 8], ours_text="a  b", theirs_text="a b").kind == "whitespace"
    assert cls([BOS, *BODY, 9], [BOS, *BODY, 8], ours_text="cafe\u0301", theirs_text="café").kind == \
        "unicode_normalization"
    assert cls([BOS, *BODY, 9], [BOS, *BODY, 8], ours_text="x", theirs_text="y").kind == "content_changed"
    assert cls([BOS, *BODY, 9], [BOS, *BODY, 8], chat=True, rendered_vs_given=True).kind == "template_drift"
    assert cls([BOS, 3, 4], [BOS, 3, 5], chat=True, same_input=True).kind == "template_drift"
    assert cls([BOS, 3, 4], [BOS, 3, 5], same_input=True, ours_text="t", theirs_text="t").kind == "tokenizer_drift"
    assert cls([BOS, 3], [BOS, 3, 2], same_input=True, ours_text="t", theirs_text="t").kind == "extra_tokens"


def test_a_few_chance_matches_are_not_a_window():
    assert rules.rolling_cut([1, 2, 3], [9, 1, 2, 3], 0) is None  # fewer than MIN_ROLLING_MATCH tokens
    assert rules.rolling_cut([7, 8, 9, 10, 11], [1, 2, 3, 4, 5, 6], 0) is None
    # aligned search only: the byte pattern of ours must not match across token boundaries
    assert rules.rolling_cut([256, 0, 0, 0], [1, 1, 0, 0, 0, 0], 0) is None


def test_pod_chain_losses_add_up():
    c = rules.pod_chain("p", "m", 5, canonical_block=16, engine_block=32, prompt_len=100)
    assert (c.stop_block, c.stop_token, c.matched_tokens) == (5, 80, 80)
    assert c.lost_tokens.engine_block_rounding == 16 and c.reused_tokens == 64
    c = rules.pod_chain("p", "m", 4, canonical_block=16, engine_block=16, prompt_len=64)
    assert c.reused_tokens == 48 and c.lost_tokens.last_token_recomputed == 16
    assert c.lost_tokens.partial_last_block == 0
    c = rules.pod_chain("p", "m", 4, canonical_block=16, engine_block=None, prompt_len=70)
    assert c.reused_tokens == 64 and c.lost_tokens.partial_last_block == 6


def test_bos_findings_and_the_engine_probe():
    assert [f.kind for f in rules.bos_findings([BOS, BOS, 3], BOS, True)] == ["duplicate_bos"]
    assert [f.kind for f in rules.bos_findings([3, 4], BOS, True)] == ["missing_bos"]
    assert rules.bos_findings([3, 4], BOS, False) == [] and rules.bos_findings([BOS, 3], BOS, True) == []
    assert hints_from_probe([0, 101], [0, 102]).bos_id == 0
    assert hints_from_probe([101], [102]).bos_id is None


def turns(session: str, window: int, n_turns: int):
    """A chat whose client keeps the system prompt and the last ``window`` messages (tokens as a fake template)."""
    system = [BOS, *range(500, 540)]
    history: list[list[int]] = []
    out = []
    for t in range(1, n_turns + 1):
        user = [2, 1000 + t, *range(2000 + 40 * t, 2000 + 40 * t + 30)]
        kept = history[-window:] if window else history
        out.append(TurnRecord(session, t, "m", system + [x for m in kept for x in m] + user))
        history += [user, [3, 3000 + t, *range(5000 + 40 * t, 5000 + 40 * t + 25)]]
    return out


def test_sessions_find_the_window_and_the_turn():
    reports = diagnose_sessions(turns("rolling", 6, 8) + turns("stable", 0, 5))
    rolling, stable = reports
    assert rolling.session == "rolling" and rolling.window_from_turn == 5  # history of 8 > 6 messages
    assert rolling.kept_prefix == 41 + 1  # BOS + system, then every user message starts with token 2
    cut = [t.window_cut for t in rolling.turns]
    assert cut[:4] == [None] * 4 and all(c == 32 + 27 for c in cut[4:])  # one user + one assistant message
    assert all(t.shared_prefix == 42 for t in rolling.turns[4:])
    assert any("sliding window" in a and "turn 5" in a for a in rolling.advice)
    assert stable.window_from_turn is None and not any("window" in a for a in stable.advice)
    assert all(t.shared_prefix == len(prev.tokens) for t, prev in zip(stable.turns[1:], turns("stable", 0, 5)))
    assert stable.tokens_prefilled == stable.tokens_prefilled_if_stable
    assert rolling.tokens_prefilled > rolling.tokens_prefilled_if_stable


def test_fleet_numbers_and_verdicts():
    text = fixture_path("vllm-0.32-metrics.txt").read_text()
    assert parse_prefix_counters(text, PREFIX_CACHE_METRICS) == EngineCounters(1712.0, 576.0)
    assert parse_prefix_counters("vllm:num_requests_running 1\n", PREFIX_CACHE_METRICS) is None
    fams = [{"first_key": "11", "model": "m", "predictions": 6}, {"first_key": "22", "model": "m", "predictions": 4}]
    d = diagnose_fleet(
        pods={"a": ("m", 10), "b": ("m", 12)},
        engines_before={"a": EngineCounters(100, 10), "b": EngineCounters(0, 0)},
        engines_after={"a": EngineCounters(500, 110), "b": EngineCounters(400, 90)}, engine_errors={},
        traffic_before={"predictions": 0, "prompt_tokens": 0, "best_cached_tokens": 0, "families": []},
        traffic_after={"predictions": 10, "prompt_tokens": 1000, "best_cached_tokens": 800, "families": fams},
        holders={"11": ["a", "b"], "22": ["b"]}, window_s=30)
    assert d.observed_hit_rate == 0.2375 and d.p == 0.8 and d.round_robin_bound == 0.4
    assert d.fragmentation_gap == 0.4 and d.duplication_factor == 1.6
    assert [(p.pod_id, p.hit_rate) for p in d.pods] == [("a", 0.25), ("b", 0.225)]
    assert d.verdict == "fragmented" and "round-robin" in d.detail
    good = diagnose_fleet(pods={"a": ("m", 1), "b": ("m", 1)}, engines_before={},
                          engines_after={"a": EngineCounters(100, 78)}, engine_errors={"b": "down"},
                          traffic_before=None,
                          traffic_after={"predictions": 1, "prompt_tokens": 100, "best_cached_tokens": 80},
                          holders={}, window_s=0)
    assert good.verdict == "affinity" and good.pods[1].error == "down"
    none = diagnose_fleet(pods={}, engines_before={}, engines_after={}, engine_errors={}, traffic_before=None,
                          traffic_after=None, holders={}, window_s=0)
    assert none.verdict == "no_traffic"


def test_traffic_is_bounded():
    t = Traffic()
    for i in range(MAX_FAMILIES + 10):
        t.observe("m", i, 10, 5)
    t.observe("m", 0, 10, 5)
    doc = t.as_dict(top=2)
    assert doc["families_tracked"] == MAX_FAMILIES and doc["untracked"] == 10
    assert doc["families"][0] == {"first_key": "0", "model": "m", "predictions": 2} and len(doc["families"]) == 2
