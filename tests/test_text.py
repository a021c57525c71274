import json
import shutil

import pytest

from conftest import ROWS, load_ref
from cosybatch.text.normalize import (
    PROMPT_PREFIX,
    is_only_punctuation,
    number_to_words,
    prompt_text_for,
    spell_out_number,
    split_paragraph,
    split_target_text,
)
from cosybatch.text.tokenizer import (
    COSYVOICE3_SPECIAL_TOKENS,
    ENDOFPROMPT_ID,
    CosyVoice3Tokenizer,
    TokenizerError,
)


@pytest.fixture(scope="module")
def tok(model_dir):
    return CosyVoice3Tokenizer.from_dir(model_dir / "CosyVoice-BlankEN")


def _meta(reference_dir, row):
    return json.loads((reference_dir / f"{row}.json").read_text())


# ------------------------------------------------------------------ tokenizer -------------


def test_special_token_ids(tok):
    assert len(COSYVOICE3_SPECIAL_TOKENS) == 280 and len(tok) == 151924
    assert tok.token_to_id("<|endoftext|>") == 151643 == tok.eos_id
    assert tok.token_to_id("<|im_start|>") == 151644 and tok.token_to_id("<|im_end|>") == 151645
    # ids of the real tokenizer (cross-checked against third-party ports' explicit id tables)
    for token, want in [("<|endofprompt|>", ENDOFPROMPT_ID), ("[breath]", 151647), ("<|endofsystem|>", 151663),
                        ("[AA]", 151664), ("[ZH]", 151747), ("[a]", 151748), ("[iǔ]", 151796),
                        ("[vè]", 151844), ("[zh]", 151849), ("[ǜ]", 151923)]:  # fmt: skip
        assert tok.token_to_id(token) == want, token
    ids = [tok.token_to_id(t) for t in COSYVOICE3_SPECIAL_TOKENS[2:]]
    assert ids == list(range(151646, 151924))


@pytest.mark.parametrize("row", ROWS)
def test_encode_matches_fixture(tok, reference_dir, row):
    meta, ref = _meta(reference_dir, row), load_ref(reference_dir, row)
    assert meta["prompt_text"] == prompt_text_for(meta["prompt_text_raw"])
    assert tok.encode(meta["prompt_text"]) == ref["frontend.prompt_text_token"][0].tolist()
    for s, text in enumerate(meta["segments"]):
        assert tok.encode(text) == ref[f"seg{s}.text_token"][0].tolist()


def test_special_tokens_split_before_bpe(tok):
    toks = tok.tokens("the birds [breath] singing<|endofprompt|>")
    assert toks[-5:] == ["Ġbirds", "Ġ", "[breath]", "Ġsinging", "<|endofprompt|>"]
    assert tok.decode(tok.encode("Hello there, world.")) == "Hello there, world."
    assert tok.decode(tok.encode("a [breath] b"), skip_special_tokens=False) == "a [breath] b"


def test_tokenizer_rejects_wrong_vocab(model_dir, tmp_path):
    src = model_dir / "CosyVoice-BlankEN"
    for name in ("merges.txt", "tokenizer_config.json"):
        shutil.copy(src / name, tmp_path / name)
    vocab = json.loads((src / "vocab.json").read_text())
    vocab = {k: v for k, v in vocab.items() if v < 1000}  # a smaller vocab shifts every added id
    (tmp_path / "vocab.json").write_text(json.dumps(vocab))
    with pytest.raises(TokenizerError, match="151646"):
        CosyVoice3Tokenizer.from_dir(tmp_path)
    (tmp_path / "merges.txt").unlink()
    with pytest.raises(TokenizerError, match="merges.txt"):
        CosyVoice3Tokenizer.from_dir(tmp_path)


# ------------------------------------------------------------------ normalisation ---------


@pytest.mark.parametrize("row", ROWS)
def test_split_target_text_matches_fixture(tok, reference_dir, row):
    meta = _meta(reference_dir, row)
    assert split_target_text(meta["target_text"], tok) == meta["segments"]


def test_paragraph_split_is_decided_by_token_counts(tok, reference_dir):
    meta = _meta(reference_dir, "utt5_paragraph")
    first, second = meta["segments"]
    assert second.startswith(" When")  # the space after the stop stays with the next piece
    # with a larger budget the same paragraph stays whole, so the token counts did the split
    assert split_target_text(meta["target_text"], tok, token_max_n=1000, token_min_n=900) == [meta["target_text"]]
    assert len(tok.encode(first)) > 60


def test_number_to_words_matches_inflect():
    # values produced by inflect 7.3.1 engine().number_to_words
    cases = {
        "0": "zero", "00": "zero", "7": "seven", "007": "seven", "13": "thirteen", "21": "twenty-one",
        "100": "one hundred", "101": "one hundred and one", "110": "one hundred and ten",
        "1000": "one thousand", "1001": "one thousand and one", "1010": "one thousand and ten",
        "1100": "one thousand, one hundred", "1986": "one thousand, nine hundred and eighty-six",
        "2024": "two thousand and twenty-four", "12345": "twelve thousand, three hundred and forty-five",
        "100000": "one hundred thousand", "1000001": "one million and one",
        "1001000": "one million, one thousand", "120345": "one hundred and twenty thousand, three hundred and forty-five",
    }  # fmt: skip
    for digits, words in cases.items():
        assert number_to_words(digits) == words, digits
    assert spell_out_number("Room 42, floor 3.") == "Room forty-two, floor three."
    assert spell_out_number("no digits") == "no digits"


def test_split_paragraph_rules():
    def count(s):
        return s.split()  # one "token" per word keeps the arithmetic readable

    assert split_paragraph("He said \"hi.\" Then left", count, "en") == ['He said "hi." Then left.']
    text = " ".join(f"w{i}." for i in range(10))
    # a segment closes once adding a piece would pass max AND it already has more than min
    parts = split_paragraph(text, count, "en", token_max_n=4, token_min_n=2, merge_len=2)
    assert parts == ["w0. w1. w2. w3.", " w4. w5. w6. w7.", " w8. w9."]
    parts = split_paragraph(text, count, "en", token_max_n=4, token_min_n=2, merge_len=3)
    assert parts == ["w0. w1. w2. w3.", " w4. w5. w6. w7. w8. w9."]  # short tail merged
    parts = split_paragraph(text, count, "en", token_max_n=4, token_min_n=4, merge_len=1)
    assert parts == ["w0. w1. w2. w3. w4.", " w5. w6. w7. w8. w9."]  # min not yet passed at 4
    zh = "一二三四五。六七八九十。甲乙丙。"
    assert split_paragraph(zh, None, "zh", token_max_n=8, token_min_n=4, merge_len=1) == ["一二三四五。", "六七八九十。", "甲乙丙。"]
    assert split_paragraph(zh, None, "zh", token_max_n=8, token_min_n=4, merge_len=5) == ["一二三四五。", "六七八九十。甲乙丙。"]


def test_split_target_text_edge_cases(tok):
    assert split_target_text("   ", tok) == []
    assert split_target_text("...!?", tok) == []
    assert split_target_text("  No stop at the end  ", tok) == ["No stop at the end."]
    assert split_target_text("I have 2 cats.", tok) == ["I have two cats."]
    # markup passes through untouched, as in the official frontend
    assert split_target_text(" a <|endofprompt|> b ", tok) == [" a <|endofprompt|> b "]
    # Chinese: CJK blanks dropped, '.' -> '。', trailing comma -> '。', brackets removed, digits kept
    assert split_target_text("今天 天气（很）好.我们去公园3次，", tok) == ["今天天气很好。我们去公园3次。"]
    assert split_target_text("面积是5m²，", tok) == ["面积是5m平方。"]


def test_punctuation_and_prompt_helpers():
    assert is_only_punctuation("") and is_only_punctuation("。！…") and is_only_punctuation("$+")
    assert not is_only_punctuation(" .") and not is_only_punctuation("a.")
    assert prompt_text_for("Hello.") == PROMPT_PREFIX + "Hello."
    assert prompt_text_for(" keep spaces ") == PROMPT_PREFIX + " keep spaces "
    instr = "You are a helpful assistant. Speak slowly.<|endofprompt|>Hello."
    assert prompt_text_for(instr) == instr
