"""Text side: the CosyVoice3 tokenizer and the official text normalisation."""

from cosybatch.text.normalize import NORMALIZERS, PROMPT_PREFIX, TextNormalizer, has_speech, prompt_text_for, split_target_text
from cosybatch.text.tokenizer import ENDOFPROMPT_ID, CosyVoice3Tokenizer, TokenizerError

__all__ = ["ENDOFPROMPT_ID", "NORMALIZERS", "PROMPT_PREFIX", "CosyVoice3Tokenizer", "TextNormalizer", "TokenizerError",
           "has_speech", "prompt_text_for", "split_target_text"]
