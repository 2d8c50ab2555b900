import asyncio

from atom_core.engine.request_stream import RequestDelta, StreamOutputCollector


def test_backlog_merges_into_one_delta():
    c = StreamOutputCollector()
    c.put(RequestDelta("r", "a", [1], num_output_tokens=1, ttft_s=0.5))
    c.put(RequestDelta("r", "b", [2], num_output_tokens=2, ttft_s=0.9))
    c.put(RequestDelta("r", "c", [3], finished=True, finish_reason="length", num_output_tokens=3,
                       latency_s=2.0))
    d = asyncio.run(c.get())
    assert (d.text, d.token_ids, d.merged) == ("abc", [1, 2, 3], 3)
    assert (d.finished, d.finish_reason, d.num_output_tokens) == (True, "length", 3)
    assert (d.ttft_s, d.latency_s) == (0.5, 2.0)  # the first token's time, the last delta's latency
    assert c.get_nowait() is None


def test_consumer_that_keeps_up_sees_each_delta():
    async def run():
        c = StreamOutputCollector()
        seen = []

        async def consume():
            while True:
                d = await c.get()
                seen.append(d.text)
                if d.finished:
                    return

        task = asyncio.create_task(consume())
        for i in range(5):
            c.put(RequestDelta("r", str(i), finished=i == 4))
            await asyncio.sleep(0)
            await asyncio.sleep(0)
        await task
        return seen

    assert asyncio.run(run()) == ["0", "1", "2", "3", "4"]
