"""Zero-shot prompt frontend: prompt wav -> (speech tokens, speaker embedding, prompt mel),
and texts -> token ids, as the official ``CosyVoiceFrontEnd.frontend_zero_shot`` does.

Prompt work is split in two so a bulk run can overlap it with synthesis:

* ``load(path)`` (CPU only, any thread, never touches CUDA): hash the file's bytes, return the
  cached features if known, else read, validate, mix to mono, resample to 16 kHz (tokenizer,
  CAM++) and to the mel rate, and compute the Kaldi fbank (CAM++ input) with the reference
  arithmetic (see ``frontend_models.device`` for why it is not recomputed on the GPU);
* ``features(loaded)`` (the device part): whisper log-mel -> S3TokenizerV3, fbank -> CAM++ and
  the prompt mel, batched over all given prompts, then the token/mel alignment cut.

Backends: "torch" runs ``cosybatch.models`` S3TokenizerV3 / CAM++, loaded from the checkpoint's
ONNX files, batched on a device; "onnxruntime" runs the ONNX files themselves one prompt at a
time on the CPU, exactly like the official frontend (the reference path). "auto" picks torch on
CUDA when the files have the official structure, else onnxruntime, and logs why in one line.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from cosybatch.audio import AudioError, load_audio
from cosybatch.models.config import ModelConfig
from cosybatch.frontend.cache import FORMAT, PromptCache, content_key, file_digest
from cosybatch.frontend.prompt_audio import ONNX_SAMPLE_RATE, PromptAudio, arrays_to_tensors
from cosybatch.frontend.torch_backend import RawFeatures
from cosybatch.prompt import PromptFeatures
from cosybatch.text.normalize import NORMALIZERS, TextNormalizer

log = logging.getLogger("cosybatch.frontend.frontend")

BACKENDS = ("auto", "onnxruntime", "torch")
_PATH_MEMO = 65536  # (path, size, mtime) -> content hash entries kept


@dataclass(frozen=True)
class TextInputs:
    prompt_text_ids: torch.Tensor  # LongTensor [N_prompt]
    segments: list[torch.Tensor]  # one LongTensor [N_s] per synthesised piece
    segment_texts: list[str]


@dataclass(frozen=True)
class LoadedPrompt:
    """A prompt after ``Frontend.load``: either its cached features or its resampled audio."""

    key: str  # content hash of the audio (file bytes, or samples + rate)
    source: str  # path, for messages
    wav16: torch.Tensor | None = None  # [1, n] float32 at 16 kHz
    wav_mel: torch.Tensor | None = None  # [1, m] float32 at the prompt-mel rate
    fbank: torch.Tensor | None = None  # [T, 80] mean-normalized Kaldi fbank (CAM++ input)
    cached: PromptFeatures | None = None

    @property
    def seconds(self) -> float:
        return 0.0 if self.wav16 is None else self.wav16.shape[-1] / ONNX_SAMPLE_RATE


def _choose_backend(model_dir: Path, cfg: ModelConfig, backend: str, device, dtype, onnx_cuda, onnx_threads, batch_kw):
    """-> (implementation, one-line reason, whether that choice is the expected one).
    An explicit "torch" raises instead of falling back."""
    from cosybatch.checkpoint.onnx_weights import FrontendModelError, load_campplus, load_s3tokenizer
    from cosybatch.frontend.torch_backend import TorchBackend
    from cosybatch.frontend.ort_backend import OrtBackend

    if backend not in BACKENDS:
        raise ValueError(f"unknown frontend backend {backend!r}; choose one of {BACKENDS}")
    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")

    def ort(reason: str, expected: bool = False):
        return OrtBackend(model_dir, cfg.mel, onnx_cuda, onnx_threads), reason, expected

    if backend == "onnxruntime":
        return ort("requested", True)
    if backend == "auto" and dev.type != "cuda":
        return ort("no CUDA device: onnxruntime on the CPU is the reference path", True)
    cuda = dev.type == "cuda" and torch.cuda.is_available()
    try:  # the tokenizer's ~1 GB of weights straight from the file to the GPU
        tok = load_s3tokenizer(model_dir / "speech_tokenizer_v3.onnx", device=dev if cuda else None)
        cam = load_campplus(model_dir / "campplus.onnx")
    except (FrontendModelError, FileNotFoundError) as e:
        if backend == "torch":
            raise
        return ort(str(e))
    if dev.type == "cuda" and not cuda:
        if backend == "torch":
            raise RuntimeError("frontend backend 'torch' on cuda: CUDA is not available")
        return ort("CUDA is not available")
    impl = TorchBackend(tok, cam, cfg.mel, dev, dtype=dtype, **batch_kw)
    return impl, "the ONNX files have the S3TokenizerV3 / CAM++ structure", True


class Frontend:
    """Prompt features and text ids for CosyVoice3 zero-shot synthesis.

    Prompt features are cached by audio content (a bounded LRU, plus ``disk_cache`` if given);
    returned tensors are CPU copies the caller may modify.

    Thread safety: ``load`` / ``load_waveform`` may run concurrently on worker threads and only
    use the CPU. ``features`` / ``prompt`` may be called from any thread; device work is
    serialised internally (one batch at a time, on the calling thread's current CUDA stream).
    """

    def __init__(
        self,
        model_dir: str | Path,
        cfg: ModelConfig,
        tokenizer=None,
        *,
        backend: str = "auto",
        device: str | torch.device | None = None,
        dtype: torch.dtype = torch.float32,
        onnx_cuda: bool = False,
        onnx_threads: int = 1,
        cache_size: int = 256,
        cache_bytes: int = 256 << 20,
        disk_cache: str | Path | None = None,
        max_batch: int = 64,
        max_batch_tokens: int = 16384,
        bucket_s: float = 0.5,
        batch_bucket_s: float | None = None,
        fbank: str = "cpu",
        warmup: bool = True,
        split_tf32: bool = False,
        row_bucket: int = 1,
        graph_rows: int = 4,
        text_normalizer: TextNormalizer = "wetext",
    ):
        self.model_dir = Path(model_dir)
        # The profile's text.normalizer ("none" for runs compared with the fixtures).
        if text_normalizer not in NORMALIZERS:
            raise ValueError(f"text_normalizer must be one of {', '.join(NORMALIZERS)}, got {text_normalizer!r}")
        self.text_normalizer = text_normalizer
        # A HelperProcess running wetext outside this process (set by synth's fast engine, whose GPU
        # thread would otherwise wait on the GIL while a worker normalises); closed with the frontend.
        self.text_helper = None
        # A HelperPool reading prompt audio outside this process (set by the fast engine under
        # ``frontend.audio=process``, design.md D32); closed with the frontend.
        self.audio_helpers = None
        self.cfg = cfg
        self._tokenizer = tokenizer
        if fbank not in ("cpu", "device"):
            raise ValueError(f"fbank must be 'cpu' (reference arithmetic, in load) or 'device', got {fbank!r}")
        self._fbank_in_load = fbank == "cpu"
        batch_kw = {"max_batch": max_batch, "max_batch_tokens": max_batch_tokens, "bucket_s": bucket_s,
                    "split_tf32": split_tf32, "row_bucket": row_bucket, "batch_bucket_s": batch_bucket_s,
                    "graph_rows": graph_rows}
        self._impl, reason, expected = _choose_backend(self.model_dir, cfg, backend, device, dtype, onnx_cuda,
                                                       onnx_threads, batch_kw)
        self.backend = "onnxruntime" if type(self._impl).__name__ == "OrtBackend" else "torch"
        self.backend_reason = reason
        log.log(logging.INFO if expected else logging.WARNING, "frontend: %s (%s)", self._impl.describe(), reason)
        self.tokenizer_mels = self._impl.n_mels
        self.campplus_mels = self._impl.fbank_bins
        self._audio = PromptAudio(cfg.sample_rate, cfg.mel.n_fft, cfg.mel.hop_size,
                                  self.campplus_mels if self._fbank_in_load else 0)
        namespace = self._disk_namespace(dtype) if disk_cache is not None else "none"
        self._cache = PromptCache(cache_size, cache_bytes, disk_cache, namespace)
        self._inflight: dict[str, PendingFeatures] = {}  # key -> the launch computing it
        self._inflight_lock = threading.Lock()
        self._paths: OrderedDict[tuple, str] = OrderedDict()
        self._paths_lock = threading.Lock()
        if warmup:
            self.warmup()

    def warmup(self) -> None:
        """On a CUDA device: lazy CUDA set-up and every length bucket's plans and graphs now,
        not on a prompt (nothing to do for onnxruntime)."""
        if self.backend == "torch" and self._impl.device.type == "cuda":
            self._impl.warmup()

    def prime(self) -> None:
        """On a CUDA device: the one-time set-up of a process's first launch now, with one small
        eager launch (``TorchBackend.prime``); nothing to do for onnxruntime or on a CPU."""
        if self.backend == "torch" and self._impl.device.type == "cuda":
            self._impl.prime()

    @property
    def bfloat16(self) -> bool:
        """Whether prompt features come from the bfloat16 GPU models, whose codes differ from the
        reference's at ~8 % of positions (every float32 path gives the reference's codes)."""
        return self.backend == "torch" and self._impl.dtype == torch.bfloat16

    def _disk_namespace(self, dtype: torch.dtype) -> str:
        """Disk entries are only valid for these exact models, features and numerics."""
        h = hashlib.blake2b(digest_size=12)
        precision = ("reference" if self.backend == "onnxruntime" else
                     f"torch-{dtype}-split-tf32-{self._impl.split_tf32}-fbank-in-load-{self._fbank_in_load}")
        for part in (FORMAT, precision, repr(self.cfg.mel), self.cfg.sample_rate, self.cfg.flow.token_mel_ratio,
                     file_digest(self.model_dir / "speech_tokenizer_v3.onnx"), file_digest(self.model_dir / "campplus.onnx")):
            h.update(str(part).encode() + b"\0")
        return h.hexdigest()

    # ---- text -------------------------------------------------------------------------
    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from cosybatch.text.tokenizer import CosyVoice3Tokenizer

            self._tokenizer = CosyVoice3Tokenizer.from_dir(self.model_dir / "CosyVoice-BlankEN")
        return self._tokenizer

    def prepare(self, prompt_transcript: str, target_text: str) -> TextInputs:
        """Prompt text ids (with the CV3 system prefix) and the target split into pieces."""
        from cosybatch.text.normalize import prompt_text_for, split_target_text

        tok = self.tokenizer
        prompt_ids = torch.tensor(tok.encode(prompt_text_for(prompt_transcript)), dtype=torch.long)
        texts = list(split_target_text(target_text, tok, normalizer=self.text_normalizer, helper=self.text_helper))
        if not texts:
            raise ValueError(f"target text has nothing to synthesise: {target_text!r}")
        segments = [torch.tensor(tok.encode(t), dtype=torch.long) for t in texts]
        return TextInputs(prompt_text_ids=prompt_ids, segments=segments, segment_texts=texts)

    # ---- audio: CPU part ----------------------------------------------------------------
    def _content_key(self, path: Path) -> str:
        try:
            st = os.stat(path)
        except OSError as e:
            raise AudioError(f"audio file not found: {path}") from e
        memo = (str(path.resolve()), st.st_size, st.st_mtime_ns)
        with self._paths_lock:
            key = self._paths.get(memo)
            if key is not None:
                self._paths.move_to_end(memo)
                return key
        try:
            key = content_key(path.read_bytes())
        except OSError as e:
            raise AudioError(f"cannot read audio file {path}: {e}") from e
        with self._paths_lock:
            self._paths[memo] = key
            while len(self._paths) > _PATH_MEMO:
                self._paths.popitem(last=False)
        return key

    def load(self, wav_path: str | Path) -> LoadedPrompt:
        """CPU part of a prompt (thread-safe, no CUDA): cached features, or validated audio."""
        path = Path(wav_path)
        key = self._content_key(path)
        hit = self._cache.get(key)
        if hit is not None:
            return LoadedPrompt(key, str(path), cached=hit)
        if self.audio_helpers is not None:
            return LoadedPrompt(key, str(path), *arrays_to_tensors(self.audio_helpers.run(self._audio.read, str(path))))
        wav, sr = load_audio(path)
        return self._prepare(wav, sr, key, str(path))

    def load_waveform(self, wav: torch.Tensor, sample_rate: int, source: str = "<waveform>") -> LoadedPrompt:
        """``load`` for decoded audio [channels, n] (or [n]); keyed by its samples and rate."""
        wav = torch.as_tensor(wav, dtype=torch.float32)
        wav = wav[None] if wav.dim() == 1 else wav
        key = content_key(f"{int(sample_rate)}:{tuple(wav.shape)}:".encode() + wav.contiguous().numpy().tobytes())
        hit = self._cache.get(key)
        if hit is not None:
            return LoadedPrompt(key, source, cached=hit)
        return self._prepare(wav, int(sample_rate), key, source)

    def _prepare(self, wav: torch.Tensor, sr: int, key: str, source: str) -> LoadedPrompt:
        return LoadedPrompt(key, source, *self._audio.tensors(wav, sr, source))

    # ---- audio: device part -------------------------------------------------------------
    def features(self, prompts: Sequence[LoadedPrompt]) -> list[PromptFeatures]:
        """Features of loaded prompts, in order; the uncached ones computed as one batch."""
        return self.launch_features(prompts).result()

    def launch_features(self, prompts: Sequence[LoadedPrompt]) -> "PendingFeatures":
        """``features`` in two halves: the uncached prompts' device work is queued now (computed
        now by a frontend without a device), ``result()`` of the returned object reads it back,
        ``ready()`` says, without waiting, whether that read would wait."""
        known: dict[int, PromptFeatures] = {}
        todo: dict[str, list[int]] = {}
        elsewhere: dict[int, tuple[PendingFeatures, LoadedPrompt]] = {}
        with self._inflight_lock:  # held only to sort the prompts, never while computing them
            for i, p in enumerate(prompts):
                hit = p.cached if p.cached is not None else self._cache.peek(p.key)
                if hit is not None:
                    known[i] = hit.clone()
                elif p.key in self._inflight:  # an earlier launch computes it (bulk runs repeat prompts)
                    elsewhere[i] = (self._inflight[p.key], p)
                else:
                    todo.setdefault(p.key, []).append(i)
            first = [prompts[idx[0]] for idx in todo.values()]
            pending = PendingFeatures(self, len(prompts), known, first, list(todo.values()), elsewhere)
            self._inflight.update((p.key, pending) for p in first)
        try:
            raws = None
            if first:
                launch = getattr(self._impl, "launch", None)
                raws = launch(*self._inputs(first)) if launch is not None else _Done(self._compute(first))
        except BaseException as e:
            pending._launched(None, e)
            raise
        pending._launched(raws)
        return pending

    def _landed(self, pending: "PendingFeatures") -> None:
        """``pending``'s prompts are cached (or failed): later launches compute them anew."""
        with self._inflight_lock:
            for p in pending.computes:
                if self._inflight.get(p.key) is pending:
                    del self._inflight[p.key]

    def raw_features(self, prompts: Sequence[LoadedPrompt]) -> list[RawFeatures]:
        """Uncached features before the token/mel cut (all codes), for checks and benchmarks."""
        if any(p.wav16 is None for p in prompts):
            raise ValueError("raw_features needs prompts loaded with their audio (not from the cache)")
        return self._compute(prompts)

    def _compute(self, prompts: Sequence[LoadedPrompt]) -> list[RawFeatures]:
        return self._impl.compute(*self._inputs(prompts))

    @staticmethod
    def _inputs(prompts: Sequence[LoadedPrompt]) -> tuple:
        fbank = [p.fbank for p in prompts]
        if any(f is None for f in fbank):
            fbank = None  # computed by the device part
        return [p.wav16 for p in prompts], [p.wav_mel for p in prompts], fbank

    def prompt(self, wav_path: str | Path) -> PromptFeatures:
        """``features([load(wav_path)])[0]``: one prompt, cached."""
        return self.features([self.load(wav_path)])[0]

    def extract(self, wav_path: str | Path) -> PromptFeatures:
        """Uncached ``prompt``."""
        wav, sr = load_audio(wav_path)
        p = self._prepare(wav, sr, "", str(wav_path))
        return self._align_raw(self._compute([p])[0], str(wav_path))

    def speech_tokens(self, wav16: torch.Tensor) -> torch.Tensor:
        """All codes of a [1, n] 16 kHz waveform (before the alignment cut)."""
        return self._impl.speech_tokens(wav16)

    def speaker_embedding(self, wav16: torch.Tensor) -> torch.Tensor:
        return self._impl.speaker_embedding(wav16)

    def _align_raw(self, raw: RawFeatures, what: str) -> PromptFeatures:
        return self.align(raw.tokens, raw.embedding, raw.mel, what)

    def align(self, tokens: torch.Tensor, embedding: torch.Tensor, mel: torch.Tensor, what="prompt") -> PromptFeatures:
        """Cut tokens and mel to a common length: n = min(frames // ratio, tokens)."""
        ratio = self.cfg.flow.token_mel_ratio
        n = min(int(mel.shape[1] / ratio), int(tokens.shape[0]))
        if n <= 0:
            raise AudioError(f"{what}: prompt too short to give any speech token")
        return PromptFeatures(
            speech_tokens=tokens[:n].contiguous(),
            embedding=embedding,
            mel=mel[:, : ratio * n].contiguous(),
        )

    # ---- cache --------------------------------------------------------------------------
    def cache_stats(self) -> dict:
        return dict(self._cache.stats, entries=len(self._cache))

    def clear_cache(self) -> None:
        self._cache.clear()
        with self._paths_lock:
            self._paths.clear()

    def graph_stats(self) -> dict | None:
        """The GPU frontend's CUDA-graph cache counters (None without one)."""
        graphs = getattr(self._impl, "graphs", None)
        return graphs.stats.as_dict() if graphs is not None else None

    def close(self) -> None:
        """Write the pending disk-cache entries and stop the writer (call at the end of a run;
        the in-memory cache stays usable; text is normalised in this process from then on)."""
        self._cache.close()
        for helper in (self.text_helper, self.audio_helpers):
            if helper is not None:
                helper.close()
        self.text_helper = self.audio_helpers = None


class _Done:
    """Results already computed (a frontend without a device)."""

    def __init__(self, raws: list[RawFeatures]):
        self._raws = raws

    def ready(self) -> bool:
        return True

    def result(self) -> list[RawFeatures]:
        return self._raws


class PendingFeatures:
    """What ``Frontend.launch_features`` returns: the features of its prompts, in order, once
    ``result()`` is called (which caches the newly computed ones). Prompts an earlier launch
    still computes are taken from it (``elsewhere``), not computed twice."""

    def __init__(self, frontend: Frontend, n: int, known: dict, first: list, where: list, elsewhere: dict):
        self._fe, self._n, self._known, self._where = frontend, n, known, where
        self.computes = first  # the prompts this launch computes, one per key
        self._elsewhere = elsewhere  # index -> (the launch computing it, the prompt)
        self._features: dict[str, PromptFeatures] | None = None
        # Set once the launch has queued (or, without a device, computed) its prompts: another
        # thread's launch that takes a prompt from this one waits for that, not for a lock.
        self._raws, self._error, self._queued = None, None, threading.Event()

    def _launched(self, raws, error: BaseException | None = None) -> None:
        self._raws, self._error = raws, error
        if error is not None:
            self._fe._landed(self)
        self._queued.set()

    def ready(self) -> bool:
        return (self._queued.is_set() and (self._raws is None or self._raws.ready())
                and all(o.ready() for o, _ in self._elsewhere.values()))

    def _own(self) -> dict[str, PromptFeatures]:
        """This launch's computed features by key (read, cached and released once)."""
        self._queued.wait()
        if self._error is not None:
            raise self._error
        if self._features is None:
            try:
                raws = self._raws.result() if self._raws is not None else []
                self._features = {p.key: self._fe._align_raw(raw, p.source) for p, raw in zip(self.computes, raws)}
                for key, feats in self._features.items():
                    self._fe._cache.put(key, feats)
            finally:
                self._fe._landed(self)
        return self._features

    def result(self) -> list[PromptFeatures]:
        out: list[PromptFeatures | None] = [None] * self._n
        for i, f in self._known.items():
            out[i] = f
        own = self._own()
        for p, idx in zip(self.computes, self._where):
            for i in idx:
                out[i] = own[p.key].clone()
        for i, (owner, p) in self._elsewhere.items():
            try:
                out[i] = owner._own()[p.key].clone()
            except Exception:  # the launch that computed it failed: compute it here, alone
                out[i] = self._fe._align_raw(self._fe._compute([p])[0], p.source)
        return out  # type: ignore[return-value]


__all__ = ["Frontend", "LoadedPrompt", "PromptFeatures", "TextInputs", "AudioError", "BACKENDS"]
