"""The in-memory tokenizers of the tiny models: specials, padding, determinism, save/reload offline."""

from __future__ import annotations

from transformers import AutoTokenizer, CLIPTokenizer, T5TokenizerFast

from diffrl.models.tokenizers import GEMMA_SPECIALS, clip_tokenizer, gemma_tokenizer, t5_tokenizer


def test_clip_tokenizer_specials_and_padding():
    tok = clip_tokenizer()
    ids = tok("A photo of a cat", padding="max_length", max_length=tok.model_max_length).input_ids
    assert tok.model_max_length == 77 and len(ids) == 77
    assert ids[0] == tok.convert_tokens_to_ids("<|startoftext|>") == tok.bos_token_id
    end = ids.index(tok.eos_token_id)
    assert tok.convert_ids_to_tokens(ids[1:end]) == ["a</w>", "photo</w>", "of</w>", "a</w>", "cat</w>"]
    assert ids[end:] == [tok.eos_token_id] * (77 - end)  # CLIP-L pads with <|endoftext|>
    # Words the corpus never saw still tokenize without <unk> (every byte exists as a word-final symbol).
    assert tok.unk_token_id not in tok("Zyxw qq 42 ~!").input_ids[1:-1]


def test_clip_tokenizer_pad_bang_like_sd3_clip_g():
    tok = clip_tokenizer(pad_token="!")
    ids = tok("a cat", padding="max_length", max_length=8).input_ids
    assert tok.pad_token == "!" and ids[-4:] == [tok.convert_tokens_to_ids("!")] * 4
    assert ids[3] == tok.eos_token_id


def test_t5_tokenizer_layout():
    tok = t5_tokenizer()
    assert (tok.pad_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2)
    assert tok.convert_tokens_to_ids("<extra_id_0>") == len(tok) - 1
    assert tok.convert_tokens_to_ids("<extra_id_99>") == len(tok) - 100
    ids = tok("A photo of a Zebra, 42", padding="max_length", max_length=40).input_ids
    n = ids.index(1)
    assert ids[n + 1 :] == [0] * (40 - n - 1) and 2 not in ids[:n]  # eos appended, pad after, no <unk>


def test_tokenizers_deterministic_and_round_trip(tmp_path):
    text = ["a red bicycle in the rain", "Two robots, 3 cats!"]
    clip_a, clip_b = clip_tokenizer(str(tmp_path / "clip")), clip_tokenizer()
    t5_a, t5_b = t5_tokenizer(str(tmp_path / "t5")), t5_tokenizer()
    assert clip_a(text).input_ids == clip_b(text).input_ids
    assert t5_a(text).input_ids == t5_b(text).input_ids
    clip_r = CLIPTokenizer.from_pretrained(tmp_path / "clip")
    t5_r = T5TokenizerFast.from_pretrained(tmp_path / "t5")
    t5_auto = AutoTokenizer.from_pretrained(tmp_path / "t5")  # how Wan's pipeline loads UMT5's tokenizer
    assert clip_r(text).input_ids == clip_a(text).input_ids and clip_r.model_max_length == 77
    assert t5_r(text).input_ids == t5_a(text).input_ids == t5_auto(text).input_ids
    assert t5_r.batch_decode(t5_r(text).input_ids, skip_special_tokens=True) == text


def test_gemma_tokenizer_layout_left_padding_and_byte_fallback(tmp_path):
    tok = gemma_tokenizer()
    assert [tok.convert_tokens_to_ids(t) for t in GEMMA_SPECIALS] == [0, 1, 2, 3, 4]
    assert tok.convert_tokens_to_ids("<0x00>") == 5 and tok.padding_side == "left"
    ids = tok(["a photo of a cat"], padding="max_length", max_length=12).input_ids[0]
    first = ids.index(tok.bos_token_id)
    assert first > 0 and set(ids[:first]) == {0} and ids[-1] != 0  # left-padded, <bos> first, as Gemma's
    assert "▁photo" in tok.convert_ids_to_tokens(ids)  # a trained merge: one token for a corpus word
    assert tok.decode(tok("Zebra é ✓").input_ids, skip_special_tokens=True) == "Zebra é ✓"  # bytes for the rest
    tok.save_pretrained(tmp_path)
    assert AutoTokenizer.from_pretrained(tmp_path)("a red cat").input_ids == gemma_tokenizer()("a red cat").input_ids
