"""A small byte-level BPE in the CosyVoice-BlankEN file format (vocab.json + merges.txt).

The real BlankEN tokenizer is Qwen2's 151643-entry byte-level BPE.  Generated checkpoints need
the same *id layout* (so ``<|endoftext|>``=151643, ``<|im_start|>``/``<|im_end|>``=151644/5 and
CosyVoice3's added tokens start at 151646), not the same merges: we learn a few hundred merges
from a paragraph of English by pair counting, then pad the vocabulary with strings that BPE can
never emit.
"""

from __future__ import annotations

import functools
import json
import re
from collections import Counter
from pathlib import Path

from cosybatch.models.config import QwenConfig

ENDOFTEXT_ID = 151643  # first special id == size of the regular vocabulary
SPECIALS = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645}

_TRAIN_TEXT = """\
The quick brown fox jumps over the lazy dog near the river bank. She sells sea shells by the
sea shore every summer, and her brother counts the waves while the gulls are calling overhead.
Please call the office and ask them to bring the papers with them from the store before noon.
A rainbow appears when sunlight shines through falling rain, and children run outside to see it.
Reading a good book is a simple pleasure that many people enjoy on quiet winter evenings.
In the morning the market opens early; farmers bring fresh bread, cheese, apples and flowers.
We talked about music, travel, and the history of the old town, which was built of grey stone.
The teacher explained that speech synthesis turns written text into natural sounding voices.
When the weather is warm, they walk along the harbour and watch the boats sailing to the islands.
He said: "It's not what you say, it's how you say it." Then he smiled and opened the window.
Numbers such as 1, 2, 3, 10, 42 and 2024 appear in dates, prices and phone numbers everywhere.
Good afternoon! How are you today? I'm fine, thank you. Let's meet again next Wednesday at five.
You are a helpful assistant. The system reads each sentence, splits long paragraphs into
pieces, and speaks them one by one.
Scientists measured the temperature of the water and the speed of the wind during the storm.
Her garden was full of roses, tulips and tall green trees, and birds were singing all day long.
"""

# Qwen2's pre-tokenizer regex with \\p{L} / \\p{N} narrowed to ASCII: it only decides which pairs
# are counted while learning merges, the runtime tokenizer applies the real pattern.
_PRETOKENIZE = re.compile(
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\nA-Za-z0-9]?[A-Za-z]+|[0-9]| ?[^\sA-Za-z0-9]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2 byte-level alphabet: printable bytes map to themselves, the rest to U+0100 upwards."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    out = {b: chr(b) for b in keep}
    n = 0
    for b in range(256):
        if b not in out:
            out[b] = chr(256 + n)
            n += 1
    return out


def learn_merges(text: str, n_merges: int) -> list[tuple[str, str]]:
    """Greedy BPE training by pair counting (ties broken by the pair's text, so deterministic)."""
    b2u = bytes_to_unicode()
    words = Counter("".join(b2u[b] for b in w.encode("utf-8")) for w in _PRETOKENIZE.findall(text))
    seqs = {w: list(w) for w in words}
    merges: list[tuple[str, str]] = []
    while len(merges) < n_merges:
        pairs: Counter = Counter()
        for w, seq in seqs.items():
            for a, b in zip(seq, seq[1:]):
                pairs[(a, b)] += words[w]
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(best)
        merged = best[0] + best[1]
        for w, seq in seqs.items():
            i, out = 0, []
            while i < len(seq):
                if i + 1 < len(seq) and (seq[i], seq[i + 1]) == best:
                    out.append(merged)
                    i += 2
                else:
                    out.append(seq[i])
                    i += 1
            seqs[w] = out
    return merges


def _unreachable_strings():
    """Byte-level strings made only of UTF-8 continuation bytes: no valid text pre-tokenizes to
    a word starting with one, so BPE can never produce them (even with whole-word lookup)."""
    b2u = bytes_to_unicode()
    cont = [b2u[b] for b in range(0x80, 0xC0)]
    for a in cont:
        for b in cont:
            for c in cont:
                yield a + b + c


def build_vocab(n_merges: int = 600) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """vocab (exactly ENDOFTEXT_ID entries, ids 0..ENDOFTEXT_ID-1) and merges."""
    b2u = bytes_to_unicode()
    # ids 0..255 follow the alphabet's character order, as in Qwen2's vocab.json
    vocab: dict[str, int] = {}
    for ch in sorted(b2u.values()):
        vocab[ch] = len(vocab)
    # lines are joined so that the learned merges are not polluted by layout newlines
    merges = learn_merges(" ".join(_TRAIN_TEXT.split("\n")).strip(), n_merges)
    for a, b in merges:
        if a + b not in vocab:
            vocab[a + b] = len(vocab)
    filler = _unreachable_strings()
    while len(vocab) < ENDOFTEXT_ID:
        s = next(filler)
        if s not in vocab:
            vocab[s] = len(vocab)
    return vocab, merges


@functools.lru_cache(maxsize=1)
def _tokenizer_files() -> tuple[str, str]:
    """(vocab.json, merges.txt) texts; independent of size and seed, so built once per process."""
    vocab, merges = build_vocab()
    lines = ["#version: 0.2"] + [f"{a} {b}" for a, b in merges]
    return json.dumps(vocab, ensure_ascii=False, separators=(",", ":")), "\n".join(lines) + "\n"


def _tokenizer_config() -> dict:
    added = {
        str(i): {
            "content": tok,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for tok, i in SPECIALS.items()
    }
    return {
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|endoftext|>",
        "errors": "replace",
        "model_max_length": 32768,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def _hf_config(q: QwenConfig) -> dict:
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "attention_dropout": 0.0,
        "bos_token_id": ENDOFTEXT_ID,
        "eos_token_id": ENDOFTEXT_ID,
        "hidden_act": "silu",
        "hidden_size": q.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": q.intermediate_size,
        "max_position_embeddings": q.max_position_embeddings,
        "max_window_layers": q.num_hidden_layers,
        "model_type": "qwen2",
        "num_attention_heads": q.num_attention_heads,
        "num_hidden_layers": q.num_hidden_layers,
        "num_key_value_heads": q.num_key_value_heads,
        "rms_norm_eps": q.rms_norm_eps,
        "rope_scaling": None,
        "rope_theta": q.rope_theta,
        "sliding_window": q.max_position_embeddings,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.51.3",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": q.vocab_size,
    }


def _write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")


def write_blank_en(out: Path, q: QwenConfig) -> None:
    """Write CosyVoice-BlankEN/: HF config, tokenizer files and a placeholder weights file."""
    from safetensors.torch import save_file
    import torch

    out.mkdir(parents=True, exist_ok=True)
    if q.vocab_size <= max(SPECIALS.values()):
        raise ValueError(f"Qwen vocab_size {q.vocab_size} cannot hold the special ids")
    vocab_text, merges_text = _tokenizer_files()
    (out / "vocab.json").write_text(vocab_text, encoding="utf-8")
    (out / "merges.txt").write_text(merges_text, encoding="utf-8")
    _write_json(out / "tokenizer_config.json", _tokenizer_config())
    _write_json(out / "config.json", _hf_config(q))
    _write_json(
        out / "generation_config.json",
        {"_from_model_config": True, "bos_token_id": ENDOFTEXT_ID, "eos_token_id": ENDOFTEXT_ID,
         "transformers_version": "4.51.3"},
    )
    # from_pretrained insists on a weights file; llm.pt overwrites every weight anyway
    weights = out / "model.safetensors"
    save_file({"model.norm.weight": torch.ones(q.hidden_size, dtype=torch.bfloat16)},
              str(weights), metadata={"format": "pt"})
    weights.chmod(0o644)  # safetensors creates it owner-only; keep it like its siblings
