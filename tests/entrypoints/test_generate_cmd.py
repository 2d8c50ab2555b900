"""``atom generate`` streams: each step's text reaches stdout (flushed) while the engine is
still generating, and the streamed text is the text ``LLMEngine.generate`` returns."""

from __future__ import annotations

import sys
import threading

import pytest

from atom_core.engine.llm_engine import LLMEngine
from atom_core.entrypoints import generate_cmd
from atom_core.entrypoints.cli import main
from atom_core.sampling_params import SamplingParams
from atom_core.testing.tiny_models import tiny_model_dir


class StepCounter:
    """Wraps LLMEngine.step: how many steps ran, and the engine that ran them."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.steps = 0
        self.engine: LLMEngine | None = None
        step = LLMEngine.step

        def counted(engine: LLMEngine):
            self.engine = engine
            self.steps += 1
            return step(engine)

        monkeypatch.setattr(LLMEngine, "step", counted)


class Recorder:
    """A stdout that notes, for each write and flush, how many engine steps had run."""

    def __init__(self, counter: StepCounter) -> None:
        self.counter = counter
        self.events: list[tuple[str, str, int]] = []

    def write(self, text: str) -> int:
        self.events.append(("write", text, self.counter.steps))
        return len(text)

    def flush(self) -> None:
        self.events.append(("flush", "", self.counter.steps))

    def text(self) -> str:
        return "".join(text for kind, text, _ in self.events if kind == "write")


def test_atom_generate_streams_each_step_to_stdout(monkeypatch):
    counter = StepCounter(monkeypatch)
    out = Recorder(counter)
    monkeypatch.setattr(sys, "stdout", out)
    model = str(tiny_model_dir("llama"))
    # greedy, to compare with generate() below (the model's generation config samples)
    assert main(["generate", "Hello", "--model", model, "--max-tokens", "12", "--device", "cpu",
                 "--no-enable-log-stats", "--temperature", "0"]) == 0
    writes = [(i, steps) for i, (kind, _, steps) in enumerate(out.events) if kind == "write"]
    assert len(writes) >= 3, out.events
    first_step = writes[0][1]
    assert first_step < counter.steps  # the first text went out while steps were still to run
    for i, _ in writes[:-1]:  # each piece is flushed at once (stdout may be a pipe)
        assert out.events[i + 1][0] == "flush", out.events
    engine = counter.engine
    assert engine is not None and engine.is_finished()
    prompt = engine.apply_chat_template([{"role": "user", "content": "Hello"}])
    [whole] = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12))
    assert out.text() == whole["text"] + "\n"


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(str(tiny_model_dir("llama")), enable_log_stats=False, device="cpu")


def test_stream_stops_between_steps_when_asked(engine):
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    stop = threading.Event()
    pieces: list[str] = []

    class StopAfterTwo:
        def write(self, text: str) -> None:
            pieces.append(text)
            if len(pieces) == 2:
                stop.set()

        def flush(self) -> None:
            pass

    text, reason = generate_cmd.stream(engine, "abc", params, StopAfterTwo(), stop)
    assert reason == "abort" and text == "".join(pieces) and len(pieces) == 2
    assert engine.is_finished()  # aborted: nothing left running, its blocks freed
    [whole] = engine.generate(["abc"], params)
    assert whole["text"].startswith(text) and len(whole["token_ids"]) == 40
