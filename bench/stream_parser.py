"""Stream-parser cost per token: the frontend's reasoning + tool-call read-ahead, per format.

Prints a table of microseconds per token for 2k/4k/8k/16k-token answers and writes JSON:

    python bench/stream_parser.py [--tokens 2048 4096 8192 16384]
        [--json bench/results/stream_parser.json]

Each answer is fed one token (about four characters) at a time through the same reader a
server uses (ResponseParser(format, think).reader(...)), then finished. Three shapes:

    prose   an ordinary answer full of '<' (if a < b, <b>, <= ...): the case that was once
            quadratic, when one '<' made the reader hold and rescan the whole buffer
    call    a short preamble, then one tool call whose argument is the whole answer (a
            file write): the region path, with the early-name read bounded to the head
    quoted  an answer that quotes the format's call opener near its start and explains
            for the rest: a region that never closes, held to the end and released verbatim
    quotes  an answer that quotes the opener every ~40 tokens and never calls: each quote
            opens a region inside the last one's, so a reader that searched each region
            afresh would pay one pass over the rest per quote

The cost per token must stay flat as the answer grows; the last column is the ratio of
the 16k cost to the 2k cost (about 1 when linear, about 8 when quadratic).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

from atom_core.parsing.response import ResponseParser
from atom_core.plugins import get_registries

sys.path.insert(0, str(Path(__file__).parent))
from common import markdown_table, write_json  # noqa: E402

WORDS = ["the", "answer", "is", "if", "(a", "<", "b)", "<b>x</b>", "a", "<=", "b,", "value",
         "x<y", "\n", "code", "."]
TOOLS = [{"type": "function", "function": {"name": "write_file", "parameters": {
    "type": "object",
    "properties": {"path": {"type": "string"}, "content": {"type": "string"}}}}}]


def tokens_of(text: str, rng: random.Random) -> list[str]:
    """Split text into token-sized pieces (1-6 characters, about 4 on average)."""
    out, i = [], 0
    while i < len(text):
        n = rng.randint(2, 6)
        out.append(text[i : i + n])
        i += n
    return out


def prose(n_tokens: int, rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_tokens))


def answer(shape: str, fmt, n_tokens: int) -> list[str]:
    rng = random.Random(n_tokens)
    body = prose(n_tokens, rng)
    if shape == "prose":
        text = body
    elif shape == "call":
        call = fmt.render_call("write_file", {"path": "notes.txt", "content": body})
        text = "Writing the file.\n" + call
    else:
        opener = next(m for m in fmt.START_MARKERS if fmt.opens_region(m))
        if shape == "quoted":
            text = f"To call a tool the model writes {opener} and then: {body}"
        else:
            words = body.split(" ")
            text = " ".join(w if i % 40 else f"{w} {opener}" for i, w in enumerate(words))
    toks = tokens_of(text, rng)
    # Trim or pad to the requested token count so every row reads n tokens.
    while len(toks) < n_tokens:
        toks.append(" x")
    return toks[:n_tokens] if shape == "prose" else toks


def time_one(parser: ResponseParser, toks: list[str], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        reader = parser.reader(tools=TOOLS)
        t0 = time.perf_counter()
        for tok in toks:
            reader.feed(tok)
        reader.finish()
        best = min(best, time.perf_counter() - t0)
    return best / len(toks) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path,
                    default=Path(__file__).parent / "results" / "stream_parser.json")
    args = ap.parse_args()

    reg = get_registries()
    think = reg.reasoning_dialects.get("think")() if "think" in reg.reasoning_dialects else None
    rows = []
    for name in reg.tool_formats.names():
        fmt = reg.tool_formats.get(name)()
        parser = ResponseParser(fmt, think)
        for shape in ("prose", "call", "quoted", "quotes"):
            costs = {n: time_one(parser, answer(shape, fmt, n), args.repeats) for n in args.tokens}
            rows.append({"format": name, "shape": shape, "us_per_token": costs})

    table = []
    for r in rows:
        costs = [r["us_per_token"][n] for n in args.tokens]
        r["growth"] = costs[-1] / costs[0]
        table.append([r["format"], r["shape"], *(f"{c:.2f}" for c in costs), f"{r['growth']:.2f}"])
    def label(n: int) -> str:
        return f"{n // 1024}k" if n % 1024 == 0 else str(n)

    growth = f"{label(args.tokens[-1])}/{label(args.tokens[0])}"
    print("microseconds per token\n")
    print(markdown_table(["format", "shape", *map(label, args.tokens), growth], table))
    path = write_json(args.json, {"tokens": args.tokens, "rows": [
        {**r, "us_per_token": {str(k): v for k, v in r["us_per_token"].items()}} for r in rows]})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
