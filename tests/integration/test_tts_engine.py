"""TTS frames through the engine: the streaming API, captured == eager, lookahead, the UHRC."""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from hyloop.tts import FrameChunk, TTSEngine, TTSParams

CKPT = "nvq3_v16_l1"
EAGER = ["graphs.backend=eager", "kv_pool.page_size=4", "kv_pool.num_pages=512"]
COMPILE = ["graphs.backend=compile", "graphs.buckets=[4]", *EAGER[1:]]
SLOT, END, PAD = 250, 251, 16  # the tiny checkpoint's special ids and pad code


def prompt(n: int, seed: int, n_vq: int = 3) -> np.ndarray:
    """``n`` rows: text rows (pad codes) then reference audio rows (slot id + codes)."""
    rng = np.random.default_rng(seed)
    text = np.full((n // 2, n_vq + 1), PAD, dtype=np.int64)
    text[:, 0] = rng.integers(3, 240, n // 2)
    audio = rng.integers(0, PAD, (n - n // 2, n_vq + 1))
    audio[:, 0] = SLOT
    return np.concatenate([text, audio])


def seeded(max_frames: int, seed: int, **kw: Any) -> TTSParams:
    return TTSParams(max_frames=max_frames, seed=seed, **kw)


def greedy(max_frames: int, **kw: Any) -> TTSParams:
    return TTSParams(max_frames=max_frames, text_temperature=0.0, audio_temperature=0.0, **kw)


def run(ckpt: Path, overrides: list[str], prompts: list[np.ndarray], params: list[TTSParams]):
    with TTSEngine(ckpt, overrides=overrides) as tts:
        outs = tts.generate(prompts, params, use_tqdm=False)
        tts.engine.check_invariants()
        return outs, tts.stats()


def rows_of(outs: list[Any]) -> list[list[list[int]]]:
    return [o.rows.tolist() for o in outs]


WAVE_PROMPTS = [prompt(9, 1), prompt(14, 2), prompt(6, 3)]
WAVE_PARAMS = [
    seeded(12, 11, audio_repetition_penalty=1.3, repetition_window=4),
    greedy(10),
    seeded(14, 13, audio_top_k=-1, audio_top_p=1.0, ignore_stop=True),
]


@pytest.fixture(scope="module")
def eager_wave(moss_local_ckpts: dict[str, Path]) -> list[list[list[int]]]:
    outs, _ = run(moss_local_ckpts[CKPT], EAGER, WAVE_PROMPTS, WAVE_PARAMS)
    return rows_of(outs)


def test_frames_are_rows_of_the_model(eager_wave: list[list[list[int]]]) -> None:
    for rows, p in zip(eager_wave, WAVE_PARAMS, strict=True):
        assert len(rows) <= p.max_frames
        for r in rows:
            assert r[0] == SLOT and all(0 <= c < PAD for c in r[1:])  # no end frame in rows
    assert len(eager_wave[2]) == 14  # ignore_stop runs to max_frames


@pytest.mark.parametrize("lookahead", [False, True])
def test_lookahead_frames_equal_the_sync_loop(
    moss_local_ckpts: dict[str, Path], eager_wave: list[list[list[int]]], lookahead: bool
) -> None:
    overrides = [*EAGER, f"lookahead.enable={str(lookahead).lower()}", "lookahead.min_batch=1"]
    outs, _ = run(moss_local_ckpts[CKPT], overrides, WAVE_PROMPTS, WAVE_PARAMS)
    assert rows_of(outs) == eager_wave


def test_frames_do_not_depend_on_the_batch(
    moss_local_ckpts: dict[str, Path], eager_wave: list[list[list[int]]]
) -> None:
    for i in range(3):
        outs, _ = run(moss_local_ckpts[CKPT], EAGER, [WAVE_PROMPTS[i]], [WAVE_PARAMS[i]])
        assert rows_of(outs)[0] == eager_wave[i]


@pytest.mark.slow
def test_compiled_frames_equal_eager_no_recompile(
    moss_local_ckpts: dict[str, Path], eager_wave: list[list[list[int]]]
) -> None:
    ckpt = moss_local_ckpts[CKPT]
    with TTSEngine(
        ckpt, overrides=[*COMPILE, "lookahead.enable=true", "lookahead.min_batch=1"]
    ) as tts:
        assert rows_of(tts.generate(WAVE_PROMPTS, WAVE_PARAMS, use_tqdm=False)) == eager_wave
        # 200 frames with the batch shrinking 4 -> 1 (and back up for the next wave).
        lengths = [20, 40, 60, 80]
        prompts = [prompt(5 + i, 20 + i) for i in range(4)]
        params = [seeded(n, i, ignore_stop=True) for i, n in enumerate(lengths)]
        outs = tts.generate(prompts, params, use_tqdm=False)
        assert [len(o.rows) for o in outs] == lengths
        s = tts.stats()
        assert s["recompiles"] == 0 and s["eager_fallbacks"] == 0 and s["graph_replays"] >= 80
        # The same wave through per-request streams: the loop thread replays the artifacts.
        ids = [tts.add_request(p, q) for p, q in zip(prompts, params, strict=True)]
        streamed = [np.concatenate([c.rows for c in tts.stream(rid)]).tolist() for rid in ids]
        s2 = tts.stats()
        assert s2["graph_replays"] - s["graph_replays"] >= lengths[-1] - 1  # a decode each frame
        assert s2["recompiles"] == 0
        tts.engine.check_invariants()
    ref, _ = run(ckpt, EAGER, prompts, params)
    assert rows_of(outs) == rows_of(ref) == streamed


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graph_frames_equal_eager_on_cuda(moss_local_ckpts: dict[str, Path]) -> None:
    """The frame step captured as a CUDA graph (lookahead on) gives the eager step's frames on the
    same device, seeded sampling and the repetition penalty included, with no fallback."""
    ckpt = moss_local_ckpts[CKPT]
    eager = ["device=cuda", *EAGER]
    ref, _ = run(ckpt, eager, WAVE_PROMPTS, WAVE_PARAMS)
    graph = [
        "device=cuda",
        "graphs.backend=cuda_graph",
        "graphs.buckets=[1,2,4]",
        *EAGER[1:],
        "lookahead.enable=true",
        "lookahead.min_batch=1",
    ]
    outs, stats = run(ckpt, graph, WAVE_PROMPTS, WAVE_PARAMS)
    assert rows_of(outs) == rows_of(ref)
    assert stats["graph_replays"] >= 10 and stats["eager_fallbacks"] == 0


def test_stream_chunk_sizes_and_concatenation(moss_local_ckpts: dict[str, Path]) -> None:
    p = seeded(11, 5, ignore_stop=True, initial_chunk_frames=2, chunk_frames=4)
    q = seeded(3, 6, ignore_stop=True, initial_chunk_frames=5, chunk_frames=25)
    with TTSEngine(moss_local_ckpts[CKPT], overrides=EAGER) as tts:
        a = tts.add_request(prompt(8, 7), p, request_id="a")
        b = tts.add_request(prompt(6, 8), q)
        chunks: dict[str, list[FrameChunk]] = {a: [], b: []}
        for c in tts.stream():
            chunks[c.request_id].append(c)
        ref = tts.generate([prompt(8, 7), prompt(6, 8)], [p, q], use_tqdm=False)
    assert [len(c.rows) for c in chunks[a]] == [2, 4, 4, 1]
    assert [c.final for c in chunks[a]] == [False, False, False, True]
    assert [len(c.rows) for c in chunks[b]] == [3] and chunks[b][0].final
    assert chunks[a][-1].finish_reason == "length"
    for rid, out in zip((a, b), ref, strict=True):
        assert np.concatenate([c.rows for c in chunks[rid]]).tolist() == out.rows.tolist()


def test_abort_mid_stream_ends_with_a_final_chunk(moss_local_ckpts: dict[str, Path]) -> None:
    p = seeded(40, 1, ignore_stop=True, initial_chunk_frames=3, chunk_frames=3)
    with TTSEngine(moss_local_ckpts[CKPT], overrides=EAGER) as tts:
        rid = tts.add_request(prompt(8, 9), p)
        other = tts.add_request(prompt(8, 10), seeded(6, 2, ignore_stop=True))
        got: list[FrameChunk] = []
        for c in tts.stream():
            got.append(c)
            if (
                c.request_id == rid
                and len(got)
                and not c.final
                and sum(len(x.rows) for x in got if x.request_id == rid) >= 6
            ):
                tts.abort(rid)
        tts.engine.check_invariants()
        assert not tts.engine.has_unfinished_requests()
        s = tts.stats()
        assert s["kv_free_tokens"] + s["cache_evictable_tokens"] == s["kv_capacity_tokens"]
    mine = [c for c in got if c.request_id == rid]
    assert mine[-1].final and mine[-1].finish_reason == "abort"
    assert all(not c.final for c in mine[:-1])
    assert 6 <= sum(len(c.rows) for c in mine) < 40
    theirs = [c for c in got if c.request_id == other]
    assert theirs[-1].final and sum(len(c.rows) for c in theirs) == 6


def test_add_and_abort_from_another_thread_while_streaming(
    moss_local_ckpts: dict[str, Path],
) -> None:
    with TTSEngine(moss_local_ckpts[CKPT], overrides=EAGER) as tts:
        first = tts.add_request(prompt(6, 1), seeded(30, 1, ignore_stop=True))
        added: list[str] = []
        reasons: dict[str, str | None] = {}
        for c in tts.stream():
            if c.final:
                reasons[c.request_id] = c.finish_reason
            if not added:
                t = threading.Thread(
                    target=lambda: added.append(
                        tts.add_request(prompt(5, 2), seeded(4, 2, ignore_stop=True))
                    )
                )
                t.start()
                t.join()
                threading.Thread(target=tts.abort, args=(first,)).start()
        assert reasons == {first: "abort", added[0]: "length"}
        tts.engine.check_invariants()


def test_a_repeated_voice_prompt_hits_the_cache(moss_local_ckpts: dict[str, Path]) -> None:
    ckpt = moss_local_ckpts[CKPT]
    voice = prompt(72, 30)
    params = [seeded(8, 1), seeded(8, 2)]
    off, _ = run(ckpt, [*EAGER, "cache.enable=false"], [voice, voice], params)
    with TTSEngine(ckpt, overrides=EAGER) as tts:
        first = tts.generate([voice], [params[0]], use_tqdm=False)[0]
        second = tts.generate([voice], [params[1]], use_tqdm=False)[0]
    assert first.num_cached_rows == 0 and second.num_cached_rows >= 64
    assert [first.rows.tolist(), second.rows.tolist()] == rows_of(off)


def test_a_continuation_hits_the_prompt_and_the_generated_rows(
    moss_local_ckpts: dict[str, Path],
) -> None:
    ckpt = moss_local_ckpts[CKPT]
    base = prompt(40, 40)
    a_params, b_params = seeded(16, 1, ignore_stop=True), seeded(16, 2, ignore_stop=True)
    cont_params = seeded(6, 3, ignore_stop=True)
    with TTSEngine(ckpt, overrides=EAGER) as tts:
        a, b = tts.generate([base, base], [a_params, b_params], use_tqdm=False)
        assert a.rows.tolist() != b.rows.tolist()
        cont = np.concatenate([base, a.rows])
        c = tts.generate([cont], [cont_params], use_tqdm=False)[0]
        tts.engine.check_invariants()
    # A's rows went into the tree up to its last computed row (the last sampled row was never
    # fed back), page-aligned; the continuation's prompt keys them the same way.
    computed = len(base) + len(a.rows) - 1
    assert c.num_cached_rows == computed - computed % 4
    off, _ = run(ckpt, [*EAGER, "cache.enable=false"], [cont], [cont_params])
    assert c.rows.tolist() == off[0].rows.tolist()


@pytest.mark.parametrize(
    ("rows", "params", "match"),
    [
        (np.zeros((4, 3), dtype=np.int64), greedy(4), r"expected \[L, 4\]"),
        (np.full((4, 4), PAD + 1, dtype=np.int64), greedy(4), "outside"),
        (np.full((4, 4), -1, dtype=np.int64), greedy(4), "outside"),
        (np.zeros((0, 4), dtype=np.int64), greedy(4), "empty prompt"),
        (prompt(4, 1), greedy(0), "max_frames"),
        (prompt(4, 1), seeded(4, 1, audio_top_p=0.0), "audio_top_p"),
        (prompt(4, 1), greedy(4, chunk_frames=0), "chunk_frames"),
    ],
)
def test_bad_requests_fail_alone(
    moss_local_ckpts: dict[str, Path], rows: np.ndarray, params: TTSParams, match: str
) -> None:
    with TTSEngine(moss_local_ckpts[CKPT], overrides=EAGER) as tts:
        ok = tts.add_request(prompt(6, 1), greedy(3, ignore_stop=True))
        with pytest.raises(ValueError, match=match):
            tts.add_request(rows, params)
        finals = [c for c in tts.stream() if c.final]
        assert [(c.request_id, len(c.rows) + 0) for c in finals] == [(ok, 3)]
        tts.engine.check_invariants()


def test_unknown_params_are_named() -> None:
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['audio_temp'\]"):
        TTSParams.from_dict({"max_frames": 4, "audio_temp": 1.0})
    with pytest.raises(ValueError, match="max_frames"):
        TTSParams.from_dict({"seed": 1})


def test_cli_tts_writes_frames_beside_the_jsonl(
    moss_local_ckpts: dict[str, Path], tmp_path: Path
) -> None:
    import json

    from hyloop.cli import main

    ckpt = moss_local_ckpts[CKPT]
    np.save(tmp_path / "voice.npy", prompt(10, 2))
    lines = [
        {"id": "a", "rows": prompt(8, 1).tolist(), "max_frames": 5, "seed": 1},
        {"id": "b", "rows_npy": "voice.npy", "max_frames": 7, "seed": 2, "ignore_stop": True},
    ]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "out" / "res.jsonl"
    argv = ["tts", "--model", str(ckpt), "--input", str(src), "--output", str(out)]
    assert main([*argv, "--no-progress", *EAGER]) == 0
    got = [json.loads(x) for x in out.read_text().splitlines()]
    assert [g["id"] for g in got] == ["a", "b"] and got[1]["num_frames"] == 7
    with TTSEngine(ckpt, overrides=EAGER) as tts:
        ref = tts.generate(
            [prompt(8, 1), prompt(10, 2)],
            [seeded(5, 1), seeded(7, 2, ignore_stop=True)],
            use_tqdm=False,
        )
    for g, r in zip(got, ref, strict=True):
        frames = np.load(out.parent / g["frames"])
        assert frames.tolist() == r.rows.tolist() and g["finish_reason"] == r.finish_reason
    (bad := tmp_path / "bad.jsonl").write_text(json.dumps({"rows": [[1, 2, 3, 4]], "temp": 1}))
    bad_argv = ["tts", "--model", str(ckpt), "--input", str(bad), "--output", f"{out}.bad"]
    assert main(bad_argv) == 1  # the bad line fails alone (test_hostile_inputs: its record)


class RunningSumCodec:
    """A deterministic codec: 4 samples a frame, each frame's depending on the frame before it
    (so a chunk needs one frame of left context to decode like the whole sequence)."""

    context_frames = 1
    sample_rate = 50
    samples_per_frame = 4

    def decode(self, codes: np.ndarray, context: np.ndarray) -> np.ndarray:
        frames = np.concatenate([context[-1:], codes]).sum(axis=1).astype(np.float32)
        prev = np.concatenate([[0.0], frames[:-1]]) if not len(context) else frames[:-1]
        cur = frames[-len(codes) :] if len(codes) else frames[:0]
        per_frame = (cur + 0.5 * prev[-len(codes) :]) / 1000.0 if len(codes) else cur
        return np.repeat(per_frame, 4)


def test_codec_chunks_decode_like_the_whole_sequence(moss_local_ckpts: dict[str, Path]) -> None:
    codec = RunningSumCodec()
    params = seeded(13, 4, ignore_stop=True, initial_chunk_frames=2, chunk_frames=5)
    with TTSEngine(moss_local_ckpts[CKPT], overrides=EAGER, codec=codec) as tts:
        tts.add_request(prompt(7, 3), params)
        chunks = list(tts.stream())
    assert [len(c.rows) for c in chunks] == [2, 5, 5, 1]
    rows = np.concatenate([c.rows for c in chunks])
    whole = codec.decode(rows[:, 1:], np.zeros((0, 3), dtype=np.int64))
    streamed = np.concatenate([c.audio for c in chunks if c.audio is not None])
    assert streamed.dtype == np.float32
    assert np.array_equal(streamed, whole.astype(np.float32))


def test_the_frame_step_is_capture_safe(moss_local_ckpts: dict[str, Path]) -> None:
    from hyloop.framework.requests import Batch, Chunk
    from hyloop.graphs.safety import CaptureSafetyError, check_capture_safe

    with TTSEngine(moss_local_ckpts[CKPT], overrides=EAGER) as tts:
        eng = tts.engine
        stay = {"ignore_stop": True}
        for i, p in enumerate(
            (seeded(8, 1, audio_repetition_penalty=1.2, **stay), greedy(8, **stay))
        ):
            tts.add_request(prompt(6 + i, i), p)
        running = eng.scheduler.running
        while len(running) < 2 or not all(r.prefill_done and r.output_ids for r in running):
            eng.step()
        batch = Batch([Chunk(r, r.total_len - 1, 1) for r in eng.scheduler.running], True)
        kind = eng.kind
        inputs = dataclasses.replace(kind.build(batch), pools=kind.captured_pools)
        with torch.inference_mode():
            out = check_capture_safe(kind.step, inputs)
            assert out.next_rows is not None and out.next_rows.shape == (2, 4)

            def planted(inp: object) -> object:
                res = kind.step(inp)  # type: ignore[arg-type]
                _ = bool(res.next_rows[0, 0] == END)  # a host sync
                return res

            with pytest.raises(CaptureSafetyError):
                check_capture_safe(planted, inputs)
