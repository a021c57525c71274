import json
import re
import shutil

import pytest

from conftest import ROWS, load_ref
from cosybatch.text.normalize import (
    PROMPT_PREFIX,
    has_speech,
    is_only_punctuation,
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


@pytest.mark.numeric
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


@pytest.mark.numeric
@pytest.mark.parametrize("row", ROWS)
def test_split_target_text_matches_fixture(tok, reference_dir, row):
    meta = _meta(reference_dir, row)
    # the fixtures were made with no normaliser installed
    assert split_target_text(meta["target_text"], tok, normalizer="none") == meta["segments"]


@pytest.mark.numeric
def test_paragraph_split_is_decided_by_token_counts(tok, reference_dir):
    meta = _meta(reference_dir, "utt5_paragraph")
    first, second = meta["segments"]
    assert second.startswith(" When")  # the space after the stop stays with the next piece
    # with a larger budget the same paragraph stays whole, so the token counts did the split
    assert split_target_text(meta["target_text"], tok, normalizer="none", token_max_n=1000,
                             token_min_n=900) == [meta["target_text"]]
    assert len(tok.encode(first)) > 60


def test_digit_runs_are_read_by_inflect_itself():
    import inflect

    eng = inflect.engine()
    for digits in ("0", "00", "7", "007", "13", "21", "101", "1001", "1986", "2024", "1000001", "120345"):
        assert spell_out_number(f"[{digits}]") == f"[{eng.number_to_words(digits)}]", digits
    # a few values pinned, so a change of inflect's reading shows here
    assert spell_out_number("Room 42, floor 3.") == "Room forty-two, floor three."
    assert spell_out_number("1986") == "one thousand, nine hundred and eighty-six"
    assert spell_out_number("no digits") == "no digits"
    # where the official raises: a non-ASCII digit is read by value, an over-long run digit by digit
    assert spell_out_number("5m²") == "fivemtwo"
    assert spell_out_number("1" * 40) == " ".join(["one"] * 40)


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
    for norm in ("none", "wetext"):
        assert split_target_text("   ", tok, normalizer=norm) == []
        assert split_target_text("...!?", tok, normalizer=norm) == []
        assert split_target_text("  No stop at the end  ", tok, normalizer=norm) == ["No stop at the end."]
        assert split_target_text("I have 2 cats.", tok, normalizer=norm) == ["I have two cats."]
        # markup passes through untouched, as in the official frontend (wetext would read the 3)
        assert split_target_text(" a <|endofprompt|> b 3 ", tok, normalizer=norm) == [" a <|endofprompt|> b 3 "]
    # Chinese: CJK blanks dropped, '.' -> '。', trailing comma -> '。', brackets removed, digits kept
    assert split_target_text("今天 天气（很）好.我们去公园3次，", tok, normalizer="none") == ["今天天气很好。我们去公园3次。"]
    assert split_target_text("面积是5m²，", tok, normalizer="none") == ["面积是5m平方。"]
    # ... and wetext reads the digits first
    assert split_target_text("今天 天气（很）好.我们去公园3次，", tok, normalizer="wetext") == ["今天天气很好。我们去公园三次。"]
    with pytest.raises(ValueError, match="wetext, none"):
        split_target_text("Hello.", tok, normalizer="ttsfrd")


# (target text, its pieces as the official frontend with wetext installed reads them). The
# readings are wetext's and inflect's, quirks included ("1990s" -> "... ninety seconds"): the
# point is to read what CosyVoice3 reads.
WETEXT_TABLE = [
    # money
    ("$3.50 on 12/03/2025 at 10:30am, 1,234,567.89 people.",
     ["three point five dollars on the third of december twenty twenty five at ten thirty AM, one million two "
      "hundred thirty four thousand five hundred and sixty seven point eight nine people."]),
    ("It costs $20 and €15.", ["It costs twenty dollars and fifteen euros."]),
    ("I paid £7.99 for lunch.", ["I paid seven point nine nine pounds for lunch."]),
    # decimals
    ("The price rose by 12.5 percent.", ["The price rose by twelve point five percent."]),
    ("Pi is roughly 3.14159.", ["Pi is roughly three point one four one five nine."]),
    ("Version 2.0 was released on 2021-06-15.",
     ["Version two point oh was released on the fifteenth of june twenty twenty one."]),
    # ordinals and dates
    ("She finished 1st, he was 2nd and I came 23rd.", ["She finished first, he was second and I came twenty third."]),
    ("The meeting is on January 5th, 2024.", ["The meeting is on the fifth of january, twenty twenty four."]),
    # percent, years
    ("Sales grew 45% in 2023.", ["Sales grew forty five percent in twenty twenty three."]),
    ("Born in 1987, she moved here in the 1990s.",
     ["Born in nineteen eighty seven, she moved here in the one thousand nine hundred and ninety seconds."]),
    # times
    ("The train leaves at 7:45 pm.", ["The train leaves at seven forty five PM."]),
    ("Wake me at 06:30.", ["Wake me at six thirty."]),
    # phone numbers
    ("Call 555-123-4567 before noon.", ["Call five five five, one two three, four five six seven before noon."]),
    # abbreviations
    ("Dr. Smith lives at 221B Baker St.", ["doctor Smith lives at two hundred twenty one B Baker St."]),
    ("Mr. and Mrs. Jones arrived.", ["Mister and Misses Jones arrived."]),
    # units
    ("The box weighs 5kg and is 30cm wide.", ["The box weighs five kilograms and is thirty centimeters wide."]),
    ("Run 10km at 25°C.", ["Run ten kilometers at twenty five degrees Celsius."]),
    # plain numbers, signs, fractions
    ("Chapter 3, page 42.", ["Chapter three, page forty two."]),
    ("There are 1,000,000 stars.", ["There are one million stars."]),
    ("Temperature dropped to -5 degrees.", ["Temperature dropped to negative five degrees."]),
    ("It is 3/4 full.", ["It is three quarters full."]),
    ("We need 2 apples, 3 pears and 10 plums.", ["We need two apples, three pears and ten plums."]),
    ("Room 101 is on floor 3.", ["Room one hundred and one is on floor three."]),
    ("A [breath] pause of 2 seconds.", ["A [breath] pause of two seconds."]),
    # Chinese: dates, money, decimals, times, percent, phone numbers, units, mixed scripts, ordinals
    ("今天是2025年12月3日，价格是3.5元。", ["今天是二零二五年十二月三日，价格是三点五元。"]),
    ("会议在下午3:30开始。", ["会议在下午三点三十分开始。"]),
    ("他跑了100米，用时12.5秒。", ["他跑了一百米，用时十二点五秒。"]),
    ("增长了45%。", ["增长了百分之四十五。"]),
    ("我的电话是13812345678。", ["我的电话是幺三八幺二三四五六七八。"]),
    ("面积是5m²，", ["面积是五平方米。"]),
    ("我有2只猫和3只狗。", ["我有两只猫和三只狗。"]),
    ("价格是￥99.9元", ["价格是九元九点九元。"]),
    ("我喜欢iPhone 15和Windows 11。", ["我喜欢iPhone十五和Windows十一。"]),
    ("第1名是小明。", ["第一名是小明。"]),
    ("2024年GDP增长5.2%。", ["二零二四年GDP增长百分之五点二。"]),
]


def _official_english(text: str) -> str:
    """The official recipe composed here from the two libraries, independently of cosybatch:
    wetext's default normaliser, then every digit run left read by inflect."""
    import inflect
    import wetext

    eng = inflect.engine()
    return re.sub(r"[0-9]+", lambda m: eng.number_to_words(m.group()), wetext.Normalizer().normalize(text.strip()))


@pytest.mark.parametrize("text,pieces", WETEXT_TABLE, ids=[t for t, _ in WETEXT_TABLE])
def test_wetext_reading_table(tok, text, pieces):
    assert split_target_text(text, tok, normalizer="wetext") == pieces
    if not re.search(r"[\u4e00-\u9fff]", text):  # one English piece is the whole composed text
        composed = _official_english(text)
        assert "".join(pieces) in (composed, composed + ".")


def test_table_is_large_enough():
    assert len(WETEXT_TABLE) >= 30 and sum(bool(re.search(r"[\u4e00-\u9fff]", t)) for t, _ in WETEXT_TABLE) >= 10


def test_a_decimal_number_stays_in_one_piece(tok):
    text = ("The committee met on a grey morning and spent many long hours going over every single line of the "
            "yearly report, asking the same questions again and again, and in the end it agreed that the fund had "
            "grown by 3.75 percent over the year, which the board called a fair result for a difficult and "
            "uncertain market.")
    read = split_target_text(text, tok, normalizer="wetext")
    assert len(read) == 1 and "three point seven five percent" in read[0]
    # without a normaliser the official frontend ends a sentence at the decimal point, and here
    # the token budget cuts the row there: two requests, "three." and "seventy-five percent ..."
    raw = split_target_text(text, tok, normalizer="none")
    assert len(raw) == 2 and raw[0].endswith("by three.") and raw[1].startswith("seventy-five percent")


@pytest.mark.parametrize("norm", ["wetext", "none"])
def test_has_speech_agrees_with_the_splitter(tok, norm):
    texts = ["...!?", "😀😀", "$", "%", "。！", " ! !", "", "  ", "<|endofprompt|>", "a", "3", "²", "Hi!",
             "今天", "¿?", "…", "$5", "#1"]
    for t in texts:
        assert has_speech(t, norm) == bool(split_target_text(t, tok, normalizer=norm)), (t, norm)
    assert has_speech("$", "wetext") and not has_speech("$", "none")  # wetext reads "dollar"


def test_a_text_wetext_cannot_read_is_read_without_it(tok, caplog):
    # wetext 0.1.8 fails an assertion on these; the official request would fail, a bulk row must not
    for text, want in [("Item #1 is ready.", ["Item #one is ready."]), ("100+ people.", ["one hundred+ people."])]:
        with caplog.at_level("WARNING", logger="cosybatch.text"):
            assert split_target_text(text, tok, normalizer="wetext") == want
        assert "wetext cannot normalize" in caplog.text


def test_wetext_normalizer_is_built_once(tok, monkeypatch):
    import wetext

    from cosybatch.text import normalize

    built = []
    real = wetext.Normalizer

    def counting(*a, **kw):
        built.append(1)
        return real(*a, **kw)

    normalize._wetext.cache_clear()
    monkeypatch.setattr(wetext, "Normalizer", counting)
    try:
        for i in range(5):
            split_target_text(f"Row {i} costs ${i}.50.", tok, normalizer="wetext")
        assert built == [1]
        split_target_text("Row 7.", tok, normalizer="none")  # no normaliser at all
        assert built == [1]
    finally:
        normalize._wetext.cache_clear()


def test_punctuation_and_prompt_helpers():
    assert is_only_punctuation("") and is_only_punctuation("。！…") and is_only_punctuation("$+")
    assert not is_only_punctuation(" .") and not is_only_punctuation("a.")
    assert prompt_text_for("Hello.") == PROMPT_PREFIX + "Hello."
    assert prompt_text_for(" keep spaces ") == PROMPT_PREFIX + " keep spaces "
    instr = "You are a helpful assistant. Speak slowly.<|endofprompt|>Hello."
    assert prompt_text_for(instr) == instr
