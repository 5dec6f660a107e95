"""Local tokenization: BOS rules, the chat template as the engine renders it, the sandbox, and the
divergence report of `kv-preflight tokenizer check` (pure parts; the real engine is in tests/e2e)."""
from __future__ import annotations

import pytest

from kv_preflight.predictor.tokens.local import LocalTokenizer, TemplateError, TokenizerLoadError, normalize_messages
from kv_preflight.predictor.tokens.parity import (
    Sample, builtin_samples, cause_of, compare, first_divergence, load_samples,
)
from tests.tokenizer_files import BOS, IM_END, IM_START, write_tokenizer


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return write_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def tok(tok_dir):
    return LocalTokenizer.load(tok_dir, name="m")


def test_prompt_gets_one_bos_from_the_post_processor(tok):
    bos = tok.tokenizer.token_to_id(BOS)
    ids = tok.encode_prompt("Hello there")
    assert ids[0] == bos and ids[1] != bos
    assert tok.tokenizer.decode(ids[1:]) == "Hello there"
    # a prompt that already starts with the BOS text gets a second one, as vLLM's /tokenize does
    assert tok.encode_prompt(BOS + "Hello")[:2] == [bos, bos]


@pytest.mark.parametrize("flag, expect_bos", [(True, True), (False, False)])
def test_explicit_add_bos_token_overrides_tokenizer_json(tmp_path, flag, expect_bos):
    # transformers 5 rebuilds the post-processor from explicit add_bos_token, whatever tokenizer.json said
    d = write_tokenizer(tmp_path, add_bos_token=flag, post_processor_bos=not flag)
    t = LocalTokenizer.load(d)
    ids = t.encode_prompt("Hello")
    assert (ids[0] == t.tokenizer.token_to_id(BOS)) is expect_bos
    assert ids.count(t.tokenizer.token_to_id(BOS)) == int(expect_bos)


def test_messages_render_the_template_and_add_no_second_bos(tok):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    text = tok.render_chat(msgs)
    assert text == (f"{BOS}{IM_START}system\nBe brief.{IM_END}\n{IM_START}user\nHello{IM_END}\n"
                    f"{IM_START}assistant\n")
    ids = tok.encode_messages(msgs)
    bos = tok.tokenizer.token_to_id(BOS)
    assert ids[0] == bos and ids.count(bos) == 1
    assert ids == tok.tokenizer.encode(text, add_special_tokens=False).ids


def test_template_whitespace_control_matches_hugging_face(tmp_path):
    # trim_blocks + lstrip_blocks: block tags on their own lines leave no blank lines behind
    template = ("{% for m in messages %}\n    {% if m['role'] == 'user' %}\nU: {{ m['content'] }}\n"
                "    {% endif %}\n{% endfor %}")
    t = LocalTokenizer.load(write_tokenizer(tmp_path, chat_template=template))
    assert t.render_chat([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]) == "U: a\nU: b\n"


def test_text_parts_join_with_newlines_unless_the_template_iterates_them(tmp_path, tok):
    parts = [{"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]}]
    assert "one\ntwo" in tok.render_chat(parts)
    iterating = "{% for m in messages %}{% for p in m['content'] %}[{{ p['text'] }}]{% endfor %}{% endfor %}"
    t = LocalTokenizer.load(write_tokenizer(tmp_path, chat_template=iterating))
    assert t.content_as_parts and t.render_chat(parts) == "[one][two]"
    assert normalize_messages(parts, content_as_parts=False)[0]["content"] == "one\ntwo"


def test_raise_exception_and_sandbox(tmp_path):
    strict = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}ok"
    t = LocalTokenizer.load(write_tokenizer(tmp_path / "a", chat_template=strict))
    with pytest.raises(TemplateError, match="first must be user"):
        t.render_chat([{"role": "system", "content": "x"}])
    evil = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    t = LocalTokenizer.load(write_tokenizer(tmp_path / "b", chat_template=evil))
    with pytest.raises(TemplateError):
        t.render_chat([{"role": "user", "content": "x"}])
    mutate = "{{ messages.append(1) }}"
    t = LocalTokenizer.load(write_tokenizer(tmp_path / "c", chat_template=mutate))
    with pytest.raises(TemplateError):
        t.render_chat([{"role": "user", "content": "x"}])


def test_missing_files_and_template(tmp_path):
    with pytest.raises(TokenizerLoadError, match="tokenizer.json"):
        LocalTokenizer.load(tmp_path)
    t = LocalTokenizer.load(write_tokenizer(tmp_path / "t", chat_template=None))
    with pytest.raises(TemplateError, match="no chat template"):
        t.encode_messages([{"role": "user", "content": "x"}])
    with pytest.raises(TokenizerLoadError, match="does not compile"):
        LocalTokenizer.load(write_tokenizer(tmp_path / "bad", chat_template="{% for %}"))


def test_named_templates_use_default(tmp_path):
    named = [{"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": "DEFAULT"}]
    t = LocalTokenizer.load(write_tokenizer(tmp_path, chat_template=None, extra_config={"chat_template": named}))
    assert t.render_chat([{"role": "user", "content": "x"}]) == "DEFAULT"


# ---------------------------------------------------------------- divergence report


def test_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 9, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2
    assert first_divergence([], []) is None


def diagnose(*args, bos_id: int | None) -> str:
    return cause_of(*args, bos_id).detail


def test_diagnose_names_the_usual_causes():
    s = Sample("s", prompt="hello")
    assert "duplicate BOS" in diagnose([0, 0, 5], [0, 5], 1, s, bos_id=0)
    assert "one side only" in diagnose([5, 6], [0, 5, 6], 0, s, bos_id=0)
    assert "trailing whitespace" in diagnose([0, 5, 7], [0, 5, 8, 8], 2, Sample("w", prompt="hello  "), bos_id=0)
    assert "extra token" in diagnose([0, 5], [0, 5, 3], 2, s, bos_id=0)
    assert "template" in diagnose([0, 5, 6], [0, 5, 7], 2, Sample("c", messages=[{"role": "user", "content": "x"}]),
                                  bos_id=0)


def test_compare_decodes_both_tokens(tok):
    sample = Sample("s", prompt="Hello")
    local = tok.encode_prompt("Hello")
    bos = tok.tokenizer.token_to_id(BOS)
    r = compare(tok, sample, local, [bos] + local)
    assert not r.ok and r.position == 1
    assert BOS in r.engine_token and "duplicate BOS" in r.hint
    assert compare(tok, sample, local, list(local)).ok
    both_refuse = compare(tok, sample, None, None, "bad", "bad")
    assert both_refuse.ok
    assert not compare(tok, sample, local, None, "", "engine says no").ok


def test_builtin_samples_use_the_tokenizers_special_text(tok):
    samples = builtin_samples(tok)
    assert any(s.prompt and s.prompt.startswith(BOS) for s in samples)
    assert {s.kind for s in samples} == {"prompt", "messages"}
    for s in samples:  # every built-in sample is valid input for the local tokenizer
        assert tok.encode(prompt=s.prompt, messages=s.messages)


def test_load_samples(tmp_path):
    f = tmp_path / "s.jsonl"
    f.write_text('{"prompt": "a"}\n\n{"name": "chat", "messages": [{"role": "user", "content": "b"}]}\n')
    got = load_samples(f)
    assert [(s.name, s.kind) for s in got] == [("s.jsonl:1", "prompt"), ("chat", "messages")]
    f.write_text('{"prompt": "a", "messages": []}\n')
    with pytest.raises(ValueError, match="exactly one"):
        load_samples(f)
