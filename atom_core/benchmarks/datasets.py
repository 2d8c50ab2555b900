"""Benchmark prompts: random token ids, ShareGPT, BurstGPT, sonnet lines, or a local HF dataset.

Every sampler returns SampleRequest(prompt, prompt_len, expected_output_len), where
prompt_len is the prompt's token count under the benchmark's tokenizer (no special tokens
added: the server's own count arrives in its usage and is what the totals use).

The shipped ``data/sonnet.txt`` holds ten of Shakespeare's sonnets (1, 2, 18, 29, 30, 55, 60,
73, 116, 130; public domain), one line per line of verse, as vLLM's sonnet dataset does.
"""

from __future__ import annotations

import csv
import json
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

SONNET_PATH = Path(__file__).parent / "data" / "sonnet.txt"
SONNET_BASE_PROMPT = "Pick as many lines as you can from these poem lines:\n"
MAX_ROUNDTRIPS = 10


@dataclass
class SampleRequest:
    prompt: str
    prompt_len: int
    expected_output_len: int
    # The prompt without the chat template, for backends whose server applies it (openai-chat).
    raw_prompt: str | None = None


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def _chat(tokenizer: Any, content: str) -> str:
    if not getattr(tokenizer, "chat_template", None):  # None, or a server's "none" (False)
        return content
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )


def _plain_vocab(tokenizer: Any) -> np.ndarray:
    """Token ids a random prompt may use: the base vocabulary minus special tokens."""
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    ids = np.array([t for t in range(tokenizer.vocab_size) if t not in special])
    if ids.size == 0:
        raise ValueError("the tokenizer has no non-special tokens to build random prompts from")
    return ids


def _fit_length(tokenizer: Any, token_ids: list[int], target: int, vocab: np.ndarray,
                rng: np.random.Generator) -> str:
    """Text that re-tokenizes to ``target`` tokens (decode/encode is not a round trip)."""
    prompt = tokenizer.decode(token_ids)
    for _ in range(MAX_ROUNDTRIPS):
        ids = _encode(tokenizer, prompt)
        if len(ids) < target:
            ids.extend(vocab[rng.integers(0, vocab.size, target - len(ids))].tolist())
        elif len(ids) > target:
            ids = ids[:target]
        else:
            break
        prompt = tokenizer.decode(ids)
    return prompt


def sample_random_requests(
    tokenizer: Any,
    num_prompts: int,
    input_len: int = 1024,
    output_len: int = 128,
    range_ratio: float = 1.0,
    prefix_len: int = 0,
    use_chat_template: bool = False,
    seed: int = 0,
) -> list[SampleRequest]:
    """Prompts of random vocabulary tokens: ``prefix_len`` shared ones, then input lengths
    uniform in [input_len * range_ratio, input_len] (output lengths likewise)."""
    if not 0.0 <= range_ratio <= 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1], got {range_ratio}")
    rng = np.random.default_rng(seed)
    vocab = _plain_vocab(tokenizer)
    prefix = vocab[rng.integers(0, vocab.size, prefix_len)].tolist()
    if use_chat_template:
        # The template's own tokens count toward the input length.
        overhead = len(_encode(tokenizer, _chat(tokenizer, "a"))) - 1
        input_len = max(1, input_len - overhead)

    def lengths(n: int) -> list[int]:
        return rng.integers(max(1, int(n * range_ratio)), n + 1, num_prompts).tolist()

    input_lens, output_lens = lengths(input_len), lengths(output_len)
    offsets = rng.integers(0, vocab.size, num_prompts)
    requests = []
    for i in range(num_prompts):
        body = vocab[(offsets[i] + i + np.arange(input_lens[i])) % vocab.size].tolist()
        raw = _fit_length(tokenizer, prefix + body, prefix_len + input_lens[i], vocab, rng)
        prompt = _chat(tokenizer, raw) if use_chat_template else raw
        requests.append(SampleRequest(prompt, len(_encode(tokenizer, prompt)), output_lens[i], raw))
    return requests


def _keep(prompt_len: int, output_len: int, fixed_output: bool) -> bool:
    """vLLM's ShareGPT pruning: drop tiny and overlong conversations."""
    if prompt_len < 4 or (not fixed_output and output_len < 4):
        return False
    return prompt_len <= 1024 and prompt_len + output_len <= 2048


def _turn_text(turn: dict[str, Any]) -> str:
    return str(turn.get("value", turn.get("content", "")))


def _pairs_from_conversations(rows: list[Any], seed: int) -> list[tuple[str, str]]:
    pairs = []
    for row in rows:
        conv = row.get("conversations") or row.get("conversation") or row.get("messages") or []
        if len(conv) >= 2:
            pairs.append((_turn_text(conv[0]), _turn_text(conv[1])))
    random.Random(seed).shuffle(pairs)
    return pairs


def _from_pairs(
    tokenizer: Any,
    pairs: list[tuple[str, str | None]],
    num_prompts: int,
    output_len: int | None,
    source: str,
) -> list[SampleRequest]:
    requests = []
    for prompt, completion in pairs:
        if len(requests) == num_prompts:
            break
        prompt_len = len(_encode(tokenizer, prompt))
        if output_len is not None:
            out_len = output_len
        elif completion is not None:
            out_len = len(_encode(tokenizer, completion))
        else:
            raise ValueError(
                f"{source} has no completions to size the output by: pass an output length")
        if _keep(prompt_len, out_len, output_len is not None):
            requests.append(SampleRequest(prompt, prompt_len, out_len, prompt))
    if len(requests) < num_prompts:
        raise ValueError(f"{source} yields {len(requests)} usable prompts, "
                         f"fewer than --num-prompts {num_prompts}")
    return requests


def _local_file(path: str | None, name: str) -> Path:
    if not path:
        raise ValueError(f"--dataset-name {name} needs --dataset-path "
                         "(a local file; nothing is downloaded)")
    p = Path(path).expanduser()
    if not p.is_file():
        raise FileNotFoundError(f"--dataset-path {path} is not a file")
    return p


def sample_sharegpt_requests(
    dataset_path: str | None,
    num_prompts: int,
    tokenizer: Any,
    output_len: int | None = None,
    seed: int = 0,
) -> list[SampleRequest]:
    """First human turn as the prompt, the reply's length as the output length (or
    ``output_len``)."""
    rows = json.loads(_local_file(dataset_path, "sharegpt").read_text())
    pairs = _pairs_from_conversations(rows, seed)
    return _from_pairs(tokenizer, pairs, num_prompts, output_len, "ShareGPT")


def sample_burstgpt_requests(
    dataset_path: str | None, num_prompts: int, tokenizer: Any, seed: int = 0
) -> list[SampleRequest]:
    """Request/response token counts of GPT-4 rows from a BurstGPT CSV, with synthetic prompts
    of that many tokens (the trace carries lengths, not text)."""
    with open(_local_file(dataset_path, "burstgpt"), newline="") as f:
        rows = [r for r in csv.DictReader(f)
                if r.get("Model") == "GPT-4" and int(float(r["Response tokens"])) > 0]
    if not rows:
        raise ValueError(f"{dataset_path} has no GPT-4 rows with a response "
                         "(columns: Model, Request tokens, Response tokens)")
    rng = np.random.default_rng(seed)
    picked = rng.choice(len(rows), size=num_prompts, replace=len(rows) < num_prompts)
    vocab = _plain_vocab(tokenizer)
    requests = []
    for i, k in enumerate(picked):
        in_len = int(float(rows[k]["Request tokens"]))
        out_len = int(float(rows[k]["Response tokens"]))
        token_ids = vocab[(i + np.arange(in_len)) % vocab.size].tolist()
        prompt = _fit_length(tokenizer, token_ids, in_len, vocab, rng)
        requests.append(SampleRequest(prompt, len(_encode(tokenizer, prompt)), out_len, prompt))
    return requests


def sample_sonnet_requests(
    tokenizer: Any,
    num_prompts: int,
    input_len: int = 550,
    output_len: int = 150,
    prefix_len: int = 200,
    dataset_path: str | None = None,
    seed: int = 0,
) -> list[SampleRequest]:
    """Poem lines after an instruction: the first lines shared by every prompt (``prefix_len``
    tokens), then random lines up to ``input_len`` tokens; the chat template applied."""
    path = Path(dataset_path).expanduser() if dataset_path else SONNET_PATH
    lines = path.read_text().splitlines(keepends=True)
    avg_line = sum(len(_encode(tokenizer, line)) for line in lines) / len(lines)
    base_len = len(_encode(tokenizer, _chat(tokenizer, SONNET_BASE_PROMPT)))
    if input_len <= base_len or prefix_len <= base_len:
        raise ValueError("--sonnet-input-len and --sonnet-prefix-len must exceed the "
                         f"{base_len} tokens of the instruction")
    num_input = round((input_len - base_len) / avg_line)
    num_prefix = min(round((prefix_len - base_len) / avg_line), num_input)
    prefix = lines[:num_prefix]
    rnd = random.Random(seed)
    requests = []
    for _ in range(num_prompts):
        raw = SONNET_BASE_PROMPT + "".join(prefix + rnd.choices(lines, k=num_input - num_prefix))
        prompt = _chat(tokenizer, raw)
        requests.append(SampleRequest(prompt, len(_encode(tokenizer, prompt)), output_len, raw))
    return requests


def load_hf_rows(
    dataset_path: str | None, subset: str | None = None, split: str = "train"
) -> list[dict]:
    """Rows of a Hugging Face dataset from a local copy (save_to_disk dir, dataset repo dir, or
    a json/jsonl/csv/parquet file). Never the network: a missing copy is an error."""
    if not dataset_path or not os.path.exists(os.path.expanduser(dataset_path)):
        raise FileNotFoundError(
            f"--dataset-name hf reads a local copy only; --dataset-path {dataset_path!r} "
            "does not exist (download it elsewhere with `datasets` and pass its directory)"
        )
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import datasets
    except ImportError as exc:
        raise ImportError(
            "--dataset-name hf needs the `datasets` package (pip install datasets)") from exc
    path = Path(dataset_path).expanduser()
    saved_to_disk = (path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists()
    if path.is_dir() and saved_to_disk:
        ds = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict):
            ds = ds[split]
    elif path.is_file():
        kind = {".jsonl": "json", ".json": "json", ".csv": "csv",
                ".parquet": "parquet"}.get(path.suffix)
        if kind is None:
            raise ValueError(f"cannot read {path}: expected .json, .jsonl, .csv or .parquet")
        ds = datasets.load_dataset(kind, data_files=str(path), split="train")
    else:
        ds = datasets.load_dataset(str(path), subset, split=split)
    return list(ds)


PROMPT_COLUMNS = ("prompt", "question", "instruction", "input", "text")
COMPLETION_COLUMNS = ("completion", "answer", "response", "output")


def sample_hf_requests(
    dataset_path: str | None, num_prompts: int, tokenizer: Any, subset: str | None = None,
    split: str = "train", output_len: int | None = None, seed: int = 0,
) -> list[SampleRequest]:
    """ShareGPT-style ``conversations`` rows, or a prompt column (prompt/question/instruction/
    input/text) with an optional completion column (completion/answer/response/output)."""
    rows = load_hf_rows(dataset_path, subset, split)
    if rows and any(k in rows[0] for k in ("conversations", "conversation", "messages")):
        pairs: list[tuple[str, str | None]] = list(_pairs_from_conversations(rows, seed))
    else:
        col = next((c for c in PROMPT_COLUMNS if rows and c in rows[0]), None)
        if col is None:
            raise ValueError(f"no prompt column in {dataset_path}: "
                             f"expected conversations or one of {PROMPT_COLUMNS}")
        done = next((c for c in COMPLETION_COLUMNS if c in rows[0]), None)
        pairs = [(str(r[col]), str(r[done]) if done else None) for r in rows]
        random.Random(seed).shuffle(pairs)
    return _from_pairs(tokenizer, pairs, num_prompts, output_len, f"HF dataset {dataset_path}")


def get_samples(args: Any, tokenizer: Any) -> list[SampleRequest]:
    """The requests --dataset-name and its options ask for."""
    name = args.dataset_name
    if name == "random":
        return sample_random_requests(
            tokenizer, args.num_prompts, args.random_input_len, args.random_output_len,
            args.random_range_ratio, args.random_prefix_len, args.use_chat_template, args.seed,
        )
    if name == "sharegpt":
        return sample_sharegpt_requests(args.dataset_path, args.num_prompts, tokenizer,
                                        args.sharegpt_output_len, args.seed)
    if name == "burstgpt":
        return sample_burstgpt_requests(args.dataset_path, args.num_prompts, tokenizer, args.seed)
    if name == "sonnet":
        return sample_sonnet_requests(tokenizer, args.num_prompts, args.sonnet_input_len,
                                      args.sonnet_output_len, args.sonnet_prefix_len,
                                      args.dataset_path, args.seed)
    if name == "hf":
        return sample_hf_requests(args.dataset_path, args.num_prompts, tokenizer, args.hf_subset,
                                  args.hf_split, args.hf_output_len, args.seed)
    raise ValueError(f"unknown --dataset-name {name!r}")
