"""TTS the way a pipeline embeds it: text and voice prompts in the release's request format,
per-request streams (async and sync) fed by one loop thread, a codec stage off that thread."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import wave
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hyloop.tts import ToneCodec, TTSEngine, TTSParams, TTSPrompt
from hyloop.tts.codec import decode_whole

CKPT = "nvq3_v16_l1"
EAGER = ["graphs.backend=eager", "kv_pool.page_size=4", "kv_pool.num_pages=1024"]
N_VQ, VOCAB = 3, 16


def voice(frames: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, (frames, N_VQ))


# ---------------------------------------------------------------------------------------------
# The release's processor, re-derived: MOSS-TTS-Local-Transformer-v1.5's
# ``_build_generation_or_voice_clone_codes`` (the path sglang-omni's request builder takes),
# written here against transformers' tokenizer, not hyloop's.


def release_rows(tok: Any, cfg: dict[str, Any], text: str, refs: list[np.ndarray], **f: Any) -> Any:
    import torch

    n_vq, pad = cfg["n_vq"], cfg["audio_pad_code"]

    def enc(s: str) -> list[int]:
        return list(tok.encode(s, add_special_tokens=False))

    def norm(v: Any) -> str:
        return "None" if v is None or not str(v).strip() else str(v).strip()

    def text_rows(ids: list[int]) -> torch.Tensor:
        rows = torch.full((len(ids), n_vq + 1), pad, dtype=torch.long)
        if ids:
            rows[:, 0] = torch.tensor(ids)
        return rows

    def audio_rows(codes: np.ndarray) -> torch.Tensor:
        rows = torch.full((len(codes), n_vq + 1), pad, dtype=torch.long)
        rows[:, 0] = cfg["audio_user_slot_token_id"]
        rows[:, 1:] = torch.from_numpy(codes)
        return rows

    after = (
        "\n- Instruction:\n" + norm(f.get("instruction"))
        + "\n- Tokens:\n" + norm(f.get("tokens"))
        + "\n- Quality:\n" + norm(f.get("quality"))
        + "\n- Sound Event:\n" + norm(f.get("sound_event"))
        + "\n- Ambient Sound:\n" + norm(f.get("ambient_sound"))
        + "\n- Language:\n" + norm(f.get("language"))
        + "\n- Text:\n"
    )  # fmt: skip
    prefix = [cfg["im_start_token_id"], *enc("user\n"), *enc("<user_inst>\n- Reference(s):\n")]
    closing = [
        *enc("\n</user_inst>"), cfg["im_end_token_id"], *enc("\n"),
        cfg["im_start_token_id"], *enc("assistant\n"), cfg["audio_start_token_id"],
    ]  # fmt: skip
    if not refs:
        return text_rows(prefix + enc("None") + enc(after) + enc(text) + closing).numpy()
    parts = [text_rows(prefix)]
    for codes in refs:
        parts += [
            text_rows([cfg["audio_start_token_id"]]),
            audio_rows(codes),
            text_rows([cfg["audio_end_token_id"]]),
        ]
    parts.append(text_rows(enc(after) + enc(text) + closing))
    return torch.cat(parts).numpy()


@pytest.fixture(scope="module")
def tts(moss_local_ckpts: dict[str, Path]) -> Any:
    with TTSEngine(moss_local_ckpts[CKPT], overrides=EAGER) as engine:
        yield engine


@pytest.mark.parametrize(
    ("text", "refs", "fields"),
    [
        ("Hello there, how are you today?", [], {}),
        ("The quick brown fox.", [voice(6, 1)], {"language": "en"}),
        ("A voice reads.", [voice(3, 2), voice(5, 3)], {"instruction": "calm", "tokens": 42}),
        ("", [voice(1, 4)], {"quality": "  ", "sound_event": "rain"}),
    ],
)
def test_prompt_rows_equal_the_release_processor(
    tts: TTSEngine, moss_local_ckpts: dict[str, Path], text: str, refs: list[Any], fields: Any
) -> None:
    from transformers import PreTrainedTokenizerFast

    path = moss_local_ckpts[CKPT]
    hf_tok = PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"))
    cfg = json.loads((path / "config.json").read_text())
    given = None if not refs else refs[0] if len(refs) == 1 else refs
    ours = tts.prompt_rows(text, given, **fields)
    expect = release_rows(hf_tok, cfg, text, refs, **fields)
    assert ours.dtype == np.int64 and ours.shape[1] == N_VQ + 1
    assert np.array_equal(ours, expect)
    assert (ours[:, 0] == cfg["audio_user_slot_token_id"]).sum() == sum(len(r) for r in refs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"voice": np.zeros((3, 2), dtype=np.int64)}, r"voice: got shape \(3, 2\)"),
        ({"voice": np.full((2, 3), 16)}, r"codes in \[16, 16\]; expected \[0, 16\)"),
        ({"voice": np.zeros((2, 3)) + 0.5}, "expected integer codes"),
        ({"speaker": "x"}, r"unknown field\(s\) \['speaker'\]"),
    ],
)
def test_bad_prompts_are_refused(tts: TTSEngine, kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        tts.add_request(text="Hello", params=TTSParams(max_frames=2), **kwargs)
    with pytest.raises(ValueError, match="exactly one of prompt rows or text"):
        tts.add_request(params=TTSParams(max_frames=2))
    tts.engine.check_invariants()


def test_a_shared_voice_prompt_hits_the_cache(tts: TTSEngine) -> None:
    ref = voice(9, 7)
    greedy = TTSParams(max_frames=3, text_temperature=0.0, audio_temperature=0.0)
    first, second = (
        tts.generate([TTSPrompt(text="Hello there.", voice=ref)], greedy, use_tqdm=False),
        tts.generate([TTSPrompt(text="The quick brown fox.", voice=ref)], greedy, use_tqdm=False),
    )
    rows = tts.prompt_rows("The quick brown fox.", ref)
    shared = int(np.flatnonzero(rows[:, 0] == tts.engine.model.config.end_id)[0]) + 1
    assert first[0].num_cached_rows < shared
    # Everything up to the reference's end row is one shared prefix (whole pages of 4).
    assert second[0].num_cached_rows >= shared // 4 * 4 >= len(ref)


# ---------------------------------------------------------------------------------------------
# Per-request streams.


def wave_params(i: int) -> TTSParams:
    stay = {"ignore_stop": True} if i % 3 else {}
    return TTSParams(
        max_frames=6 + i % 5, seed=100 + i, initial_chunk_frames=2, chunk_frames=3, **stay
    )


def wave_prompts(n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(5)
    out = []
    for i in range(n):
        rows = np.full((5 + i % 4, N_VQ + 1), VOCAB, dtype=np.int64)
        rows[:, 0] = rng.integers(3, 240, len(rows))
        out.append(rows)
    return out


def test_async_consumers_slow_and_cancelled(moss_local_ckpts: dict[str, Path]) -> None:
    n, slow, cancelled = 16, 4, 5
    prompts, params = wave_prompts(n), [wave_params(i) for i in range(n)]
    with TTSEngine(moss_local_ckpts[CKPT], overrides=EAGER) as ref_tts:
        expect = [o.rows for o in ref_tts.generate(prompts, params, use_tqdm=False)]
    params[cancelled] = TTSParams(max_frames=40, seed=9, ignore_stop=True, chunk_frames=2)

    halfway = asyncio.Event()
    streams: dict[int, Any] = {}

    async def consume(tts: TTSEngine, i: int, rid: str) -> list[Any]:
        got = []
        streams[i] = tts.stream(rid)
        async for chunk in streams[i]:
            got.append(chunk)
            if i == slow:
                await asyncio.sleep(0.3)  # far slower than the loop makes frames
            if i == cancelled and len(got) == 2:
                halfway.set()
                await asyncio.sleep(3600)  # cancelled here
        return got

    async def main(tts: TTSEngine) -> list[Any]:
        ids = [tts.add_request(p, q) for p, q in zip(prompts, params, strict=True)]
        tasks = [asyncio.create_task(consume(tts, i, rid)) for i, rid in enumerate(ids)]
        await halfway.wait()
        tasks[cancelled].cancel()
        return await asyncio.gather(*tasks, return_exceptions=True)

    with TTSEngine(moss_local_ckpts[CKPT], overrides=EAGER) as tts:
        results = asyncio.run(main(tts))
        cut = streams[cancelled].wait(timeout=60)
        deadline = time.time() + 30
        while tts.engine.has_unfinished_requests() and time.time() < deadline:
            time.sleep(0.01)
        tts.engine.check_invariants()
        assert not tts._outlets and not tts._requests  # every stream released
    assert isinstance(results[cancelled], asyncio.CancelledError)
    assert cut.finish_reason == "abort" and cut.metrics is not None
    assert cut.metrics.num_frames < 40
    for i, got in enumerate(results):
        if i == cancelled:
            continue
        assert got[-1].final and all(not c.final for c in got[:-1])
        assert np.array_equal(np.concatenate([c.rows for c in got]), expect[i]), i
        assert [len(c.rows) for c in got[:1]] == [min(2, len(expect[i]))]
        m = got[-1].metrics
        assert m is not None and m.num_frames == len(expect[i])
        assert m.rtf is None or m.rtf == pytest.approx(m.finished_s / (len(expect[i]) / 12.5))
    assert results[slow][-1].metrics.max_buffered_chunks >= 2  # it fell behind, lost nothing


def test_sync_streams_in_threads_and_early_close(moss_local_ckpts: dict[str, Path]) -> None:
    prompts, params = wave_prompts(4), [wave_params(i) for i in range(4)]
    with TTSEngine(moss_local_ckpts[CKPT], overrides=EAGER) as tts:
        expect = [o.rows for o in tts.generate(prompts, params, use_tqdm=False)]
        ids = [tts.add_request(p, q) for p, q in zip(prompts, params, strict=True)]
        long = tts.add_request(prompts[0], TTSParams(max_frames=50, seed=1, ignore_stop=True))
        got: dict[str, np.ndarray] = {}

        def read(rid: str) -> None:
            got[rid] = np.concatenate([c.rows for c in tts.stream(rid)])

        threads = [threading.Thread(target=read, args=(rid,)) for rid in ids]
        for t in threads:
            t.start()
        with tts.stream(long) as s:
            first = next(s)
        outcome = s.wait(timeout=60)
        for t in threads:
            t.join(timeout=60)
        assert [got[rid].tolist() for rid in ids] == [e.tolist() for e in expect]
        assert len(first.rows) == 5 and outcome.finish_reason == "abort"
        with pytest.raises(RuntimeError, match="driven already"):
            next(iter(tts.stream()))
        # generate() with the loop running reads the streams: same frames.
        again = tts.generate(prompts, params, use_tqdm=False)
        assert [o.rows.tolist() for o in again] == [e.tolist() for e in expect]
        with pytest.raises(ValueError, match="unknown, or its stream was consumed"):
            tts.stream(ids[0])
        tts.engine.check_invariants()


def test_codec_stage_audio_equals_a_whole_decode(moss_local_ckpts: dict[str, Path]) -> None:
    codec = ToneCodec(sample_rate=400, frame_rate=12.5, audio_vocab=VOCAB)
    prompts, params = wave_prompts(5), [wave_params(i) for i in range(5)]
    with TTSEngine(moss_local_ckpts[CKPT], overrides=EAGER, codec=codec) as tts:
        ids = [tts.add_request(p, q) for p, q in zip(prompts, params, strict=True)]
        streams = [list(tts.stream(rid)) for rid in ids]
        stats = tts.stats()
        outs = tts.generate(prompts, params, use_tqdm=False)
    assert stats["codec_decode_s"] > 0
    for chunks, out in zip(streams, outs, strict=True):
        rows = np.concatenate([c.rows for c in chunks])
        assert np.array_equal(rows, out.rows)
        audio = np.concatenate([c.audio for c in chunks])
        assert all(c.sample_rate == 400 and c.audio.dtype == np.float32 for c in chunks)
        assert len(audio) == len(rows) * codec.samples_per_frame
        assert np.array_equal(audio, decode_whole(codec, rows[:, 1:]))
        assert np.array_equal(out.audio, audio) and out.sample_rate == 400
        m = chunks[-1].metrics
        if len(rows):
            assert m.time_to_first_audio_s is not None and m.rtf > 0
            assert m.audio_s == pytest.approx(len(rows) / 12.5)


def test_cli_text_and_voice_rows_write_wavs(
    moss_local_ckpts: dict[str, Path], tmp_path: Path
) -> None:
    from hyloop.cli import main

    np.save(tmp_path / "ref.npy", voice(4, 9))
    lines = [
        {"text": "Hello there.", "voice": voice(3, 8).tolist(), "max_frames": 4, "seed": 1,
         "language": "en"},
        {"text": "The quick brown fox.", "voice_npy": "ref.npy", "max_frames": 5, "seed": 2,
         "ignore_stop": True},
        {"rows": wave_prompts(1)[0].tolist(), "max_frames": 3, "seed": 3, "ignore_stop": True},
    ]  # fmt: skip
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "out" / "res.jsonl"
    ckpt = str(moss_local_ckpts[CKPT])
    args = ["tts", "--model", ckpt, "--input", str(src), "--output", str(out), "--no-progress"]
    assert main([*args, "--codec", "tone", *EAGER]) == 0
    res = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["num_frames"] for r in res[1:]] == [5, 3]
    for r in res:
        with wave.open(str(out.parent / r["audio"])) as fh:
            assert fh.getframerate() == 48_000 and fh.getnframes() == r["num_frames"] * 3840
        assert np.load(out.parent / r["frames"]).shape == (r["num_frames"], N_VQ + 1)
        assert r["time_to_first_audio_s"] is None or r["time_to_first_audio_s"] > 0
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "x", "rows": [[1, 2, 3, 4]], "max_frames": 2}) + "\n")
    assert main(["tts", "--model", ckpt, "--input", str(bad), "--output", str(out)]) == 2
