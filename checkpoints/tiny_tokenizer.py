"""Build the tiny checkpoint's tokenizer: a real byte-level BPE ``tokenizer.json`` with DeepSeek-V4.1's
special tokens at their official ids (spec §6), trained deterministically on a small embedded corpus.

Regular BPE tokens take ids 3..N (N ~ 1,200); ids between N and 128,000 are undefined (the tiny model's
embedding rows for them are zero and the engine never samples them). Spellings the spec does not give
(the tool-call and repo/file tokens) follow DeepSeek-V3's tokenizer; they are marked below.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

BPE_VOCAB = 1200  # incl. the 256 byte-level base tokens

# (id, content) of every special token, official ids from spec §6.
SPECIAL_TOKENS: list[tuple[int, str]] = [
    (0, "<｜begin▁of▁sentence｜>"),
    (1, "<｜end▁of▁sentence｜>"),
    (2, "<｜▁pad▁｜>"),
    *[(128000 + i, f"<｜place▁holder▁no▁{i}｜>") for i in range(8)],
    (128799, "<｜System｜>"),
    (128800, "<｜fim▁hole｜>"),
    (128801, "<｜fim▁begin｜>"),
    (128802, "<｜fim▁end｜>"),
    (128803, "<｜User｜>"),
    (128804, "<｜Assistant｜>"),
    (128805, "<|EOT|>"),
    # tool-call tokens 128806-128814: spellings as in DeepSeek-V3 (not given by the spec)
    (128806, "<｜tool▁calls▁begin｜>"),
    (128807, "<｜tool▁calls▁end｜>"),
    (128808, "<｜tool▁call▁begin｜>"),
    (128809, "<｜tool▁call▁end｜>"),
    (128810, "<｜tool▁outputs▁begin｜>"),
    (128811, "<｜tool▁outputs▁end｜>"),
    (128812, "<｜tool▁output▁begin｜>"),
    (128813, "<｜tool▁output▁end｜>"),
    (128814, "<｜tool▁sep｜>"),
    # repo/file tokens 128815-128820: plausible spellings (not given by the spec)
    (128815, "<｜repo▁name｜>"),
    (128816, "<｜file▁sep｜>"),
    (128817, "<｜file▁name｜>"),
    (128818, "<｜file▁content｜>"),
    (128819, "<｜repo▁begin｜>"),
    (128820, "<｜repo▁end｜>"),
    (128821, "<think>"),
    (128822, "</think>"),
    (128825, "｜DSML｜"),
    (128828, "<｜latest_reminder｜>"),
    (128829, "<｜action｜>"),
    (128830, "<｜query｜>"),
    (128831, "<｜authority｜>"),
    (128832, "<｜domain｜>"),
    (128836, "<｜title｜>"),
    (128844, "<｜extracted_url｜>"),
    (128845, "<｜read_url｜>"),
    (129264, "<｜deepseek_image｜>"),
]

CORPUS = """\
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.
Write one sentence about the sea. Tell me about a robot. The moon rises over the quiet river at night.
Mountains, rain, tea, coffee, bread, music, winter, a cat, a train, a garden, stars and a city of lights.
You are a helpful assistant. Please answer the question concisely. Reasoning Effort: 75 (range 1-100,
the higher the value, the more thorough the reasoning). Let me think step by step about the problem.
The answer is 4. Two plus two equals four. What color is the sky on a clear day? The sky is blue.
Once upon a time there was a small library in a village by the sea, and every evening people came to
read, to talk, and to listen to stories about ships, storms, islands, and the people who sailed them.
def generate(prompts, sampling_params=None):
    results = []
    for i, prompt in enumerate(prompts):
        tokens = tokenizer.encode(prompt)
        results.append({"id": i, "text": model(tokens)})
    return results
import jax.numpy as jnp
x = jnp.zeros((4, 8), dtype=jnp.float32)
print(x.shape, x.dtype)  # (4, 8) float32
<tool_result>{"temperature": 21, "unit": "celsius"}</tool_result>
你好，世界。今天天气很好。我们一起学习机器学习和深度学习。杭州是一个美丽的城市。
推理过程：首先分析问题，然后给出答案。答案是四。
Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 2026 3.14159 -1 +1 = == != <= >= ( ) [ ] { } , ; : ' " ! ?
"""


def _train() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=BPE_VOCAB, min_frequency=1, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    lines = CORPUS.splitlines() * 3
    tok.train_from_iterator(lines, trainer=trainer)
    return tok


def tokenizer_json() -> str:
    """The tokenizer.json text (deterministic: training is single-pass over a fixed corpus)."""
    spec = json.loads(_train().to_str())
    vocab = spec["model"]["vocab"]
    # Regular tokens move to ids 3.. in their trained order, freeing 0-2 for BOS/EOS/PAD.
    regular = {t: i + 3 for t, i in sorted(vocab.items(), key=lambda kv: kv[1])}
    # Special tokens are in the model vocab too, at their ids: that is how the added vocabulary keeps
    # those ids when the file is loaded (otherwise it appends them after the last regular id).
    spec["model"]["vocab"] = {**{c: i for i, c in SPECIAL_TOKENS[:3]}, **regular,
                              **{c: i for i, c in SPECIAL_TOKENS[3:]}}
    spec["added_tokens"] = [
        {"id": i, "content": c, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
         "special": True}
        for i, c in SPECIAL_TOKENS
    ]
    spec["post_processor"] = None
    return json.dumps(spec, ensure_ascii=False, indent=1, sort_keys=False)


TOKENIZER_CONFIG = {
    "add_bos_token": False,
    "add_eos_token": False,
    "bos_token": "<｜begin▁of▁sentence｜>",
    "eos_token": "<｜end▁of▁sentence｜>",
    "pad_token": "<｜▁pad▁｜>",
    "unk_token": None,
    "clean_up_tokenization_spaces": False,
    "legacy": True,
    "model_max_length": 1048576,
    "tokenizer_class": "PreTrainedTokenizerFast",
}


def build_tiny_tokenizer(out_dir: Path) -> None:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "tokenizer.json").write_text(tokenizer_json() + "\n", encoding="utf-8")
    (out_dir / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG, ensure_ascii=False, indent=2) + "\n",
                                                   encoding="utf-8")
