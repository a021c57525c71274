"""Typed hyperparameters of a CosyVoice3 checkpoint.

Every number the models need comes from the checkpoint's ``cosyvoice3.yaml`` and
``CosyVoice-BlankEN/config.json``; ``cosybatch.checkpoint.config_from_yaml`` fills these.
The defaults below are the official Fun-CosyVoice3-0.5B-2512 values and exist only so
that the random-checkpoint generator and tests can build a model without a file.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class QwenConfig:
    hidden_size: int = 896
    num_hidden_layers: int = 24
    num_attention_heads: int = 14
    num_key_value_heads: int = 2
    intermediate_size: int = 4864
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    vocab_size: int = 151936
    max_position_embeddings: int = 32768

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


@dataclass(frozen=True)
class SamplingConfig:
    """The yaml's ``llm.sampling`` (RAS) parameters."""

    top_p: float = 0.8
    top_k: int = 25
    win_size: int = 10
    tau_r: float = 0.1


@dataclass(frozen=True)
class LLMConfig:
    qwen: QwenConfig = field(default_factory=QwenConfig)
    llm_input_size: int = 896
    llm_output_size: int = 896
    speech_token_size: int = 6561  # sos = size, eos = size+1, task_id = size+2, fill = size+3
    sampling: SamplingConfig = field(default_factory=SamplingConfig)

    @property
    def sos(self) -> int:
        return self.speech_token_size

    @property
    def eos(self) -> int:
        return self.speech_token_size + 1

    @property
    def task_id(self) -> int:
        return self.speech_token_size + 2

    @property
    def speech_vocab(self) -> int:
        """Rows of speech_embedding / llm_decoder (speech tokens + 200 specials)."""
        return self.speech_token_size + 200


@dataclass(frozen=True)
class DiTConfig:
    dim: int = 1024
    depth: int = 22
    heads: int = 16
    dim_head: int = 64
    ff_mult: int = 2
    mel_dim: int = 80
    mu_dim: int = 80
    spk_dim: int = 80
    out_channels: int = 80
    static_chunk_size: int = 50  # in mel frames (chunk_size * token_mel_ratio)
    # Fixed by the official classes (not in the yaml); fields only so nothing is hard-coded.
    conv_pos_kernel: int = 31
    conv_pos_groups: int = 16
    time_freq_dim: int = 256
    rope_base: float = 10000.0


@dataclass(frozen=True)
class FlowConfig:
    input_size: int = 80
    output_size: int = 80
    spk_embed_dim: int = 192
    vocab_size: int = 6561
    token_mel_ratio: int = 2
    pre_lookahead_len: int = 3
    pre_lookahead_channels: int = 1024
    dit: DiTConfig = field(default_factory=DiTConfig)
    sigma_min: float = 1e-6
    inference_cfg_rate: float = 0.7
    n_timesteps: int = 10  # hard-coded in the official flow.inference
    noise_len: int = 15000  # frames of the fixed CFM noise table


@dataclass(frozen=True)
class HiFTConfig:
    in_channels: int = 80
    base_channels: int = 512
    nb_harmonics: int = 8
    sampling_rate: int = 24000
    nsf_alpha: float = 0.1
    nsf_sigma: float = 0.003
    nsf_voiced_threshold: float = 10.0
    upsample_rates: tuple[int, ...] = (8, 5, 3)
    upsample_kernel_sizes: tuple[int, ...] = (16, 11, 7)
    n_fft: int = 16
    hop_len: int = 4
    resblock_kernel_sizes: tuple[int, ...] = (3, 7, 11)
    resblock_dilation_sizes: tuple[tuple[int, ...], ...] = ((1, 3, 5), (1, 3, 5), (1, 3, 5))
    source_resblock_kernel_sizes: tuple[int, ...] = (7, 7, 11)
    source_resblock_dilation_sizes: tuple[tuple[int, ...], ...] = ((1, 3, 5), (1, 3, 5), (1, 3, 5))
    lrelu_slope: float = 0.1
    audio_limit: float = 0.99
    conv_pre_look_right: int = 4
    f0_in_channels: int = 80
    f0_cond_channels: int = 512
    f0_num_class: int = 1
    sine_table_len: int = 7_200_000  # samples of the fixed SineGen noise table

    @property
    def samples_per_frame(self) -> int:
        n = self.hop_len
        for r in self.upsample_rates:
            n *= r
        return n


@dataclass(frozen=True)
class MelConfig:
    """Prompt-mel feature extractor (matcha mel_spectrogram arguments)."""

    n_fft: int = 1920
    num_mels: int = 80
    sampling_rate: int = 24000
    hop_size: int = 480
    win_size: int = 1920
    fmin: float = 0.0
    fmax: float | None = None
    center: bool = False


@dataclass(frozen=True)
class ModelConfig:
    llm: LLMConfig = field(default_factory=LLMConfig)
    flow: FlowConfig = field(default_factory=FlowConfig)
    hift: HiFTConfig = field(default_factory=HiFTConfig)
    mel: MelConfig = field(default_factory=MelConfig)
    sample_rate: int = 24000
    token_frame_rate: int = 25
    chunk_size: int = 25  # tokens per attention chunk (yaml chunk_size)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """A profile's dtype name on a device: ``auto`` is bfloat16 on CUDA, float32 (parity) on CPU."""
    import torch  # config stays importable without torch (the CLI's fast paths read it)

    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)
