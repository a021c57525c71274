"""``cosybatch check``: what ``synth`` would do, found out without synthesizing."""

from __future__ import annotations

from pathlib import Path

from cosybatch.manifest import Manifest, ManifestRow
from cosybatch.output.audio_files import audio_name
from cosybatch.run.resume import finished_rows
from cosybatch.run.sharding import Shard, estimated_cost

CHECKPOINT_FILES = ("cosyvoice3.yaml", "llm.pt", "flow.pt", "hift.pt",
                    "speech_tokenizer_v3.onnx", "campplus.onnx", "CosyVoice-BlankEN")


def describe_model(model: str) -> list[str]:
    """Resolve and read the checkpoint's config (no weights); raises with the reason if unusable."""
    from cosybatch.checkpoint import CheckpointError, load_config, resolve_model_dir

    model_dir = resolve_model_dir(model)
    missing = [f for f in CHECKPOINT_FILES if not (model_dir / f).exists()]
    if missing:
        raise CheckpointError(f"{model_dir} lacks {', '.join(missing)}")
    cfg = load_config(model_dir)
    q, dit = cfg.llm.qwen, cfg.flow.dit
    return [
        f"model: {model_dir}",
        f"  LLM: {q.num_hidden_layers} layers x {q.hidden_size} hidden, {cfg.llm.speech_token_size} speech tokens",
        f"  flow: DiT {dit.depth} x {dit.dim}, {cfg.flow.n_timesteps} steps, chunk {cfg.chunk_size} tokens",
        f"  HiFT: {cfg.hift.sampling_rate} Hz; output WAVs at {cfg.sample_rate} Hz",
    ]


def describe_text(model: str, path: str, rows: list[ManifestRow], normalizer: str) -> list[str]:
    """Each row's target as it will be synthesized: ``file:line: utt_id`` then its pieces, numbered
    (the checkpoint's tokenizer measures the English pieces; no weights are loaded)."""
    from cosybatch.checkpoint import resolve_model_dir
    from cosybatch.text import CosyVoice3Tokenizer, split_target_text

    tok = CosyVoice3Tokenizer.from_dir(resolve_model_dir(model) / "CosyVoice-BlankEN")
    lines = [f"text: normalizer {normalizer}"]
    for row in rows:
        pieces = split_target_text(row.target_text, tok, normalizer=normalizer)
        lines.append(f"{path}:{row.line}: {row.utt_id}: {len(pieces)} segment(s)")
        lines.extend(f"  {i}. {p}" for i, p in enumerate(pieces, 1))
    return lines


def _already_done(rows: list[ManifestRow], out_dir: Path) -> int:
    """Rows an earlier run finished with these inputs (settings are checked only by synth)."""
    return len(finished_rows(rows, out_dir))


def describe_plan(man: Manifest, rows: list[ManifestRow], shard: Shard, out_dir: Path | None) -> list[str]:
    bad_lines = len(man.problems_by_line())
    lines = [f"manifest: {man.path}: {len(man.rows)} valid row(s), {bad_lines} line(s) with problems"]
    if shard.count > 1:
        lines.append(f"shard {shard}: {len(rows)} of the valid rows")
    prompt_s = sum(r.prompt_s for r in rows)
    lines.append(f"prompts: {len({r.prompt_wav for r in rows})} distinct file(s), {prompt_s:.1f} s in all; "
                 f"estimated cost {sum(estimated_cost(r) for r in rows):.1f} (prompt s + text/15)")
    todo = len(rows)
    if out_dir is not None and out_dir.is_dir():
        done = _already_done(rows, out_dir)
        todo -= done
        lines.append(f"{out_dir}: {done} row(s) already done with the same inputs "
                     "(skipped if the model and settings also match)")
    lines.append(f"synth would synthesize {todo} row(s) into <out>/{audio_name('<utt_id>')} (or --format's suffix)"
                 + (f" and skip {bad_lines} invalid line(s)" if bad_lines else ""))
    return lines
