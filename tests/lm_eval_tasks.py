"""Local lm-eval-harness tasks and the SmolLM2 checkpoints they run on, for the tests and
``bench/vllm_clients.py``: a multiple-choice task, a ``generate_until`` task and a
``loglikelihood_rolling`` task, each a JSONL file beside its YAML; and how to read back one
run's per-item responses from ``lm_eval --log_samples``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

MC = [
    ("The capital of France is", ["Paris", "Berlin", "Madrid", "Rome"], 0),
    ("Two plus two equals", ["three", "four", "five", "six"], 1),
    ("The color of the sky on a clear day is", ["green", "red", "blue", "yellow"], 2),
    ("Water freezes at zero degrees", ["Celsius", "Kelvin", "Rankine", "Newton"], 0),
    ("The largest planet in the solar system is", ["Mars", "Venus", "Jupiter", "Mercury"], 2),
    ("A week has", ["five days", "six days", "seven days", "eight days"], 2),
    ("The opposite of hot is", ["warm", "cold", "loud", "tall"], 1),
    ("Bees make", ["milk", "honey", "silk", "wool"], 1),
    ("The first letter of the alphabet is", ["A", "B", "Z", "M"], 0),
    ("A triangle has", ["two sides", "three sides", "four sides", "five sides"], 1),
    ("The Sun rises in the", ["west", "north", "east", "south"], 2),
    ("Ice is frozen", ["water", "sand", "air", "oil"], 0),
    ("A baby cat is called a", ["puppy", "kitten", "calf", "foal"], 1),
    ("The chemical symbol for gold is", ["Ag", "Fe", "Au", "Pb"], 2),
    ("People breathe in", ["oxygen", "helium", "neon", "argon"], 0),
    ("The number after nine is", ["eight", "eleven", "ten", "twelve"], 2),
    ("Paris is a city in", ["Spain", "France", "Italy", "Germany"], 1),
    ("A spider has", ["six legs", "eight legs", "ten legs", "four legs"], 1),
    ("The Moon orbits the", ["Sun", "Earth", "Mars", "Venus"], 1),
    ("Shakespeare wrote", ["Hamlet", "Dracula", "Frankenstein", "Ulysses"], 0),
]
GEN = [
    "Q: What is the capital of France?\nA:",
    "Q: How many legs does a dog have?\nA:",
    "Q: What color is grass?\nA:",
    "Q: What is the opposite of up?\nA:",
    "Q: Which animal says moo?\nA:",
    "Q: What do you call frozen water?\nA:",
    "Q: How many days are in a week?\nA:",
    "Q: What is the largest ocean on Earth?\nA:",
    "Q: Who wrote Romeo and Juliet?\nA:",
    "Q: What planet do we live on?\nA:",
    "Q: What is two times three?\nA:",
    "Q: What gas do plants take in?\nA:",
    "Q: What is the boiling point of water in Celsius?\nA:",
    "Q: Name a primary color.\nA:",
    "Q: What language is spoken in Spain?\nA:",
    "Q: What is the tallest animal?\nA:",
    "Q: How many hours are in a day?\nA:",
    "Q: What is the capital of Japan?\nA:",
    "Q: What do bees make?\nA:",
    "Q: What is the freezing point of water in Fahrenheit?\nA:",
]
ROLLING = [
    "The printing press made books cheap enough for merchants and students to own them.",
    "Rivers carry water from the mountains to the sea, shaping valleys along the way.",
    "A good recipe lists its ingredients first and then explains each step in order.",
    "Trains connected distant towns and changed how people thought about time and travel.",
    "The library opens at nine in the morning and closes at six in the evening.",
]
TASKS = ("hy_mc", "hy_gen", "hy_rolling")
_COMMON = "dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
_YAML = {
    "hy_mc": "output_type: multiple_choice\ndoc_to_text: '{{{{question}}}}'\n"
    "doc_to_choice: '{{{{choices}}}}'\ndoc_to_target: '{{{{answer}}}}'\n"
    "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n",
    "hy_gen": "output_type: generate_until\ndoc_to_text: '{{{{question}}}}'\n"
    "doc_to_target: ''\ngeneration_kwargs:\n  until: [\"\\n\"]\n  max_gen_toks: {gen_tokens}\n"
    "  do_sample: false\nmetric_list:\n  - metric: exact_match\n    aggregation: mean\n"
    "    higher_is_better: true\n",
    "hy_rolling": "output_type: loglikelihood_rolling\ndoc_to_text: ''\n"
    "doc_to_target: '{{{{text}}}}'\nmetric_list:\n  - metric: word_perplexity\n"
    "  - metric: byte_perplexity\n  - metric: bits_per_byte\n",
}


def write_tasks(folder: Path, n_mc: int, n_gen: int, n_rolling: int, gen_tokens: int = 24) -> Path:
    """The three tasks with their first n items, under ``folder`` (lm-eval's
    ``--include_path``)."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = {
        "hy_mc": [{"question": q, "choices": c, "answer": a} for q, c, a in MC[:n_mc]],
        "hy_gen": [{"question": q} for q in GEN[:n_gen]],
        "hy_rolling": [{"text": t} for t in ROLLING[:n_rolling]],
    }
    for task in TASKS:
        data = folder / f"{task}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows[task]))
        body = _YAML[task].format(gen_tokens=gen_tokens)
        (folder / f"{task}.yaml").write_text(f"task: {task}\n" + _COMMON.format(data=data) + body)
    return folder


def export_hf_dir(gguf: Path, out: Path) -> Path:
    """The GGUF's weights (dequantized, float32) and tokenizer as an HF directory, as
    transformers reads them with ``gguf_file=``."""
    import torch
    import transformers

    if (out / "model.safetensors").is_file():
        return out
    auto = transformers.AutoModelForCausalLM
    model = auto.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    config = model.config
    if hasattr(config, "quantization_config"):  # the dequantized weights are plain tensors
        del config.quantization_config
    plain = auto.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict())
    plain.save_pretrained(out)
    transformers.AutoTokenizer.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name
    ).save_pretrained(out)
    return out


def responses(samples: dict[str, list[dict[str, Any]]]) -> dict[str, list[Any]]:
    """Per task, per item in doc order: the loglikelihoods of its choices (multiple choice),
    its generation (generate_until) or its total loglikelihood (rolling)."""
    out: dict[str, list[Any]] = {}
    for task, items in samples.items():
        values = []
        for item in sorted(items, key=lambda s: s["doc_id"]):
            resps = [r[0] for r in item["resps"]]
            if task == "hy_mc":
                values.append([float(r[0]) for r in resps])
            elif task == "hy_gen":
                values.append(resps[0])
            else:
                values.append(float(resps[0]))
        out[task] = values
    return out


def read_logged_samples(output_path: Path) -> dict[str, list[dict[str, Any]]]:
    """The ``samples_<task>_*.jsonl`` files one ``lm_eval --log_samples`` run wrote."""
    samples: dict[str, list[dict[str, Any]]] = {}
    for task in TASKS:
        files = sorted(output_path.rglob(f"samples_{task}_*.jsonl"))
        if files:
            lines = files[-1].read_text().splitlines()
            samples[task] = [json.loads(line) for line in lines if line.strip()]
    return samples
