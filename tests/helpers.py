"""Helpers several test modules share: the fixture rows, draining a pipeline, the official outputs
and the check against them, running the AR engine alone and together, a mixed step's plan, a
CUDA-graph stand-in and a record of which CUDA stream is current."""

import contextlib
import json

from conftest import ROWS, load_ref
from cosybatch.engine import LLMEngine

# The fast path in float32 (parity with the fixtures) with no CUDA graphs
FP32 = ["ar.dtype=float32", "codec.flow_dtype=float32", "ar.cuda_graphs=false"]


def fixture_rows(fixtures_dir):
    from cosybatch.manifest import ManifestRow

    rows = []
    for line in (fixtures_dir / "prompts" / "meta.lst").read_text().strip().splitlines():
        utt, pt, wav, tt = line.split("|")
        rows.append(ManifestRow(utt, pt, fixtures_dir / "prompts" / wav, tt))
    return rows


class Together:
    """Steps a pipeline only once every request's prompt work is done, so all rows are admitted
    (and prefilled) in the same step: packed calls then hold several rows, deterministically."""

    def __init__(self, pipe):
        self.pipe, self.sample_rate = pipe, pipe.sample_rate

    def add_request(self, req):
        self.pipe.add_request(req)

    def has_work(self):
        return self.pipe.has_work()

    def step(self):
        for _, fut in list(self.pipe.prompts.preparing.values()):
            fut.exception()  # waits
        return self.pipe.step()


def drain(pipe, requests, force_tokens=None, together=False):
    """Run (request id, row, stream) requests to the end through the shared driver loop:
    (chunks per id, the final Event per id)."""
    from cosybatch.scheduler.protocol import Event, SynthRequest, drive

    reqs = [SynthRequest(rid, row, stream, force_tokens) for rid, row, stream in requests]
    chunks, ends = {}, {}
    for f in drive(Together(pipe) if together else pipe, reqs, max(1, len(reqs))):
        rid = f.request.request_id
        chunks[rid] = [a for _, a in f.chunks]
        ends[rid] = Event(rid, "error" if f.error else "done", error=f.error, tokens=f.tokens)
    return chunks, ends


def official(reference_dir, stream: bool) -> tuple[dict, dict]:
    """The official implementation's (flow tokens per (utt, segment), waveform per chunk per utt)."""
    toks, waves = {}, {}
    for row in ROWS:
        ref = load_ref(reference_dir, row)
        meta = json.loads((reference_dir / f"{row}.json").read_text())
        if stream:
            names = [f"stream.seg{c['segment']}.chunk{c['chunk']}" for c in meta["stream_chunks"]]
        else:
            names = [f"nonstream.seg{s}" for s in range(len(meta["segments"]))]
        waves[row] = [ref[f"{n}.wav"][0].numpy() for n in names]
        mode = "stream" if stream else "nonstream"
        for s in range(len(meta["segments"])):
            toks[(row, s)] = ref[f"{mode}.seg{s}.speech_token"].tolist()  # the flow's input
    return toks, waves


def assert_official_chunks(chunks: dict, want: dict, tag: tuple = ()) -> None:
    """Every fixture row gave the official chunks (``official``'s waves): as many, as long, each
    within tests/parity.py's bounds (why SNR and a phase-tolerant max)."""
    from parity import assert_wave_close

    for row in ROWS:
        assert [len(c) for c in chunks[row]] == [len(w) for w in want[row]], (*tag, row)
        for i, (got, w) in enumerate(zip(chunks[row], want[row])):
            assert_wave_close(got, w, (*tag, row, i))


def run_together(eng: LLMEngine, reqs: list[dict], order: list[int]) -> list[list[int]]:
    ids = {i: eng.add_request(**reqs[i], request_id=f"r{i}") for i in order}
    eng.run()
    return [eng.seqs[ids[i]].tokens for i in range(len(reqs))]


def run_alone(eng: LLMEngine, reqs: list[dict]) -> list[list[int]]:
    out = []
    for i, r in enumerate(reqs):
        rid = eng.add_request(**r, request_id=f"a{i}")
        eng.run()
        out.append(eng.seqs[rid].tokens)
    return out


def mixed_plan(eng: LLMEngine, decoding: dict, joining: dict):
    """The plan of a mixed step (design.md D33): ``decoding`` prefilled and decoded once, then
    ``joining`` admitted beside it (its row bound, as ``mixed_launch`` binds it)."""
    eng.add_request(**decoding, request_id="x")
    eng.step()
    eng.step()
    eng.add_request(**joining, request_id="y")
    plan = eng.scheduler.schedule()
    assert plan.kind == "mixed" and [s.request_id for s in plan.decode] == ["x"]
    for s in plan.seqs:
        eng.runner.bind(s, s.row)
    return plan


def record_current_stream(monkeypatch) -> list:
    """Replace ``torch.cuda.stream`` by a context manager that only sets the returned one-item
    list to the stream it is given (None outside): which stream code would have made current,
    on a CPU."""
    import torch

    current = [None]

    @contextlib.contextmanager
    def stream(s):
        before, current[0] = current[0], s
        try:
            yield
        finally:
            current[0] = before

    monkeypatch.setattr(torch.cuda, "stream", stream)
    return current


class FakeCaptured:
    """Like a CUDA graph: replay recomputes into the same output buffer."""

    def __init__(self, fn, inputs):
        self.fn = fn
        self.static_inputs = [x.clone() for x in inputs]
        out = fn(*self.static_inputs)  # the warm-up call, eager, like CudaGraphBackend's
        self.static_output = tuple(t.clone() for t in out) if isinstance(out, tuple) else out.clone()
        self.warm_output = out
        self.replays = 0

    def replay(self):
        out = self.fn(*self.static_inputs)
        for dst, src in zip(*((self.static_output, out) if isinstance(out, tuple) else ((self.static_output,), (out,)))):
            dst.copy_(src)
        self.replays += 1


class FakeBackend:
    def __init__(self, fail_if=None):
        self.fail_if = fail_if or (lambda inputs: False)
        self.captures = 0
        self.released = 0

    def capture(self, fn, inputs):
        if self.fail_if(inputs):
            raise RuntimeError("injected capture failure")
        self.captures += 1
        return FakeCaptured(fn, inputs)

    def release(self, captured):
        self.released += 1


def signal_when_ready(proc, ready, sig, timeout: float):
    """Wait for ``ready()`` (it raises if the process gave up), send ``sig``, then collect the
    process's stderr; a process still running past ``timeout`` (or after a failed wait) is
    killed, so no test leaves one behind."""
    try:
        ready()
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return err


def solve_in_turn(runner, rows):
    """The mels of ``solve_beside``'s work done one solve after another: rows 0 and 1's first
    and second hops, then row 2's first hop."""
    from cosybatch.codec.flow_runner import FlowJob

    (a, pa, ta, ca), (b, pb, tb, cb), (c, pc, tc, cc) = rows[:3]
    runner.run([FlowJob(a, ta, pa, ca[0]), FlowJob(b, tb, pb, cb[0])])
    return runner.run([FlowJob(a, ta, pa, ca[1]), FlowJob(b, tb, pb, cb[1])]) + runner.run([FlowJob(c, tc, pc, cc[0])])


def solve_beside(runner, rows, fill: bool = False, same_shape_first: bool = False):
    """Rows 0 and 1's second hops (their prefixes in the arena) part-way through one solve, row
    2's first hop started, stepped and finished beside it (``FlowRunner.start(beside=...)``),
    then the first solve ended. Rows are (name, prompt, tokens, chunks). Returns the mels as
    ``solve_in_turn`` orders them, whether the beside start moved the arena, the graphs it
    captured, and both solves. ``fill``: the arena's free frames taken first (only growing it
    would make room); ``same_shape_first``: row 2's first hop solved once before under another
    name (its graph bucket captured, where there are graphs)."""
    import torch

    from cosybatch.codec.flow_runner import FlowJob

    (a, pa, ta, ca), (b, pb, tb, cb), (c, pc, tc, cc) = rows[:3]
    if same_shape_first:
        runner.run([FlowJob("same shape", tc, pc, cc[0])])
        runner.release("same shape")
    runner.run([FlowJob(a, ta, pa, ca[0]), FlowJob(b, tb, pb, cb[0])])
    main = runner.start([FlowJob(a, ta, pa, ca[1]), FlowJob(b, tb, pb, cb[1])])
    main.step(3)
    while fill and runner.cache.reserve(("filler", runner.cache.used_frames()), 8, torch.zeros(1), grow=False):
        pass
    version = runner.cache.version
    captures = runner.graphs.stats.captures if runner.graphs is not None else 0
    beside = runner.start([FlowJob(c, tc, pc, cc[0])], beside=main)
    moved = runner.cache.version != version
    beside.step(runner.n_steps)
    first = beside.finish()
    captured = (runner.graphs.stats.captures if runner.graphs is not None else 0) - captures
    main.step(runner.n_steps)
    return main.finish() + first, moved, captured, main, beside
