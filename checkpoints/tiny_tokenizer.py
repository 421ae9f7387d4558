"""Build the tiny checkpoint's tokenizer: a real HF byte-level BPE ``tokenizer.json`` (plus
``tokenizer_config.json``) with DeepSeek-V4.1's special tokens at their official ids (spec §6).

* The pipeline is DeepSeek's own (V3 onwards): no normalizer, a pre-tokenizer Sequence that isolates
  1-3 digit groups, CJK/kana runs and words/punctuation with DeepSeek's regex, then ByteLevel without its
  own regex; a ByteLevel decoder. Only the vocabulary is small: BPE is trained here, deterministically,
  on the corpus embedded below (English prose, code, a little Chinese).
* Regular tokens take ids 3..N (N = ``BPE_VOCAB + 2`` = 1,402); ids N+1..127,999 are undefined (the
  tiny model's embedding rows for them are zero and the engine masks them out of sampling). Special
  tokens sit at their official ids; because they are not contiguous with the regular ids they are also
  entered in the BPE vocabulary, which is what makes ``tokenizers`` keep their ids on load (otherwise it
  renumbers added tokens from the end of the model vocabulary).
* ``build_tiny_tokenizer`` writes the same bytes on every run and in every process (BPE training has no
  randomness and breaks ties by pair id); the tests build twice in separate processes and compare.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

BPE_VOCAB = 1400  # trained tokens incl. the 256 byte-level base tokens -> regular ids 3..1402
FIRST_REGULAR_ID = 3

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
PAD = "<｜▁pad▁｜>"

# (id, content, special). "｜" is U+FF5C, "▁" is U+2581. Ids are the official V4.1 ones (spec §6).
SPECIAL_TOKENS: list[tuple[int, str, bool]] = [
    (0, BOS, True),
    (1, EOS, True),
    (2, PAD, True),
    *[(128000 + i, f"<｜place▁holder▁no▁{i}｜>", True) for i in range(8)],
    (128799, "<｜System｜>", True),
    (128800, "<｜fim▁hole｜>", True),
    (128801, "<｜fim▁begin｜>", True),
    (128802, "<｜fim▁end｜>", True),
    (128803, "<｜User｜>", True),
    (128804, "<｜Assistant｜>", True),
    (128805, "<|EOT|>", True),  # ASCII pipes, as in DeepSeek-V3
    # 128806-128814: the spec gives only the range; spellings are DeepSeek-V3's tool-call tokens.
    (128806, "<｜tool▁calls▁begin｜>", True),
    (128807, "<｜tool▁calls▁end｜>", True),
    (128808, "<｜tool▁call▁begin｜>", True),
    (128809, "<｜tool▁call▁end｜>", True),
    (128810, "<｜tool▁outputs▁begin｜>", True),
    (128811, "<｜tool▁outputs▁end｜>", True),
    (128812, "<｜tool▁output▁begin｜>", True),
    (128813, "<｜tool▁output▁end｜>", True),
    (128814, "<｜tool▁sep｜>", True),
    # 128815-128820: the spec gives only "repo/file tokens"; these spellings are a guess in the same style.
    (128815, "<｜repo▁name｜>", True),
    (128816, "<｜file▁sep｜>", True),
    (128817, "<｜file▁name｜>", True),
    (128818, "<｜file▁content｜>", True),
    (128819, "<｜repo▁begin｜>", True),
    (128820, "<｜repo▁end｜>", True),
    # The reasoning and DSML markers are added but *not special* (DeepSeek-V3.1 ships <think>/</think>
    # that way), so text decoded with skip_special_tokens=True keeps them and parse_completion can split
    # reasoning and tool calls out of it. Check the real tokenizer.json's flags before relying on this.
    (128821, "<think>", False),
    (128822, "</think>", False),
    (128825, "｜DSML｜", False),
    (128828, "<｜latest_reminder｜>", True),
    # 128829-128845: task tokens of the V4.1 encoder; 128833-128835 and 128837-128843 are not named by
    # the spec and stay undefined.
    (128829, "<｜action｜>", True),
    (128830, "<｜query｜>", True),
    (128831, "<｜authority｜>", True),
    (128832, "<｜domain｜>", True),
    (128836, "<｜title｜>", True),
    (128844, "<｜extracted_url｜>", True),
    (128845, "<｜read_url｜>", True),
    (129264, "<｜deepseek_image｜>", True),
]

# DeepSeek's pre-tokenizer regexes (the V3 tokenizer.json, unchanged in V4): 1-3 digit groups; runs of
# CJK ideographs (U+4E00-U+9FA5), hiragana and katakana; then words, punctuation runs and whitespace.
_DIGITS = r"\p{N}{1,3}"
_CJK = "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+"
_WORDS = (r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
          r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

ENGLISH = """\
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.
Once upon a time there was a small library in a village by the sea. Every evening people came to read,
to talk, and to listen to stories about ships, storms, islands, and the sailors who crossed the ocean.
The librarian kept a notebook of every question she was asked, and after forty years the notebook had
become a history of the village itself: what people wanted to know, what they feared, and what they hoped.
In the spring the farmers asked about the weather and the price of seed. In the summer the children
asked about the stars, the planets, the moon, and why the sky is blue on a clear day but red at sunset.
In the autumn the fishermen asked about tides, winds, and the migration of birds across the northern sky.
In the winter everyone asked for stories, because the nights were long and the fire was warm.
Science is the patient work of asking questions and testing the answers against the world. A hypothesis
must make a prediction that could turn out to be wrong; an experiment must be repeated before anyone
believes it. Measurements carry uncertainty, and a careful scientist reports the error bars together with
the result. Mathematics gives us a language for structure: numbers, functions, vectors, matrices, graphs,
probability and statistics. The derivative measures how fast a quantity changes; the integral adds up
many small pieces into a whole. A matrix multiplication combines rows and columns; a transformer model
stacks attention layers and feed-forward layers, normalises the hidden state, and predicts the next token.
Language models read text as a sequence of tokens. The tokenizer splits words into pieces that appear
often in the training data, so common words become single tokens while rare words are spelled out in
several smaller parts. Numbers are split into groups of at most three digits, and Chinese characters are
kept apart from the surrounding Latin text. During generation the model samples one token at a time,
using a temperature and a top-p threshold to control how adventurous the sampling is.
You are a helpful assistant. Please answer the question concisely and explain your reasoning.
Let me think step by step about the problem before I give the final answer. First, I need to understand
what is being asked. Second, I should check whether the information given is enough. Third, I will solve
it and verify the result. The answer is four, because two plus two equals four.
Write a short poem about autumn leaves. Summarise the following article in three sentences. Translate this
paragraph into French. What is the capital of Japan? Tokyo is the capital of Japan. How many legs does a
spider have? A spider has eight legs. Which planet is the largest in the solar system? Jupiter is.
The weather today is sunny with a light breeze from the west; tomorrow there will be rain in the morning
and clouds in the afternoon. The temperature will reach twenty-one degrees in the city and seventeen near
the coast. Travellers should bring an umbrella, a warm jacket, and comfortable shoes for walking.
Cooking is chemistry you can eat. Bread needs flour, water, salt and yeast; the dough rises because the
yeast produces carbon dioxide. Tea should steep for three minutes, coffee should be ground just before
brewing, and soup tastes better the second day. A good recipe lists the ingredients, the quantities,
the order of the steps, and the time each step takes.
Music, painting, architecture and literature are ways of noticing the world. A melody moves through time;
a painting holds a moment still. The architect thinks about light, weight, and the people who will walk
through the building. The novelist imagines characters whose choices surprise even the author.
History is written from documents, letters, records, buildings and the memories of ordinary people.
Historians compare sources, look for bias, and ask who wrote each text and why. The printing press, the
steam engine, electricity, the telephone, the computer and the internet each changed how people work,
learn, travel and communicate with one another.
Software engineering is the craft of building programs that other people can understand, test and change.
Good code has clear names, small functions, and comments that explain why rather than what. Tests should
be able to fail; a test that can never fail proves nothing. Errors should name the file, the line and the
value that was wrong, so that the person reading the message knows what to fix.
"""

CODE = '''\
def generate(prompts, sampling_params=None, *, max_tokens=16, temperature=1.0):
    """Generate a completion for every prompt, in input order."""
    results = []
    for index, prompt in enumerate(prompts):
        tokens = tokenizer.encode(prompt)
        if len(tokens) > max_len:
            raise ValueError(f"prompt {index} has {len(tokens)} tokens, the limit is {max_len}")
        output = model.generate(tokens, max_tokens=max_tokens, temperature=temperature)
        results.append({"id": index, "text": tokenizer.decode(output), "tokens": output})
    return results


class Scheduler:
    def __init__(self, config, max_slots: int = 8, chunk_size: int = 256):
        self.config = config
        self.max_slots = max_slots
        self.chunk_size = chunk_size
        self.waiting: list[Request] = []
        self.running: dict[int, Request] = {}

    def step(self) -> list[Output]:
        batch = self.schedule()
        logits = self.forward(batch)
        return [self.sample(request, row) for request, row in zip(batch, logits)]


import json
import numpy as np
import jax
import jax.numpy as jnp
from pathlib import Path

x = jnp.zeros((4, 8), dtype=jnp.float32)
y = jnp.ones_like(x) * 0.5
print(x.shape, x.dtype, y.sum())  # (4, 8) float32 16.0
weights = np.load(Path("weights") / "layer_0.npy")
assert weights.shape == (64, 128), weights.shape
with open("config.json", encoding="utf-8") as fh:
    config = json.load(fh)

function fetchData(url, options = {}) {
  return fetch(url, { method: "GET", headers: { "Content-Type": "application/json" }, ...options })
    .then((response) => {
      if (!response.ok) throw new Error(`HTTP ${response.status}`);
      return response.json();
    })
    .catch((error) => console.error("request failed:", error));
}

const items = [1, 2, 3, 4, 5].map((n) => n * n).filter((n) => n % 2 === 1);
let total = 0;
for (let i = 0; i < items.length; i++) { total += items[i]; }

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let path = args.get(1).ok_or("missing path")?;
    let text = std::fs::read_to_string(path)?;
    for (number, line) in text.lines().enumerate() {
        println!("{:>4}: {}", number + 1, line);
    }
    Ok(())
}

#include <stdio.h>
int main(int argc, char **argv) {
    for (int i = 0; i < argc; ++i) printf("%d %s\\n", i, argv[i]);
    return 0;
}

SELECT name, count(*) AS total FROM requests WHERE status = 'done' GROUP BY name ORDER BY total DESC;

$ python -m pytest -q tests/test_tokenizer.py
$ git status --short && git diff --stat
$ export JAX_PLATFORMS=cpu; pip install numpy jax tokenizers

{"model": "deepseek-v4.1-flash", "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 256}
{"temperature": 21, "unit": "celsius", "city": "Hangzhou", "forecast": [18, 19, 23, 25]}
<tool_result>{"status": "ok", "files": ["README.md", "setup.py", "src/main.py"]}</tool_result>
'''

CHINESE = """\
你好，世界。今天天气很好，我们一起去公园散步吧。
我们一起学习机器学习和深度学习，先从线性代数和概率论开始。
杭州是一个美丽的城市，西湖的风景非常有名，春天的时候游客很多。
推理过程：首先分析问题，然后列出已知条件，最后给出答案并检查结果。答案是四。
请用三句话总结这篇文章。这个模型可以回答问题、写代码、翻译文本。
こんにちは。カタカナとひらがなも少しだけ。
"""

EXTRA = """\
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 365 1000 2026 3.14159 2.71828 -1 +1 1e-6 0x1F 65536 129280
Symbols: = == != <= >= => -> ( ) [ ] { } , ; : ' " ! ? @ # $ % ^ & * _ ~ ` | \\ / + - < >
Reasoning Effort: 75 (range 1-100, the higher the value, the more thorough the reasoning)
Mixed: the model 模型 reads tokens 词元 and writes answers 答案; emoji 🙂 🚀 are spelled in bytes.
"""

CORPUS = ENGLISH + CODE + CHINESE + EXTRA


def _pipeline(model: models.Model) -> Tokenizer:
    tok = Tokenizer(model)
    tok.normalizer = normalizers.Sequence([])
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_DIGITS), behavior="isolated", invert=False),
        pre_tokenizers.Split(Regex(_CJK), behavior="isolated", invert=False),
        pre_tokenizers.Split(Regex(_WORDS), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    return tok


def _train() -> Tokenizer:
    tok = _pipeline(models.BPE())
    trainer = trainers.BpeTrainer(vocab_size=BPE_VOCAB, min_frequency=1, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    tok.train_from_iterator(CORPUS.splitlines(keepends=True), trainer=trainer)
    trained = tok.get_vocab_size()
    if trained != BPE_VOCAB:
        # the corpus ran out of pairs to merge: the id layout below would silently shrink
        raise RuntimeError(f"BPE training produced {trained} tokens, expected {BPE_VOCAB}: enlarge CORPUS")
    return tok


def tokenizer_json() -> str:
    """The tokenizer.json text."""
    spec = json.loads(_train().to_str())
    trained = spec["model"]["vocab"]
    regular = {t: i + FIRST_REGULAR_ID for t, i in sorted(trained.items(), key=lambda kv: kv[1])}
    specials = {content: i for i, content, _ in SPECIAL_TOKENS}
    clash = sorted(set(regular) & set(specials))
    if clash:
        raise RuntimeError(f"trained tokens {clash} collide with special tokens")
    spec["model"]["vocab"] = dict(sorted({**regular, **specials}.items(), key=lambda kv: kv[1]))
    spec["added_tokens"] = [
        {"id": i, "content": content, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": special}
        for i, content, special in SPECIAL_TOKENS
    ]
    spec["post_processor"] = None  # add_bos_token is false: the prompt encoding writes BOS itself
    return json.dumps(spec, ensure_ascii=False, indent=1)


def tokenizer_config() -> dict:
    """tokenizer_config.json with the release's keys (spec §6). pad follows V4.1's config.json (id 2)."""
    return {
        "add_bos_token": False,
        "add_eos_token": False,
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "legacy": True,
        "model_max_length": 1048576,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }


def build_tiny_tokenizer(out_dir: Path) -> None:
    """Write tokenizer.json and tokenizer_config.json into ``out_dir`` (created if missing)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "tokenizer.json").write_text(tokenizer_json() + "\n", encoding="utf-8")
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config(), ensure_ascii=False, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    import sys

    build_tiny_tokenizer(Path(sys.argv[1]) if len(sys.argv) > 1 else Path.cwd())
