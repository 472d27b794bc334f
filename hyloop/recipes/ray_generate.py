"""``hyloop generate --ray N``: the CLI's JSONL job through ``ray_batch``'s replicas, written in
input order as ``hyloop generate`` writes it, and resumable the same way (``job_output``)."""

from __future__ import annotations

import argparse
import json
import sys
import threading

import ray
import ray.data
from tqdm.auto import tqdm

from hyloop.recipes.job import JobSignals, row_key, row_seed
from hyloop.recipes.job_output import JobOutput, fingerprint
from hyloop.recipes.offline import check_model, default_checkpoint, read_rows
from hyloop.recipes.ray_batch import OUTPUT_TYPES, RaySection, generate_rows, init_ray, split_config
from hyloop.recipes.ray_blocks import REQUEST, REQUEST_FIELDS, ROW, WHERE
from hyloop.recipes.records import Line, RecordWriter, failed_fields, same_record


def run_generate_ray(args: argparse.Namespace) -> int:
    """``hyloop generate --ray N``: the JSONL rows through N replicas, written in input order as
    ``hyloop generate`` writes them (a resumable job output); 1 when some rows failed, each
    written with its ``error``; 130 / 143 when a signal stopped the driver."""
    if args.ray < 1:
        raise ValueError(f"--ray: got {args.ray}; expected a number of replicas >= 1")
    if not args.input:
        raise ValueError("--ray needs --input, a JSONL of rows to generate from")
    data, lines = read_rows(args.input)  # structure checked here; the rest in the replicas
    model = args.model or str(default_checkpoint())
    check_model(model)
    overrides = [*args.overrides, f"model.path={model}"]
    engine_cfg, opts = split_config(args.config or None, overrides)
    out = JobOutput(args.output)
    done = out.check(args.input, getattr(args, "resume", False), len(lines), same_record(lines))
    good = [i for i, line in enumerate(lines) if line.error is None and i >= done]
    stop = threading.Event()
    with JobSignals() as signals, RecordWriter(out, lines, done) as sink:
        if good:
            init_ray(opts.address)
            signals.install()  # Ray's core worker takes SIGTERM (and aborts on it)
            ray.data.DataContext.get_current().enable_progress_bars = not args.no_progress
        out.open(fingerprint(data, {"generate": engine_cfg.model_dump(), "ray": opts.model_dump()}))
        signals.start(stop.set)
        for i, line in enumerate(lines):
            if line.error is not None:
                sink.put(i, failed_fields(line.error))
        if good:
            _run_rows(args, lines, good, engine_cfg.seed, overrides, opts, sink, stop)
        sink.partial = stop.is_set()
    computed = sink.prompt_tokens - sink.cached_tokens
    if signals.exit_code is not None:
        return signals.report("generate", sink.written, len(lines), args.output or "stdout", "rows")
    print(
        f"{len(lines) - sink.failed} rows done, {sink.failed} failed; {args.ray} replicas "
        f"({'prefix affinity' if opts.prefix_affinity else 'default split'}); prefill "
        f"{computed} tokens computed, {sink.cached_tokens} cached",
        file=sys.stderr,
    )
    return 1 if sink.failed else 0


def _run_rows(
    args: argparse.Namespace,
    lines: list[Line],
    good: list[int],
    seed: int,
    overrides: list[str],
    opts: RaySection,
    sink: RecordWriter,
    stop: threading.Event,
) -> None:
    """The ``good`` lines through the replicas, each result put in ``sink`` as it streams back;
    once ``stop`` is set, no more is taken (what is in order is written, the rest runs on
    resume)."""
    # Rows travel as JSON text: values of any type reach their replica as written, where
    # Arrow would need one type per column across blocks. A row without a seed gets its
    # ``row_seed`` here, as the local path gives it.
    requests = []
    for i in good:
        row = lines[i].row or {}
        fields = {k: v for k, v in row.items() if k in REQUEST_FIELDS}
        if fields.get("seed") is None:
            fields["seed"] = row_seed(seed, row_key(row, lines[i].number))
        requests.append({REQUEST: json.dumps(fields), WHERE: f"{args.input}:{lines[i].number}"})
    blocks = max(1, len(requests) // opts.batch_size)
    ds = ray.data.from_items(requests, override_num_blocks=blocks)
    out = generate_rows(ds, args.config or None, overrides, args.ray)
    bar = tqdm(total=len(good), desc="rows", unit="row", disable=args.no_progress)
    with bar:
        for batch in out.select_columns([ROW, *OUTPUT_TYPES]).iter_batches(
            batch_size=None, batch_format="pyarrow"
        ):
            for result in batch.to_pylist():
                sink.put(good[result.pop(ROW)], result)
            bar.update(batch.num_rows)
            if stop.is_set():
                break
