"""Text side: the CosyVoice3 tokenizer and the official no-download text normalisation."""

from cosybatch.text.normalize import PROMPT_PREFIX, prompt_text_for, split_target_text
from cosybatch.text.tokenizer import ENDOFPROMPT_ID, CosyVoice3Tokenizer, TokenizerError

__all__ = ["ENDOFPROMPT_ID", "PROMPT_PREFIX", "CosyVoice3Tokenizer", "TokenizerError", "prompt_text_for", "split_target_text"]
