"""The ``hyloop`` command: ``generate`` (offline batch generation), ``run-batch`` (OpenAI Batch
files, as vLLM's), ``tts`` (TTS frames), ``regress`` (graph-vs-eager) and ``warmup`` (capture a
config's artifacts ahead of its jobs)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import argparse

RESUME = (
    "continue the job that wrote --output: its lines are kept (a torn last one is redone) and "
    "only the rest run; the input and config must be the ones it was written from. Without it "
    "an existing non-empty output is refused, never appended to or replaced"
)


# Each command's recipe (module:function of ``hyloop.recipes``), imported when it runs.
RECIPES = {
    "generate": "offline:run_generate",
    "generate --ray": "ray_generate:run_generate_ray",
    "run-batch": "run_batch:run_batch",
    "warmup": "warmup:run_warmup",
    "tts": "tts:run_tts",
    "regress": "graph_vs_eager:run_regress",
}


def main(argv: list[str] | None = None) -> int:
    """The command (``argv`` None: the process's own arguments, and the process ends after it;
    a list: a call from Python, e.g. a test, which leaves the process's signals alone)."""
    code = 1  # what a command that raised ends with
    try:
        code = _main(argv)
        return code
    except KeyboardInterrupt:  # before a job's own handlers were in place
        print("hyloop: interrupted by SIGINT; no row ran", file=sys.stderr)
        code = 130
        return code
    finally:
        if argv is None:
            _quiet_teardown(code)


def _quiet_teardown(code: int) -> None:
    """The command is done, with exit ``code``, and what it wrote is flushed: a SIGINT / SIGTERM
    that comes while the interpreter tears down (its finalizers, the pools' threads) ends the
    process at once with that code (the work it would stop is over), not with a
    KeyboardInterrupt traceback from inside a finalizer."""
    import os
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return
    sys.stdout.flush()
    sys.stderr.flush()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: os._exit(code))


def _main(argv: list[str] | None) -> int:
    # Imported here, under main's KeyboardInterrupt handler: a Ctrl-C this early ends quietly.
    import argparse
    import importlib
    import logging

    from hyloop.recipes.job import Interrupted

    parser = argparse.ArgumentParser(prog="hyloop", description="hyloop decode-loop framework")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser(
        "generate",
        help="offline generation (JSONL in, JSONL out)",
        epilog="Each input line gives one output record, in input order; a bad line gets a "
        "record with its `error` (file:line: field: reason) while the others run. Exit code: "
        "0 if every row ran, 1 if some rows failed, 2 for a command-line error (no input "
        "file, bad config or model), 130 / 143 after SIGINT / SIGTERM (rerun with --resume).",
    )
    gen.add_argument("--config", action="append", default=[], help="YAML config (repeatable)")
    gen.add_argument("--model", help="HF checkpoint dir or .gguf (default: SmolLM2-135M)")
    gen.add_argument(
        "--input", help="prompts JSONL: {prompt | prompt_token_ids | messages, sampling...}"
    )
    gen.add_argument("--output", help="output JSONL (default: print texts)")
    gen.add_argument("--resume", action="store_true", help=RESUME)
    gen.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    gen.add_argument(
        "--speculative-config",
        metavar="JSON",
        help='vLLM\'s speculative_config, e.g. {"method": "ngram", "num_speculative_tokens": 4}',
    )
    gen.add_argument(
        "--ray",
        type=int,
        metavar="N",
        help="run N engine replicas through Ray Data (local Ray unless ray.address=...)",
    )
    tts = sub.add_parser(
        "tts", help="TTS (JSONL of text / voice or prompt rows in; frames .npy and .wav out)"
    )
    tts.add_argument("--config", action="append", default=[], help="YAML config (repeatable)")
    tts.add_argument("--model", help="TTS checkpoint directory (model_type moss_tts_local)")
    tts.add_argument(
        "--input",
        help="requests JSONL: {text [, voice | voice_npy] | rows | rows_npy, max_frames, ...}",
    )
    tts.add_argument("--output", help="output JSONL (frames .npy and audio .wav beside it)")
    tts.add_argument("--resume", action="store_true", help=RESUME)
    tts.add_argument(
        "--codec",
        help="codes -> audio: 'tone' (hyloop's test codec) or module:factory; writes .wav files",
    )
    tts.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    reg = sub.add_parser("regress", help="graph-vs-eager regression recipe")
    reg.add_argument("--config", action="append", default=[], help="YAML config (repeatable)")
    reg.add_argument("--model", help="checkpoint (default: the recipe's)")
    reg.add_argument("--json", help="write the report as JSON here")
    warm = sub.add_parser(
        "warmup",
        help="capture the artifacts a config will use and time them (kept under $HYLOOP_CACHE_DIR)",
    )
    warm.add_argument("--config", action="append", default=[], help="YAML config (repeatable)")
    warm.add_argument("--model", help="checkpoint (default: SmolLM2-135M)")
    warm.add_argument(
        "--kv-len", type=int, default=512, help="warm the buckets of contexts up to this (512)"
    )
    warm.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    for cmd in (gen, tts, reg, warm):
        cmd.add_argument("overrides", nargs="*", help="config overrides, key=value")
    add_run_batch(sub)
    # Overrides (key=value) may come before or after options; argparse takes one run of them.
    args, extra = parser.parse_known_args(argv)
    stray = [a for a in extra if a.startswith("-") or "=" not in a]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    args.overrides = [*(args.overrides or []), *getattr(args, "dotlist", []), *extra]
    if args.command == "generate" and args.speculative_config:
        from hyloop.api.engine_args import speculative_overrides

        try:
            args.overrides += speculative_overrides(args.speculative_config)
        except ValueError as e:  # bad JSON, another method: a command-line error
            parser.error(f"--speculative-config: {e}")
    for item in args.overrides:
        if "=" not in item:  # a file given where an option was meant, most often
            flag = "-i" if args.command == "run-batch" else "--input"
            hint = f"; to read it, pass {flag} {item}" if item.endswith((".jsonl", ".json")) else ""
            parser.error(f"{item!r} is not a key=value config override{hint}")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if not getattr(args, "no_progress", False):  # a bucket's first capture can take a while
        logging.getLogger("hyloop.graphs").setLevel(logging.INFO)
    try:
        ray = args.command == "generate" and args.ray is not None
        module, _, name = RECIPES["generate --ray" if ray else args.command].partition(":")
        return int(getattr(importlib.import_module(f"hyloop.recipes.{module}"), name)(args))
    except Interrupted as e:  # before any row ran: nothing to write
        print(f"hyloop: {e}; no row ran", file=sys.stderr)
        return e.exit_code
    except (ValueError, FileNotFoundError) as e:
        print(f"hyloop: error: {e}", file=sys.stderr)
        return 2


def add_run_batch(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``run-batch``: vLLM's engine flags (``--max-model-len``, ``--enforce-eager``, ...), the
    batch files, and ``key=value`` overrides like the other subcommands."""
    from hyloop.api.engine_args import EngineArgs

    rb = sub.add_parser(
        "run-batch",
        help="OpenAI Batch file in (/v1/chat/completions, /v1/completions), its output out",
        conflict_handler="resolve",  # the options below restate some engine flags with help
        epilog="One output line per input line, in input order; a bad line gets an error line "
        "(line N: field: reason) while the others run. Exit code: 0 once the output is written "
        "(errors included, as OpenAI's batches), 2 for a command-line error (no input file, bad "
        "config or model), 130 / 143 after SIGINT / SIGTERM (rerun with --resume).",
    )
    EngineArgs.add_cli_args(rb)
    rb.add_argument("-i", "--input-file", required=True, help="batch input JSONL (- for stdin)")
    rb.add_argument("-o", "--output-file", required=True, help="batch output JSONL (- for stdout)")
    rb.add_argument("--model", help="HF checkpoint dir or .gguf (default: SmolLM2-135M)")
    rb.add_argument("--config", action="append", default=None, help="YAML config (repeatable)")
    rb.add_argument(
        "--served-model-name",
        help="the model name in the responses; a body naming another model gets an error line",
    )
    rb.add_argument("--resume", action="store_true", help=RESUME)
    rb.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    rb.add_argument("dotlist", nargs="*", metavar="overrides", help="config overrides, key=value")


if __name__ == "__main__":
    sys.exit(main())
