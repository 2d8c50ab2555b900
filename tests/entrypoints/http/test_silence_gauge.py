"""atom:stream_longest_silence_seconds sees frames withheld by the tool-call read-ahead:
the gauge is timed where frames leave, after the parser, not where deltas arrive."""

from __future__ import annotations

import asyncio

from atom_core.entrypoints.http.metrics import ServerMetrics
from atom_core.entrypoints.http.openai.chat import OpenAIServingChat
from atom_core.entrypoints.http.openai.protocol import ChatCompletionRequest
from tests.entrypoints.http.scripted_engine import ScriptedEngine
from tests.entrypoints.http.test_chat_tools import TOOLS, USER, qwen3  # noqa: F401

CALL = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "' + "P" * 60
    + '"}}\n</tool_call>'
)


class SlowEngine(ScriptedEngine):
    """Each engine delta arrives 20 ms after the previous one."""

    async def generate(self, prompt_token_ids, params, request_id):
        async for delta in super().generate(prompt_token_ids, params, request_id):
            await asyncio.sleep(0.02)
            yield delta


def test_gauge_reads_the_silence_of_a_held_tool_call_region(qwen3):  # noqa: F811
    engine = SlowEngine("Sure. " + CALL + " Done.", chunk=3, chat_template=qwen3)
    chat = OpenAIServingChat(engine)
    metrics = ServerMetrics("scripted")
    request = ChatCompletionRequest(messages=USER, tools=TOOLS, stream=True, max_tokens=1000)

    async def run() -> tuple[list[float], list[bytes]]:
        response = await chat.create(request, None)
        samples: list[float] = []
        frames: list[bytes] = []
        done = asyncio.Event()

        async def sample() -> None:
            while not done.is_set():
                samples.append(metrics.longest_silence())
                await asyncio.sleep(0.01)

        sampler = asyncio.create_task(sample())
        async for frame in metrics.timed_frames("chat", response.body_iterator):
            frames.append(frame if isinstance(frame, bytes) else frame.encode())
        done.set()
        await sampler
        return samples, frames

    samples, frames = asyncio.run(run())
    # ~40 engine deltas of the call (20 ms apart) are held until the region closes: the
    # gauge must have seen a gap of most of that, while per-delta waits are only 20 ms.
    assert max(samples) > 0.4
    assert metrics.longest_silence() == 0  # nothing in flight once the stream ended
    body = b"".join(frames)
    assert b"get_weather" in body and b'"finish_reason":"tool_calls"' in body
