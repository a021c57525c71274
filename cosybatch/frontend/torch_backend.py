"""The prompt frontend's device part: features, S3TokenizerV3 and CAM++ batched on one device.

Rows are sorted by length and cut into chunks (at most ``max_batch`` rows and
``max_batch_tokens`` padded 25 Hz tokens each) to bound padding and transient memory; each chunk
is one padded batch through whisper log-mel -> tokenizer, fbank -> CAM++ and the prompt mel,
then copied to the host once. Results come back in input order.

Latency: a chunk's padded length is rounded up to a multiple of ``bucket_s`` (the models mask
padding exactly, so this changes no result). Prompt lengths then repeat, and so do the tensor
shapes cuDNN/cuFFT plan for: with ``warmup`` run over every bucket once, a later prompt of any
length meets already-planned shapes. Every length is known on the host before a chunk starts
and host<->device copies go through pinned buffers, so nothing waits on the device until the
results are read: ``launch`` queues the work and the copies back and returns at once (the
pipeline reads them an iteration later, so its frontend slices never drain the GPU's queue),
``compute`` waits for them. On CUDA, chunks of at most ``graph_rows`` prompts (the latency case: prompts
trickling in one by one) replay a CUDA graph per shape instead of launching ~1,200 kernels:
the graph runs the masked (padded) path of every model, which the batched path already runs
for every row shorter than its chunk's longest, and returns codes, embedding and mel packed in
one tensor, so one copy brings them back. Such chunks are padded to a power of two of rows
(copies of their last prompt, whose results are dropped), so the shapes -- and the graphs
``warmup`` captures -- stay few: 1 row at every length bucket, 2 and 4 rows up to 10 s. A chunk
of more than ``SMALL_ROWS`` prompts (a bulk run's, graphed or not) pads its length to
``batch_bucket_s`` instead, so that coarser buckets make its shapes repeat.

Precision is the frontend's own: its device work runs with strict float32 convolutions and
GEMMs whatever the process's TF32 switches say (the profiles turn cuDNN TF32 on for HiFT, and
a TF32 convolution in the tokenizer moves codes), except, with ``split_tf32``, the tokenizer
blocks' linears, which run as three TF32 GEMMs each: float32-grade results at tensor-core speed.

The Kaldi fbank (CAM++ input) normally arrives precomputed by the CPU part, with the reference
function: the log energy of a low-energy band is limited by float32 FFT rounding, so the
official fbank is itself only good to ~1e-3 there, and any other computation of it (a GPU FFT,
or even a float64 one) moves full-size CAM++ embeddings by ~1e-4 from the official ones. When
it is not given it is computed here, in float64.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from cosybatch.audio.features import WHISPER_HOP
from cosybatch.models.config import MelConfig
from cosybatch.frontend.split_tf32 import split_linears
from cosybatch.frontend.batch_features import (KALDI_FRAME, KALDI_SHIFT, kaldi_fbank_batch, pad_frames, pad_rows,
                                                prompt_mel_batch, whisper_log_mel_batch)
from cosybatch.gpu.graph_cache import GraphCache
from cosybatch.models.campplus import CAMPPlus
from cosybatch.models.campplus_fast import CAMPPlusFast
from cosybatch.models.s3tokenizer import S3TokenizerV3, token_lengths
from cosybatch.gpu.runtime import float32_math, triton_available
from cosybatch.gpu.streams import on_stream

SAMPLE_RATE = 16000


@dataclass(frozen=True)
class RawFeatures:
    """One prompt before the token/mel alignment cut (CPU tensors)."""

    tokens: torch.Tensor  # long [ceil(T/4)]: every code the tokenizer gives
    embedding: torch.Tensor  # float32 [1, 192]
    mel: torch.Tensor  # float32 [1, F, num_mels]


class PendingRaw:
    """Features whose device work is queued: ``ready()`` polls (never waits), ``result()``
    waits for the copies back and returns the features in input order."""

    def __init__(self, n: int, chunks: list, done):
        self._n, self._chunks, self._done = n, chunks, done

    def ready(self) -> bool:
        return self._done is None or self._done.query()

    def result(self) -> list[RawFeatures]:
        if self._done is not None:
            self._done.synchronize()
        out: list[RawFeatures | None] = [None] * self._n
        for rows, flat, finish in self._chunks:
            for i, r in zip(rows, finish(flat)):
                out[i] = r
        return out  # type: ignore[return-value]


# The warm-up's largest chunk: a chunk of at most this many prompts (prompts trickling in) pads its
# length to ``bucket_s``, the shapes the warm-up covers; a larger one to ``batch_bucket_s``.
SMALL_ROWS = 4


class TorchBackend:
    def __init__(self, tokenizer: S3TokenizerV3, campplus: CAMPPlus, mel_cfg: MelConfig, device,
                 dtype: torch.dtype = torch.float32, max_batch: int = 64, max_batch_tokens: int = 16384,
                 bucket_s: float = 0.5, graph_rows: int = 4, graph_capacity: int = 128, split_tf32: bool = False,
                 overlap: bool = True, row_bucket: int = 1, batch_bucket_s: float | None = None):
        """``split_tf32`` (float32 on CUDA only): the tokenizer blocks' linears as three TF32
        GEMMs each (``frontend_models.split_tf32``); everything else stays strict float32, whatever the
        process's TF32 switches say. ``overlap``: CAM++ beside the tokenizer on CUDA (same
        results: the same kernels, only concurrent). ``row_bucket``: chunks too large for a graph
        are padded to a multiple of this many rows, like graphed ones to a power of two, so their
        shapes repeat (each new shape costs the host the planning of its convolutions);
        ``batch_bucket_s``: chunks of more than ``SMALL_ROWS`` prompts pad their length to a
        multiple of this many seconds (None: ``bucket_s``, the smaller chunks' and the warm-up's)."""
        self.device = torch.device(device)
        self.dtype = dtype
        self.mel_cfg = mel_cfg
        self.tokenizer = tokenizer.to_mixed(self.device, dtype).eval()
        self.split_tf32 = split_tf32 and dtype == torch.float32 and self.device.type == "cuda"
        if self.split_tf32:  # the FSQ projection (dim -> 8) stays strict: it is tiny
            split_linears(self.tokenizer.blocks)
        taps_gate = None
        if self.device.type == "cuda" and triton_available():  # a dense layer's tail as one kernel (D40)
            from cosybatch.frontend.triton_kernels import cam_taps_gate as taps_gate
        self.campplus = CAMPPlusFast(campplus, taps_gate).to(device=self.device, dtype=dtype).eval()
        self.max_batch = max(1, int(max_batch))
        self.max_batch_tokens = max(1, int(max_batch_tokens))
        self.bucket_s = float(bucket_s)
        self.batch_bucket_s = self.bucket_s if batch_bucket_s is None else float(batch_bucket_s)
        self.row_bucket = max(1, int(row_bucket))
        self._pinned = self.device.type == "cuda"
        # CUDA: CAM++ runs on a side stream beside the tokenizer (and in the same graph). A few
        # prompts at a time leave most SMs idle in both models (measured, batch 1, graphed:
        # tokenizer 4.3 ms, CAM++ 3.0 ms), so together they take about as long as the tokenizer.
        self._side = torch.cuda.Stream(self.device) if self.device.type == "cuda" and overlap else None
        self._lock = threading.Lock()
        self.graph_rows = graph_rows if self.device.type == "cuda" else 0
        self.graphs = GraphCache(lambda *t: self._features(*t, True, True), capacity=graph_capacity,
                                 max_counters=graph_capacity,
                                 capture_after=1, name="frontend") if self.graph_rows else None

    @classmethod
    def from_dir(cls, model_dir: str | Path, mel_cfg: MelConfig, device, **kw) -> "TorchBackend":
        """Load both ONNX files into the PyTorch models (raises FrontendModelError)."""
        from cosybatch.checkpoint.onnx_weights import load_campplus, load_s3tokenizer

        d = Path(model_dir)
        return cls(load_s3tokenizer(d / "speech_tokenizer_v3.onnx"), load_campplus(d / "campplus.onnx"),
                   mel_cfg, device, **kw)

    @property
    def n_mels(self) -> int:
        return self.tokenizer.cfg.n_mels

    @property
    def fbank_bins(self) -> int:
        return self.campplus.cfg.feat_dim

    def describe(self) -> str:
        t, c = self.tokenizer.cfg, self.campplus.cfg
        precision = "float32, 3xTF32 GEMMs" if self.split_tf32 else str(self.dtype).replace("torch.", "")
        return (f"S3TokenizerV3 {t.layers}x{t.dim} ({t.heads} heads), CAM++ {'/'.join(map(str, c.block_layers))} "
                f"on {self.device} {precision}")

    # ---- batching -----------------------------------------------------------------------
    def _chunks(self, order: list[int], n16: list[int]) -> list[list[int]]:
        chunks, cur, longest = [], [], 0
        for i in order:
            tok = n16[i] // 640 + 1  # 25 Hz tokens of this row
            if cur and (len(cur) >= self.max_batch or max(longest, tok) * (len(cur) + 1) > self.max_batch_tokens):
                chunks.append(cur)
                cur, longest = [], 0
            cur.append(i)
            longest = max(longest, tok)
        return chunks + ([cur] if cur else [])

    def _bucket(self, n: int, rate: int, small: bool) -> int:
        seconds = self.bucket_s if small else self.batch_bucket_s
        step = max(1, int(round(seconds * rate))) if seconds > 0 else 1
        return int(math.ceil(n / step) * step)

    def compute(self, wav16: list[torch.Tensor], wav_mel: list[torch.Tensor],
                fbank: list[torch.Tensor] | None = None) -> list[RawFeatures]:
        """wav16: [1, n] float32 16 kHz rows; wav_mel: the same prompts at the mel's rate;
        fbank: their mean-normalized Kaldi fbanks [T, 80] (None: computed here)."""
        return self.launch(wav16, wav_mel, fbank).result()

    def launch(self, wav16: list[torch.Tensor], wav_mel: list[torch.Tensor],
               fbank: list[torch.Tensor] | None = None) -> PendingRaw:
        """``compute`` without the wait: every chunk's work and its copy back are queued on the
        current stream, behind what is queued already; the caller reads the results later."""
        n16 = [int(w.shape[-1]) for w in wav16]
        order = sorted(range(len(wav16)), key=lambda i: n16[i])
        chunks = []
        with self._lock, torch.inference_mode(), float32_math(False, False):
            for chunk in self._chunks(order, n16):
                fb = None if fbank is None else [fbank[i] for i in chunk]
                chunks.append((chunk, *self._batch([wav16[i] for i in chunk], [wav_mel[i] for i in chunk], fb)))
            done = None
            if self.device.type == "cuda" and chunks:
                done = torch.cuda.Event()
                done.record()
        return PendingRaw(len(wav16), chunks, done)

    # ---- transfers ----------------------------------------------------------------------
    def _host(self, numel: int, dtype: torch.dtype) -> torch.Tensor | None:
        """A pinned host buffer for one transfer (CUDA), else None. Fresh from PyTorch's caching
        host allocator each time: it hands a block out again only once the copies that used
        it have run, so queued transfers never share a buffer."""
        return torch.empty(numel, dtype=dtype, pin_memory=True) if self._pinned else None

    def _upload(self, x: torch.Tensor, lengths: torch.Tensor):
        return x.to(self.device, non_blocking=True), lengths.to(self.device, non_blocking=True)

    def _rows(self, rows: list[torch.Tensor], size: int):
        """-> (padded rows on the device, lengths on the device, lengths on the host)."""
        x, lengths = pad_rows(rows, size, self._host(len(rows) * max(size, max(r.shape[-1] for r in rows)), torch.float32))
        return (*self._upload(x, lengths), lengths)

    def _fbank(self, x16, l16, n16, rows: list[torch.Tensor] | None, frames: int):
        """-> (fbank [B, M, bins] on the device, frames on the device, frames on the host)."""
        if rows is None:
            fbank, dev_frames = kaldi_fbank_batch(x16.double(), l16, self.fbank_bins)
            return fbank, dev_frames, 1 + (n16 - KALDI_FRAME) // KALDI_SHIFT
        size = max(frames, max(r.shape[0] for r in rows))
        fb, n = pad_frames(rows, frames, self._host(len(rows) * size * rows[0].shape[1], torch.float32))
        return (*self._upload(fb, n), n)

    def _to_host(self, t: torch.Tensor) -> torch.Tensor:
        """Queue ``t``'s copy to the host (read it after the launch's event)."""
        if self.device.type != "cuda":
            return t
        host = self._host(t.numel(), t.dtype).view(t.shape)
        host.copy_(t, non_blocking=True)
        return host

    # ---- one chunk ------------------------------------------------------------------------
    def _features(self, x16, l16, fbank, fb_dev, xm, lm, pad_tok: bool, pad_fb: bool) -> torch.Tensor:
        """The device work of a chunk from its uploaded inputs, packed as float32: a header
        [B, code frames, embedding size, mel frames, mel bins], then codes (exact: < 3**8),
        embeddings, mels.
        Shapes follow from the input shapes alone (graph-capturable)."""
        main = torch.cuda.current_stream(self.device) if self._side is not None else None
        if main is not None:
            # Fork: CAM++ and the prompt mel on the side stream, beside the tokenizer. Every
            # side branch starts behind all work queued on ``main`` and ``main`` waits for it
            # before anything else, so memory freed on either side is never still in use.
            self._side.wait_stream(main)
        with on_stream(self._side):
            emb = self.campplus(fbank, fb_dev, padded=pad_fb).float()
            mel, _ = prompt_mel_batch(xm, lm, self.mel_cfg)
        feats, frames_dev = whisper_log_mel_batch(x16, l16, self.n_mels)
        codes, _ = self.tokenizer(feats, frames_dev, padded=pad_tok)
        if main is not None:
            main.wait_stream(self._side)  # join
        head = [torch.full((1,), float(v), device=x16.device) for v in (*codes.shape, emb.shape[1], *mel.shape[1:])]
        return torch.cat([*head, codes.flatten().float(), emb.flatten(), mel.flatten()])

    @staticmethod
    def _unpack(flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, t, e, f, m = (int(v) for v in flat[:5])
        codes, emb, mel = flat[5:].split([b * t, b * e, b * f * m])
        return codes.view(b, t).long(), emb.view(b, e), mel.view(b, f, m)

    def _batch(self, wav16: list[torch.Tensor], wav_mel: list[torch.Tensor], fbank_rows=None):
        """Queue one chunk -> (its packed result on its way to the host, the function that
        unpacks it into the chunk's RawFeatures once it is there)."""
        n = len(wav16)
        graphed = n <= self.graph_rows
        # padded with copies of the last prompt (the batched models treat rows independently)
        extra = (1 << (n - 1).bit_length()) - n if graphed else -n % self.row_bucket
        if extra:
            wav16, wav_mel = wav16 + wav16[-1:] * extra, wav_mel + wav_mel[-1:] * extra
            fbank_rows = None if fbank_rows is None else fbank_rows + fbank_rows[-1:] * extra
        small = n <= SMALL_ROWS
        size16 = self._bucket(max(int(w.shape[-1]) for w in wav16), SAMPLE_RATE, small)
        x16, l16, n16 = self._rows(wav16, size16)
        frames = n16 // WHISPER_HOP
        fb_size = 1 + (x16.shape[1] - KALDI_FRAME) // KALDI_SHIFT
        fbank, fb_dev, fb_frames = self._fbank(x16, l16, n16, fbank_rows, fb_size)
        cfg = self.mel_cfg
        xm, lm, nm = self._rows(wav_mel, self._bucket(max(int(w.shape[-1]) for w in wav_mel), cfg.sampling_rate, small))
        inputs = (x16, l16, fbank, fb_dev, xm, lm)
        if graphed:
            flat = self.graphs(*inputs)
        else:
            flat = self._features(*inputs, bool((frames < x16.shape[1] // WHISPER_HOP).any()),
                                  bool((fb_frames < fbank.shape[1]).any()))
        mel_frames = 1 + (nm + 2 * int((cfg.n_fft - cfg.hop_size) / 2) - cfg.n_fft) // cfg.hop_size
        code_len = token_lengths(frames)

        def finish(host: torch.Tensor) -> list[RawFeatures]:
            codes, emb, mel = self._unpack(host)
            return [RawFeatures(codes[i, : int(code_len[i])].clone(), emb[i : i + 1].clone(),
                                mel[i : i + 1, : int(mel_frames[i])].clone()) for i in range(n)]

        return self._to_host(flat), finish

    # ---- single-purpose helpers ---------------------------------------------------------------
    def speech_tokens(self, wav16: torch.Tensor) -> torch.Tensor:
        """Raw codes of one [1, n] 16 kHz prompt (no mel, no cut)."""
        with self._lock, torch.inference_mode(), float32_math(False, False):
            x, n, _ = self._rows([wav16], 0)
            feats, frames = whisper_log_mel_batch(x, n, self.n_mels)
            codes, code_len = self.tokenizer(feats, frames, padded=False)
            return codes[0, : int(code_len[0])].cpu()

    def speaker_embedding(self, wav16: torch.Tensor) -> torch.Tensor:
        """[1, 192] embedding of one [1, n] 16 kHz prompt (reference fbank on the CPU)."""
        from cosybatch.audio import kaldi_fbank

        fb = kaldi_fbank(wav16, num_mel_bins=self.fbank_bins)
        with self._lock, torch.inference_mode(), float32_math(False, False):
            frames = torch.tensor([fb.shape[0]], device=self.device)
            return self.campplus(fb[None].to(self.device), frames, padded=False).float().cpu()

    def prime(self, seconds: float = 1.0) -> None:
        """One small eager launch (one prompt more than a graph takes), waited for: what a
        process's first launch pays once -- the first load of each kernel, cuDNN's and cuBLAS's
        handles and workspaces, cuFFT's first plans -- paid now (on the calling thread: at
        start-up the frontend's loading thread, beside the models' loading). Nothing is captured
        and nothing is kept."""
        wav16, mel, fbank = self._synthetic_prompt(seconds)
        rows = self.graph_rows + 1
        self.compute([wav16] * rows, [mel] * rows, [fbank] * rows)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _synthetic_prompt(self, seconds: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``compute``'s inputs for one made-up prompt of ``seconds`` (16 kHz wave, mel-rate
        wave, fbank): what the warm-up and ``prime`` run the models on."""
        n = int(round(seconds * SAMPLE_RATE))
        wav16 = 1e-2 * torch.randn(1, n, generator=torch.Generator().manual_seed(n))
        return (wav16, torch.zeros(1, int(round(seconds * self.mel_cfg.sampling_rate))) + 1e-3,
                torch.zeros(1 + (n - KALDI_FRAME) // KALDI_SHIFT, self.fbank_bins))

    def warmup(self, max_seconds: float = 30.0) -> None:
        """One prompt of each length bucket up to ``max_seconds`` (exact bucket lengths: the
        unpadded path), chunks of 2 and 4 up to 10 s, then one padded pair: afterwards no prompt
        pays for lazy CUDA setup, a kernel's first load, a first cuDNN/cuFFT plan of its shape
        or (on CUDA) the capture of its graph."""
        step = self.bucket_s if self.bucket_s > 0 else max_seconds
        row = self._synthetic_prompt
        n_buckets = max(1, int(math.ceil(max_seconds / step)))
        for k in range(1, n_buckets + 1):
            a = row(min(k * step, max_seconds))
            self.compute([a[0]], [a[1]], [a[2]])
            for rows in (2, SMALL_ROWS):
                if rows <= self.graph_rows and k * step <= 10.0:
                    self.compute([a[0]] * rows, [a[1]] * rows, [a[2]] * rows)
        pair = [row(1.3), row(2.0)]
        self.compute(*[[r[i] for r in pair] for i in range(3)])
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


__all__ = ["TorchBackend", "PendingRaw", "RawFeatures"]
