"""A bad argument to any ``atom`` sub-command costs one line on stderr and a non-zero exit:
no usage block, no traceback, no dump of the parsed arguments. Exit status 2 for what the
parser refuses, 1 for a value refused once the command looks at it (a missing file, a
server that does not answer, a run in which every request failed)."""

from __future__ import annotations

import http.server
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from atom_core.testing.tiny_models import tiny_model_dir

ATOM = Path(sys.executable).with_name("atom")  # the console script, as a user runs it


def atom(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    assert ATOM.is_file(), f"no `atom` script beside {sys.executable}: is atom_core installed?"
    return subprocess.run([str(ATOM), *args], capture_output=True, text=True, timeout=timeout)


def assert_one_line_error(res: subprocess.CompletedProcess[str], prog: str, status: int,
                          *words: str) -> str:
    """The run failed with ``status`` and said so in one line naming ``prog``; returns it."""
    everything = res.stdout + res.stderr
    assert "Traceback" not in everything, everything[-3000:]
    assert "Namespace(" not in everything, everything[-3000:]
    assert res.returncode == status, (res.returncode, everything[-3000:])
    assert res.stdout == "", res.stdout[-3000:]
    lines = res.stderr.splitlines()
    assert len(lines) == 1, res.stderr[-3000:]
    assert lines[0].startswith(f"{prog}: error: "), lines[0]
    for word in words:
        assert word in lines[0], (word, lines[0])
    return lines[0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _NotFound(http.server.BaseHTTPRequestHandler):
    """Answers every request 404: a server that is up but serves nothing the run asks for."""

    def _answer(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        self.rfile.read(length)
        body = b'{"error": {"message": "no such route"}}'
        self.send_response(404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _answer

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def up() -> Iterator[str]:
    """The base URL of a server that accepts connections (and answers 404)."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _NotFound)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    thread.join(10)


@pytest.fixture(scope="module")
def model() -> str:
    return str(tiny_model_dir("llama"))


BENCH = ("bench", "serve")


@pytest.mark.parametrize(
    "args, status, words",
    [
        # what argparse refuses: exit 2
        (("--model", "m", "--no-such-flag"), 2, ("unrecognized arguments: --no-such-flag",)),
        (("--model", "m", "--num-prompts", "abc"), 2, ("--num-prompts", "invalid int value")),
        (("--model", "m", "--request-rate", "fast"), 2, ("--request-rate", "invalid float value")),
        (("--model", "m", "--dataset-name", "nope"), 2, ("--dataset-name", "invalid choice")),
        (("--model", "m", "--backend", "nope"), 2, ("--backend", "invalid choice")),
        ((), 2, ("--model", "required")),
        # values the command refuses before any work: exit 1
        (("--model", "m", "--num-prompts", "0"), 1, ("--num-prompts", "positive")),
        (("--model", "m", "--request-rate", "-1"), 1, ("--request-rate", "positive")),
        (("--model", "m", "--request-rate", "nan"), 1, ("--request-rate", "positive")),
        (("--model", "m", "--request-rate", "0"), 1, ("--request-rate", "positive")),
        (("--model", "m", "--burstiness", "0"), 1, ("--burstiness",)),
        (("--model", "m", "--max-concurrency", "0"), 1, ("--max-concurrency",)),
        (("--model", "m", "--random-range-ratio", "2"), 1, ("--random-range-ratio",)),
        (("--model", "m", "--port", "0"), 1, ("--port",)),
        (("--model", "m", "--dataset-name", "random", "--metric-percentiles", "200"), 1,
         ("--metric-percentiles",)),
        (("--model", "m", "--dataset-name", "random", "--percentile-metrics", "ttft,nope"), 1,
         ("--percentile-metrics", "nope")),
        (("--model", "m", "--dataset-name", "random", "--goodput", "ttft"), 1, ("--goodput",)),
        (("--model", "m", "--dataset-name", "sharegpt"), 1, ("--dataset-path",)),
        (("--model", "m", "--dataset-name", "sharegpt", "--dataset-path", "/no/such/file.json"), 1,
         ("/no/such/file.json", "no such file")),
        (("--model", "m", "--dataset-name", "random", "--base-url", "not-a-url"), 1,
         ("--base-url", "not an http")),
        (("--model", "m", "--dataset-name", "random", "--base-url", "http://127.0.0.1:99999"), 1,
         ("--base-url", "range")),
    ],
)
def test_bench_serve_refuses_a_bad_argument_in_one_line(args, status, words):
    assert_one_line_error(atom(*BENCH, *args), "atom bench serve", status, *words)


def test_an_unreachable_server_is_one_line():
    url = f"http://127.0.0.1:{free_port()}"
    line = assert_one_line_error(
        atom(*BENCH, "--model", "m", "--dataset-name", "random", "--base-url", url),
        "atom bench serve", 1, "cannot reach the server", url,
    )
    assert "--base-url" in line
    assert_one_line_error(
        atom(*BENCH, "--model", "m", "--dataset-name", "random", "--port", str(free_port())),
        "atom bench serve", 1, "cannot reach the server", "--host/--port",
    )


def test_a_missing_tokenizer_is_one_line(up, tmp_path):
    common = ("--dataset-name", "random", "--base-url", up)
    assert_one_line_error(atom(*BENCH, "--model", "/no/such/model", *common), "atom bench serve", 1,
                          "--model /no/such/model", "no such file")
    assert_one_line_error(atom(*BENCH, "--model", "m", "--tokenizer", "./no-such.gguf", *common),
                          "atom bench serve", 1, "--tokenizer ./no-such.gguf")
    # a directory without a tokenizer: transformers' refusal, on one line
    assert_one_line_error(atom(*BENCH, "--model", str(tmp_path), *common), "atom bench serve", 1,
                          f"--model {tmp_path}")


def test_a_malformed_dataset_file_is_one_line(up, model, tmp_path):
    broken = tmp_path / "sharegpt.json"
    broken.write_text("{not json")
    assert_one_line_error(
        atom(*BENCH, "--model", model, "--base-url", up, "--dataset-name", "sharegpt",
             "--dataset-path", str(broken)),
        "atom bench serve", 1, "--dataset-name sharegpt", str(broken),
    )


def test_a_run_in_which_every_request_failed_exits_non_zero(up, model):
    res = atom(*BENCH, "--model", model, "--base-url", up, "--dataset-name", "random",
               "--num-prompts", "2", "--random-input-len", "8", "--random-output-len", "4",
               "--disable-tqdm")
    everything = res.stdout + res.stderr
    assert res.returncode == 1 and "Traceback" not in everything and "Namespace(" not in everything
    assert "Successful requests:" in res.stdout  # the block is still printed
    [line] = res.stderr.splitlines()
    assert line.startswith("atom bench serve: error: every one of the 2 requests"), line
    assert "HTTP 404" in line


@pytest.mark.parametrize(
    "args, prog, status, words",
    [
        (("--no-such-flag",), "atom", 2, ("unrecognized arguments",)),
        (("no-such-command",), "atom", 2, ("invalid choice",)),
        (("bench",), "atom bench", 2, ("required",)),
        (("bench", "nope"), "atom bench", 2, ("invalid choice",)),
        (("serve", "--no-such-flag"), "atom serve", 2, ("unrecognized arguments",)),
        (("serve", "--max-model-len", "many"), "atom serve", 2, ("--max-model-len",)),
        (("generate",), "atom generate", 2, ("prompt",)),
        (("generate", "hi", "--max-tokens", "x"), "atom generate", 2, ("--max-tokens",)),
        (("parse", "--tool-call-parser", "auto", "--chunk-size", "x"), "atom parse", 2,
         ("--chunk-size",)),
        (("parse", "--tool-call-parser", "auto", "--chunk-size", "-1"), "atom parse", 1,
         ("--chunk-size",)),
        (("parse", "--tool-call-parser", "auto", "--tools", "/no/such.json"), "atom parse", 1,
         ("--tools",)),
        (("plugins", "--no-such-flag"), "atom plugins", 2, ("unrecognized arguments",)),
    ],
)
def test_every_sub_command_refuses_in_one_line(args, prog, status, words):
    assert_one_line_error(atom(*args), prog, status, *words)


def test_the_module_entry_point_refuses_in_one_line():
    res = subprocess.run(
        [sys.executable, "-m", "atom_core.benchmarks.benchmark_serving", "--model", "m",
         "--num-prompts", "-1"], capture_output=True, text=True, timeout=120,
    )
    assert_one_line_error(res, "atom bench serve", 1, "--num-prompts")
    res = subprocess.run(
        [sys.executable, "-m", "atom_core.benchmarks.benchmark_serving", "--model", "m", "--x"],
        capture_output=True, text=True, timeout=120,
    )
    assert_one_line_error(res, "atom bench serve", 2, "unrecognized arguments: --x")
