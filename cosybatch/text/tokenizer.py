"""The CosyVoice3 text tokenizer, rebuilt with the ``tokenizers`` library (no transformers).

Official behaviour (``CosyVoice3Tokenizer``): ``AutoTokenizer(CosyVoice-BlankEN)``, i.e. a
Qwen2TokenizerFast converted from vocab.json + merges.txt, then ``add_special_tokens`` with
eos/pad ``<|endoftext|>`` and the 280 ``additional_special_tokens`` below, in list order.
Tokens that already exist keep their id; the rest are numbered on from the end of the vocab,
so ``<|endofprompt|>`` lands on 151646 -- the id the LLM asserts is present.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE

__all__ = ["CosyVoice3Tokenizer", "ENDOFPROMPT", "ENDOFPROMPT_ID", "BREATH_ID", "COSYVOICE3_SPECIAL_TOKENS", "TokenizerError"]

ENDOFPROMPT = "<|endofprompt|>"
ENDOFPROMPT_ID = 151646
BREATH_ID = 151647
_EOS = "<|endoftext|>"

# Qwen2's pre-tokenizer split (transformers' Qwen2Converter).
_QWEN2_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# The additional_special_tokens of the official CosyVoice3Tokenizer, in its order (the order
# fixes the ids). Events/markup, then CMU phones, then pinyin initials/finals with tones.
_EVENTS = (
    "<|im_start|> <|im_end|> <|endofprompt|> [breath] <strong> </strong> [noise] [laughter] [cough] "
    "[clucking] [accent] [quick_breath] <laughter> </laughter> [hissing] [sigh] [vocalized-noise] "
    "[lipsmack] [mn] <|endofsystem|>"
)
_CMU = (
    "AA AA0 AA1 AA2 AE AE0 AE1 AE2 AH AH0 AH1 AH2 AO AO0 AO1 AO2 AW AW0 AW1 AW2 AY AY0 AY1 AY2 "
    "B CH D DH EH EH0 EH1 EH2 ER ER0 ER1 ER2 EY EY0 EY1 EY2 F G HH IH IH0 IH1 IH2 IY IY0 IY1 IY2 "
    "JH K L M N NG OW OW0 OW1 OW2 OY OY0 OY1 OY2 P R S SH T TH UH UH0 UH1 UH2 UW UW0 UW1 UW2 "
    "V W Y Z ZH"
)
_PINYIN = (
    "a ai an ang ao b c ch d e ei en eng f g h i ian in ing iu "
    "ià iàn iàng iào iá ián iáng iáo iè ié iòng ióng iù iú iā iān iāng iāo iē iě iōng iū "
    "iǎ iǎn iǎng iǎo iǒng iǔ j k l m n o ong ou p q r s sh t u uang ue un uo "
    "uà uài uàn uàng uá uái uán uáng uè ué uì uí uò uó uā uāi uān uāng uē uě uī uō "
    "uǎ uǎi uǎn uǎng uǐ uǒ vè w x y z zh "
    "à ài àn àng ào á ái án áng áo è èi èn èng èr é éi én éng ér ì ìn ìng í ín íng "
    "ò òng òu ó óng óu ù ùn ú ún ā āi ān āng āo ē ēi ēn ēng ě ěi ěn ěng ěr ī īn īng "
    "ō ōng ōu ū ūn ǎ ǎi ǎn ǎng ǎo ǐ ǐn ǐng ǒ ǒng ǒu ǔ ǔn ǘ ǚ ǜ"
)
COSYVOICE3_SPECIAL_TOKENS: tuple[str, ...] = tuple(
    _EVENTS.split() + [f"[{p}]" for p in _CMU.split()] + [f"[{p}]" for p in _PINYIN.split()]
)
assert len(COSYVOICE3_SPECIAL_TOKENS) == 280 and len(set(COSYVOICE3_SPECIAL_TOKENS)) == 280


class TokenizerError(ValueError):
    """The tokenizer files are missing or give ids other than the model was trained with."""


def _special(content: str) -> AddedToken:
    # What transformers registers for special tokens: matched verbatim, before normalisation.
    return AddedToken(content, single_word=False, lstrip=False, rstrip=False, normalized=False, special=True)


def _read_merges(path: Path) -> list[tuple[str, str]]:
    merges = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f):
            line = line.strip()
            if (i == 0 and line.startswith("#version:")) or not line:
                continue
            a, b = line.split()
            merges.append((a, b))
    return merges


class CosyVoice3Tokenizer:
    """Text -> ids exactly as the official frontend's ``tokenizer.encode`` (no BOS/EOS)."""

    def __init__(self, tokenizer: Tokenizer):
        self._tok = tokenizer
        got = tokenizer.token_to_id(ENDOFPROMPT)
        if got != ENDOFPROMPT_ID or tokenizer.token_to_id("[breath]") != BREATH_ID:
            raise TokenizerError(
                f"{ENDOFPROMPT} has id {got} (expected {ENDOFPROMPT_ID}) -- the tokenizer files do not "
                "match the CosyVoice3 vocabulary"
            )
        self.endofprompt_id = ENDOFPROMPT_ID
        self.eos_id = tokenizer.token_to_id(_EOS)

    @classmethod
    def from_dir(cls, path: str | Path) -> "CosyVoice3Tokenizer":
        """Build from ``CosyVoice-BlankEN`` (or a checkpoint directory that contains it)."""
        path = Path(path)
        if (path / "CosyVoice-BlankEN").is_dir():
            path = path / "CosyVoice-BlankEN"
        cfg_path = path / "tokenizer_config.json"
        config = json.loads(cfg_path.read_text(encoding="utf-8")) if cfg_path.is_file() else {}
        # Tokens from added_tokens_decoder keep their ids (HF loads them before anything else).
        existing = {int(i): d["content"] for i, d in config.get("added_tokens_decoder", {}).items()}

        if (path / "tokenizer.json").is_file():  # AutoTokenizer would prefer it, so do we
            tok = Tokenizer.from_file(str(path / "tokenizer.json"))
        else:
            for name in ("vocab.json", "merges.txt"):
                if not (path / name).is_file():
                    raise TokenizerError(f"{path / name}: file not found")
            vocab = json.loads((path / "vocab.json").read_text(encoding="utf-8"))
            for i, content in existing.items():
                vocab.setdefault(content, i)
            tok = Tokenizer(
                BPE(vocab=vocab, merges=_read_merges(path / "merges.txt"), unk_token=None,
                    continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False, byte_fallback=False)
            )  # fmt: skip
            tok.normalizer = normalizers.NFC()
            tok.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=bool(config.get("add_prefix_space", False)), use_regex=False),
            ])  # fmt: skip
            tok.decoder = decoders.ByteLevel()
        # Same order as transformers: the config's added tokens, then eos/pad, then the extras.
        order = [existing[i] for i in sorted(existing)] + [_EOS] + list(COSYVOICE3_SPECIAL_TOKENS)
        tok.add_special_tokens([_special(t) for t in dict.fromkeys(order)])
        return cls(tok)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def tokens(self, text: str) -> list[str]:
        return self._tok.encode(text, add_special_tokens=False).tokens

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def __len__(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def __call__(self, text: str) -> list[int]:
        return self.encode(text)
