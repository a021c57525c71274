"""Audio I/O, resampling and spectral features for CosyVoice3 prompts (no torchaudio/librosa)."""

from cosybatch.audio.features import kaldi_fbank, prompt_mel, whisper_log_mel
from cosybatch.audio.io import AudioError, load_audio, to_mono
from cosybatch.audio.mel import kaldi_mel_banks, slaney_mel_filterbank
from cosybatch.audio.resample import resample

__all__ = [
    "AudioError",
    "load_audio",
    "to_mono",
    "resample",
    "whisper_log_mel",
    "kaldi_fbank",
    "prompt_mel",
    "slaney_mel_filterbank",
    "kaldi_mel_banks",
]
