"""A small real tokenizer written to a directory, as a model repo ships it (tokenizer.json +
tokenizer_config.json with a chat template), so tokenization tests need no download and no ../shared."""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS, EOS, IM_START, IM_END = "<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>"
CHATML = ("{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A prefix cache keeps the KV blocks of earlier prompts so a shared prefix is not computed again.",
    "lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod tempor",
    "def f(x):\n    return x * 2\n", "naïve café 日本語 🎉", "You are a helpful assistant. Hello there!",
]


def write_tokenizer(directory: Path, *, chat_template: str | None = CHATML, add_bos_token: bool | None = None,
                    post_processor_bos: bool = True, extra_config: dict | None = None) -> Path:
    """A byte-level BPE trained on CORPUS; BOS from the post-processor and/or ``add_bos_token``."""
    directory.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=[BOS, EOS, IM_START, IM_END],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 3, trainer)
    if post_processor_bos:
        tok.post_processor = processors.TemplateProcessing(single=f"{BOS}:0 $A:0", pair=f"{BOS}:0 $A:0 $B:1",
                                                           special_tokens=[(BOS, tok.token_to_id(BOS))])
    tok.save(str(directory / "tokenizer.json"))
    config: dict = {"bos_token": BOS, "eos_token": IM_END, "pad_token": EOS,
                    "tokenizer_class": "PreTrainedTokenizerFast"}
    if add_bos_token is not None:
        config["add_bos_token"] = add_bos_token
    if chat_template is not None:
        config["chat_template"] = chat_template
    config.update(extra_config or {})
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory
