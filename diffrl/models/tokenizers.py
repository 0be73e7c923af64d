"""Tokenizers built in memory for the tiny offline models (no vocab file is ever downloaded).

- `clip_tokenizer`: byte-level BPE with CLIP's normaliser, pre-tokeniser and `</w>` end-of-word suffix,
  trained (greedy merges, deterministic tie-break) on a small built-in English corpus, wrapped as
  transformers' `CLIPTokenizer` with the `<|startoftext|>` / `<|endoftext|>` specials and
  `model_max_length` 77 (SD3, FLUX).
- `t5_tokenizer`: a Unigram model (substring log-frequencies of the same corpus, T5's Metaspace
  pre-tokeniser), wrapped as `T5TokenizerFast` (`<pad>`=0, `</s>`=1, `<unk>`=2, then the pieces, then the `<extra_id_*>`
  sentinels in reverse, as T5's vocab is laid out). Usable as the UMT5 tokenizer (Wan) too.
- `gemma_tokenizer`: Gemma's BPE with byte fallback (`GemmaTokenizer`: `<pad>` 0, `<eos>` 1, `<bos>` 2, `<unk>` 3,
  `<mask>` 4, the 256 `<0x..>` byte pieces, then characters and BPE merges learned on the corpus, spaces as "▁"): the
  T5Gemma text encoder of Stable Audio 3 and the Gemma-3 encoder of LTX-2.
- `qwen_tokenizer`: Qwen2's byte-level BPE (`Qwen2Tokenizer`, `<|endoftext|>` / `<|im_start|>` / `<|im_end|>`
  specials), trained with the `tokenizers` library on the same corpus: the text encoders of Qwen-Image (Qwen2.5-VL)
  and Z-Image (Qwen3, with QWEN3_CHAT_TEMPLATE), and the language models of BAGEL, HunyuanImage-3.0, Janus-Pro, the
  Qwen3-Omni Thinker and Qwen3.

All are deterministic: the corpus is fixed and the vocabularies are computed here in plain Python
(the `tokenizers` trainers break ties in per-process hash order); the `tokenizers` library supplies
the normalisers / pre-tokenisers and, through transformers, the runtime tokenizer.
"""

from __future__ import annotations

import json
import math
import string
from collections import Counter
from typing import Mapping, Sequence

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import CLIPTokenizer, GemmaTokenizer, Qwen2Tokenizer, T5TokenizerFast

# A few hundred words of plain English in the style of text-to-image prompts. Small on purpose: the
# tiny models have random weights, so the tokenizer only has to be a working, realistic one.
CORPUS: tuple[str, ...] = (
    "a photo of a cat sitting on a red chair next to a window",
    "a painting of a mountain lake at sunrise, oil on canvas, highly detailed",
    "an astronaut riding a horse on the moon, digital art",
    "a bowl of fresh fruit on a wooden table, soft light, still life",
    "a city street at night with neon signs and rain, cinematic photograph",
    "a small blue bird standing on a branch covered in snow",
    "portrait of an old man with a white beard, black and white photo",
    "a sign that says hello world in bold letters",
    "two dogs playing with a ball in a green park on a sunny day",
    "a futuristic car driving through a desert, concept art, wide angle",
    "a cup of coffee and a book beside a lamp, cozy evening",
    "the quick brown fox jumps over the lazy dog",
    "an illustration of a castle in the clouds, fantasy, vibrant colors",
    "close up of a yellow flower with drops of water, macro photography",
    "a boat sailing on the ocean under a stormy sky",
    "a robot cooking pasta in a modern kitchen, three dimensional render",
    "children reading books in a library with tall shelves",
    "a bicycle leaning against a brick wall in an old town",
    "a watercolor of a forest path in autumn with orange leaves",
    "a plate of sushi, top view, studio lighting, sharp focus",
    "a train crossing a bridge over a river between hills",
    "a girl holding an umbrella in the snow, anime style",
    "one apple, two oranges and three bananas on a white plate",
    "a neon text reading open all night above a small shop",
    "an elephant walking across the savanna at sunset, wildlife photo",
)

CLIP_BOS, CLIP_EOS = "<|startoftext|>", "<|endoftext|>"
# CLIP's split regex (specials, contractions, letters, single digits, punctuation runs), as upstream.
_CLIP_SPLIT = r"""<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+"""
T5_PAD, T5_EOS, T5_UNK = "<pad>", "</s>", "<unk>"
# Single characters every Unigram vocab keeps, so ordinary ASCII prompts never map to <unk>.
_ALPHABET = string.ascii_letters + string.digits + string.punctuation


def _clip_words() -> Counter[str]:
    """CORPUS split into byte-level words exactly as CLIP's normaliser + pre-tokeniser split it."""
    normalizer = normalizers.Sequence(
        [normalizers.NFC(), normalizers.Replace(Regex(r"\s+"), " "), normalizers.Lowercase()]
    )
    pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_CLIP_SPLIT), behavior="removed", invert=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False),
        ]
    )
    return Counter(
        word for text in CORPUS for word, _ in pre_tokenizer.pre_tokenize_str(normalizer.normalize_str(text))
    )


def _train_clip_bpe(num_merges: int) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Byte-level BPE with CLIP's `</w>` end-of-word suffix, trained on CORPUS.

    Our own greedy trainer rather than `tokenizers.trainers.BpeTrainer`: that one breaks count ties
    in hash-map order, which differs between processes, and the tiny models must be deterministic.
    Ties here go to the lexicographically smallest pair. Vocab layout as CLIP's: the 256 byte symbols,
    the same with `</w>`, the merges in order, then <|startoftext|>, <|endoftext|> last.
    """
    words = {tuple(w[:-1]) + (w[-1] + "</w>",): n for w, n in _clip_words().items()}
    merges: list[tuple[str, str]] = []
    for _ in range(num_merges):
        pairs: Counter[tuple[str, str]] = Counter()
        for symbols, n in words.items():
            for pair in zip(symbols, symbols[1:]):
                pairs[pair] += n
        if not pairs:
            break
        best = min(pairs, key=lambda pair: (-pairs[pair], pair))
        merges.append(best)
        words = {_merge(symbols, best): n for symbols, n in words.items()}
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens = alphabet + [ch + "</w>" for ch in alphabet] + ["".join(m) for m in merges]
    tokens = list(dict.fromkeys(tokens)) + [CLIP_BOS, CLIP_EOS]
    return {tok: i for i, tok in enumerate(tokens)}, merges


def _merge(symbols: tuple[str, ...], pair: tuple[str, str]) -> tuple[str, ...]:
    """Replace every non-overlapping occurrence of `pair` in `symbols` (left to right) by its join."""
    out: list[str] = []
    i = 0
    while i < len(symbols):
        if i + 1 < len(symbols) and (symbols[i], symbols[i + 1]) == pair:
            out.append(symbols[i] + symbols[i + 1])
            i += 2
        else:
            out.append(symbols[i])
            i += 1
    return tuple(out)


def clip_tokenizer(save_dir: str | None = None, *, pad_token: str = CLIP_EOS, num_merges: int = 300) -> CLIPTokenizer:
    """A CLIP tokenizer trained in memory on CORPUS (model_max_length 77).

    pad_token: "<|endoftext|>" as in CLIP-L's tokenizer, or "!" as in SD3's CLIP-G tokenizer
    (`tokenizer_2`). Saved to save_dir when given (loadable offline with `CLIPTokenizer.from_pretrained`).
    """
    vocab, merges = _train_clip_bpe(num_merges)
    if pad_token not in vocab:
        raise ValueError(f"pad_token {pad_token!r} is not in the trained vocabulary; use {CLIP_EOS!r} or '!'")
    tok = CLIPTokenizer(
        vocab=vocab,
        merges=merges,
        bos_token=CLIP_BOS,
        eos_token=CLIP_EOS,
        unk_token=CLIP_EOS,
        pad_token=pad_token,
        model_max_length=77,
    )
    if save_dir is not None:
        tok.save_pretrained(save_dir)
    return tok


def _unigram_pieces(vocab_size: int, max_piece_length: int = 8) -> list[tuple[str, float]]:
    """A T5-style Unigram vocabulary for CORPUS: (piece, log-prob), <pad>, </s>, <unk> first.

    Deterministic by construction (`tokenizers.trainers.UnigramTrainer` is not, across processes): the
    candidates are the substrings of the Metaspace-split words ("▁photo") seen at least twice plus
    every single character of `_ALPHABET`; each scores log(count / total). The most frequent
    `vocab_size` pieces are kept (ties by piece), which is the seed vocabulary a Unigram trainer would
    start its EM from -- good enough for a random-weight tiny model.
    """
    pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.WhitespaceSplit(),
            pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True),
        ]
    )
    counts: Counter[str] = Counter()
    for text in CORPUS:
        for word, _ in pre_tokenizer.pre_tokenize_str(text):
            for i in range(len(word)):
                for j in range(i + 1, min(len(word), i + max_piece_length) + 1):
                    counts[word[i:j]] += 1
    singles = set(_ALPHABET) | {"▁"}
    for ch in singles:
        counts[ch] += 1  # characters the corpus lacks still get a (low) score instead of <unk>
    kept = [p for p, n in counts.items() if n >= 2 or p in singles]
    kept.sort(key=lambda p: (p not in singles, -counts[p], p))  # single characters always survive
    kept = sorted(kept[: max(vocab_size - 3, len(singles))], key=lambda p: (-counts[p], p))
    total = sum(counts[p] for p in kept)
    return [(T5_PAD, 0.0), (T5_EOS, 0.0), (T5_UNK, 0.0)] + [(p, math.log(counts[p] / total)) for p in kept]


def t5_tokenizer(
    save_dir: str | None = None, *, vocab_size: int = 300, extra_ids: int = 100, model_max_length: int = 512
) -> T5TokenizerFast:
    """A T5 (or UMT5) tokenizer trained in memory on CORPUS: Unigram, `</s>` appended, `<pad>` = 0.

    Token ids: <pad>=0, </s>=1, <unk>=2, trained pieces, then `<extra_id_{extra_ids-1}>` ... `<extra_id_0>`
    (T5's layout), so the text encoder needs `vocab_size >= len(tokenizer)`.
    """
    pieces = _unigram_pieces(vocab_size)
    vocab = pieces + [(f"<extra_id_{i}>", 0.0) for i in reversed(range(extra_ids))]
    tok = T5TokenizerFast(
        vocab=vocab,
        eos_token=T5_EOS,
        unk_token=T5_UNK,
        pad_token=T5_PAD,
        extra_ids=extra_ids,
        model_max_length=model_max_length,
    )
    if save_dir is not None:
        tok.save_pretrained(save_dir)
    return tok


ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
# Qwen2's pre-tokenisation regex (transformers.models.qwen2.tokenization_qwen2.PRETOKENIZE_REGEX).
_QWEN_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
# Qwen3's chat template reduced to what text-only prompts use: the user turn, the generation prompt,
# and the empty <think> block Qwen3 inserts only when enable_thinking=False (Z-Image passes True).
QWEN3_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)
# The chat-template words (Qwen-Image's system prompt, the roles), repeated so that BPE learns each as
# one token, as in Qwen's real vocabulary: Qwen-Image's prefix is then exactly the 34 tokens its
# pipeline drops (`prompt_template_encode_start_idx`), like with the real tokenizer.
_TEMPLATE_TEXT = (
    "system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
    "spatial relationships of the objects and background:\nuser\nassistant\n"
)
_TEMPLATE_REPEATS = 20


def qwen_tokenizer(
    *,
    vocab_size: int = 600,
    chat_template: str | None = None,
    extra_texts: Sequence[str] = (),
    named_specials: Mapping[str, str] | None = None,
) -> Qwen2Tokenizer:
    """A Qwen2-style byte-level BPE tokenizer trained in memory on the shared corpus (after `extra_texts`, e.g.
    the prompts a run will see, so their words become single tokens).

    Specials: `<|endoftext|>` (id 0; also pad/eos/unk as in Qwen's tokenizers), `<|im_start|>`,
    `<|im_end|>`. Deterministic: fixed corpus, deterministic trainer. Pass `chat_template` (e.g.
    QWEN3_CHAT_TEMPLATE) for pipelines that call `apply_chat_template`. `named_specials` adds more specials after
    those, each also an attribute of the tokenizer (e.g. {"image_token": "<|image_pad|>"}, as multimodal processors
    read them).
    """
    named_specials = dict(named_specials or {})
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[ENDOFTEXT, IM_START, IM_END, *named_specials.values()],
        initial_alphabet=sorted(pre_tokenizers.ByteLevel.alphabet()),
        show_progress=False,
    )
    tok.train_from_iterator([*extra_texts, *CORPUS, *[_TEMPLATE_TEXT] * _TEMPLATE_REPEATS], trainer=trainer)
    trained = json.loads(tok.to_str())["model"]
    vocab = dict(trained["vocab"])
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in trained["merges"]]
    qwen = Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        model_max_length=131072,
        extra_special_tokens=[IM_START, IM_END, *named_specials.values()],
        **named_specials,
    )
    if chat_template is not None:
        qwen.chat_template = chat_template
    return qwen


GEMMA_SPECIALS = ("<pad>", "<eos>", "<bos>", "<unk>", "<mask>")  # ids 0-4, as in Gemma's vocabulary


def gemma_tokenizer(*, num_merges: int = 200, model_max_length: int = 1024) -> GemmaTokenizer:
    """A Gemma tokenizer trained in memory on CORPUS: BPE with byte fallback over "▁"-joined text, `<bos>` prepended.

    Token ids: GEMMA_SPECIALS (0-4), the 256 byte tokens `<0x00>` ... `<0xFF>`, "▁" and the characters of
    `_ALPHABET`, then the merges in order (the greedy trainer of `_train_clip_bpe`: ties to the smallest pair, so the
    vocabulary is the same in every process). Gemma's tokenizer has no pre-tokeniser; the merges are learned within
    the corpus's "▁word" pieces, so they never join two words.
    """
    words: Counter[tuple[str, ...]] = Counter()
    for text in CORPUS:
        for word in text.split():
            words[tuple("▁" + word)] += 1
    merges: list[tuple[str, str]] = []
    for _ in range(num_merges):
        pairs: Counter[tuple[str, str]] = Counter()
        for symbols, n in words.items():
            for pair in zip(symbols, symbols[1:]):
                pairs[pair] += n
        if not pairs:
            break
        best = min(pairs, key=lambda pair: (-pairs[pair], pair))
        merges.append(best)
        words = Counter({_merge(symbols, best): n for symbols, n in words.items()})
    tokens = [*GEMMA_SPECIALS, *(f"<0x{b:02X}>" for b in range(256)), "▁", *_ALPHABET, *("".join(m) for m in merges)]
    vocab = {tok: i for i, tok in enumerate(dict.fromkeys(tokens))}
    return GemmaTokenizer(vocab=vocab, merges=merges, model_max_length=model_max_length, add_bos_token=True)
