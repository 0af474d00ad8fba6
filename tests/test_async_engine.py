"""AsyncEngine: concurrent streams, chunked streaming, cancellation, limits, fault isolation,
and an event loop that never waits on model compute."""

import asyncio
import logging
import os
import random
import threading
import time

import pytest

from specstream import Engine, EngineConfig, SamplingParams, SpeculativeConfig
from specstream.engine.async_engine import AsyncEngine
from specstream.errors import EngineDeadError, InvalidRequestError, QueueFull, RequestFailed

PROMPTS = [
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "def add(a, b):\n    return a + b\n\ndef add(",
    "Paris",
    "Speculative decoding lets a small proposer guess tokens. Speculative",
    [{"role": "user", "content": "Hello! How can I help you today?"}],
    [5, 6, 7, 8, 9, 5, 6, 7],
    "Caf\u00e9 na\u00efve \u4f60\u597d",
    "Hello world " * 6,
]


def make_engine(model, method="ngram", k=4, **kw) -> Engine:
    spec = SpeculativeConfig(method=method, num_speculative_tokens=k, adaptive=False)
    return Engine(EngineConfig(model=str(model), dtype="float32", speculative=spec, **kw), log=False)


@pytest.fixture
async def aengine(tiny_model_dir):
    async with AsyncEngine(engine=make_engine(tiny_model_dir)) as e:
        yield e


def mixed_requests():
    reqs = []
    for i in range(16):
        params = SamplingParams(
            max_tokens=8 + 3 * i,
            temperature=0 if i % 3 else 0.9,
            top_p=0.95,
            seed=100 + i,
            presence_penalty=0.5 if i % 4 == 0 else 0.0,
            ignore_eos=True,
        )
        reqs.append((PROMPTS[i % len(PROMPTS)], params))
    return reqs


async def collect(engine: AsyncEngine, prompt, params):
    chunks = [c async for c in engine.stream(prompt, params)]
    return chunks


async def test_sixteen_concurrent_streams_equal_each_alone(tiny_model_dir, aengine):
    reqs = mixed_requests()
    alone = make_engine(tiny_model_dir)
    expected = [alone.generate(p, sp)[0] for p, sp in reqs]
    results = await asyncio.gather(*(collect(aengine, p, sp) for p, sp in reqs))
    for chunks, want in zip(results, expected):
        assert [t for c in chunks for t in c.token_ids] == want.token_ids
        assert "".join(c.text for c in chunks) == want.text
        assert chunks[-1].finish_reason == want.finish_reason == "length"
        assert chunks[-1].usage.completion_tokens == len(want.token_ids)
        assert all(c.finish_reason is None for c in chunks[:-1])
    assert any(len(c.token_ids) > 1 for chunks in results for c in chunks), "accepted drafts arrive as one chunk"


async def test_streamed_text_equals_generate(aengine):
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    chunks = await collect(aengine, PROMPTS[0], params)
    out = await aengine.generate(PROMPTS[0], params)
    assert "".join(c.text for c in chunks) == out.text
    assert [t for c in chunks for t in c.token_ids] == out.token_ids
    assert out.prompt_token_ids and out.usage.prompt_tokens == chunks[-1].usage.prompt_tokens
    assert sum(c.num_drafted for c in chunks) == out.stats.drafted


async def test_stop_string_across_chunks_is_never_streamed(tiny_model_dir, aengine):
    full = make_engine(tiny_model_dir).generate(PROMPTS[3], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))[0].text
    stop = full[12:17]
    chunks = await collect(aengine, PROMPTS[3], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=[stop]))
    streamed = "".join(c.text for c in chunks)
    assert streamed == full[: full.index(stop)]
    assert chunks[-1].finish_reason == "stop"


async def wait_for(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.005)


async def test_leaving_a_stream_early_frees_its_kv(aengine):
    pool = aengine.engine.pool
    stream = aengine.stream(PROMPTS[0], SamplingParams(max_tokens=500, temperature=0, ignore_eos=True))
    async for _ in stream:
        break
    await stream.aclose()
    await wait_for(lambda: aengine.engine.num_running == 0 and pool.num_free_blocks == pool.num_blocks)


async def test_two_hundred_random_cancellations_leave_the_pool_as_it_started(aengine):
    pool = aengine.engine.pool
    rng = random.Random(0)

    async def consume(prompt, n_chunks):
        async for i, _ in aenumerate(aengine.stream(prompt, SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))):
            if i >= n_chunks:
                return

    tasks = []
    for i in range(200):
        prompt = PROMPTS[i % len(PROMPTS)]
        task = asyncio.create_task(consume(prompt, rng.randint(0, 5)))
        tasks.append(task)
        if rng.random() < 0.5:
            await asyncio.sleep(rng.random() * 0.01)
            task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await wait_for(lambda: aengine.engine.num_running == 0 and aengine.engine.num_waiting == 0)
    assert pool.num_free_blocks == pool.num_blocks
    assert not aengine.engine.has_unfinished()


async def aenumerate(it):
    i = 0
    async for x in it:
        yield i, x
        i += 1


async def test_queue_full_is_a_clear_error(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    release = threading.Event()
    real_step = engine.step
    engine.step = lambda: (release.wait(10), real_step())[1]
    async with AsyncEngine(engine=engine, max_waiting=3) as ae:
        streams = [ae.stream(PROMPTS[0], SamplingParams(max_tokens=4)) for _ in range(3)]
        firsts = [asyncio.create_task(s.__anext__()) for s in streams]
        await wait_for(lambda: ae.num_waiting == 3)
        with pytest.raises(QueueFull):
            await ae.stream(PROMPTS[0], SamplingParams(max_tokens=4)).__anext__()
        release.set()
        await asyncio.gather(*firsts)
        for s in streams:
            await s.aclose()


async def test_prompt_longer_than_context_fails_before_compute(tiny_model_dir):
    async with AsyncEngine(engine=make_engine(tiny_model_dir, max_model_len=64)) as ae:
        with pytest.raises(InvalidRequestError, match="context is 64 tokens"):
            await ae.generate(list(range(100)), SamplingParams(max_tokens=4))
        assert ae.is_healthy


async def test_one_failing_request_does_not_harm_the_others(tiny_model_dir, aengine, caplog):
    engine = aengine.engine
    real_submit = engine.submit

    def submit(seq):
        if seq.request_id.startswith("bad#"):
            def explode(token_id):
                raise RuntimeError("detokenizer broke")
            seq.detokenizer.add = explode
        return real_submit(seq)

    engine.submit = submit
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    good = [asyncio.create_task(aengine.generate(p, params)) for p in PROMPTS[:4]]
    with caplog.at_level(logging.ERROR, logger="specstream"), pytest.raises(RequestFailed) as failed:
        await aengine.generate(PROMPTS[0], params, request_id="bad")
    # The client's message names no internal id and no internal detail; the log has both.
    assert "bad" not in str(failed.value) and "#" not in str(failed.value) and "RuntimeError" in str(failed.value)
    assert any("bad#" in r.getMessage() and "detokenizer broke" in str(r.exc_info[1]) for r in caplog.records if r.exc_info)
    outs = await asyncio.gather(*good)
    assert all(len(o.token_ids) == 20 for o in outs)
    assert aengine.is_healthy
    await wait_for(lambda: engine.pool.num_free_blocks == engine.pool.num_blocks)


async def test_fatal_engine_error_fails_every_stream_and_marks_unhealthy(tiny_model_dir, caplog):
    engine = make_engine(tiny_model_dir)
    async with AsyncEngine(engine=engine) as ae:
        params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
        streams = [asyncio.create_task(ae.generate(p, params)) for p in PROMPTS[:3]]
        await wait_for(lambda: engine.num_running == 3)

        def broken(items):
            raise RuntimeError("device lost")

        engine.runner.forward = broken
        with caplog.at_level(logging.CRITICAL, logger="specstream"):
            results = await asyncio.wait_for(asyncio.gather(*streams, return_exceptions=True), 10)
        assert all(isinstance(r, EngineDeadError) for r in results)
        assert not ae.is_healthy and ae.state == "failed" and str(ae.failure) == "device lost"
        assert str(await asyncio.wait_for(ae.wait_failed(), 1)) == "device lost"
        assert any(r.exc_info and str(r.exc_info[1]) == "device lost" for r in caplog.records), "logged with its traceback"
        with pytest.raises(EngineDeadError):
            await ae.generate(PROMPTS[0], params)


async def test_chunked_prefill_interleaves_with_running_streams(tiny_model_dir):
    engine = make_engine(tiny_model_dir, max_num_batched_tokens=32)
    async with AsyncEngine(engine=engine) as ae:
        runner = ae.stream(PROMPTS[0], SamplingParams(max_tokens=300, temperature=0, ignore_eos=True))
        await runner.__anext__()
        long_prompt = list(range(10, 330))  # 320 tokens: ten prefill chunks
        arrivals = []
        long_task = asyncio.create_task(ae.generate(long_prompt, SamplingParams(max_tokens=1)))
        async for chunk in runner:
            arrivals.append(chunk)
            if long_task.done():
                break
        await long_task
        await runner.aclose()
        # The running stream kept getting a chunk every step while the prompt was fed.
        assert len(arrivals) >= 320 // 32


async def test_event_loop_stays_responsive_under_full_load(default_model_source):
    engine = Engine(EngineConfig(dtype="bfloat16", speculative=SpeculativeConfig(method="ngram")), log=False)
    async with AsyncEngine(engine=engine) as ae:
        lateness = []
        stop = asyncio.Event()

        async def ticker():
            while not stop.is_set():
                start = time.perf_counter()
                await asyncio.sleep(0.005)
                lateness.append(time.perf_counter() - start - 0.005)

        tick = asyncio.create_task(ticker())
        params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
        prompts = [f"Write a sentence about the number {i}." for i in range(16)]
        await asyncio.gather(*(ae.generate([{"role": "user", "content": p}], params) for p in prompts))
        stop.set()
        await tick
    assert len(lateness) > 20
    # Were the loop waiting on model compute, nearly every tick would be a whole step late;
    # judge the typical tick and bound the worst one loosely (a 2-core machine also runs the
    # tokenizer thread and the OS), rather than fail on one scheduler hiccup.
    lateness.sort()
    assert lateness[int(0.95 * len(lateness))] < 0.05
    assert lateness[-1] < 0.5


async def test_utf8_is_never_split_across_chunks(default_model_source):
    # The dense fp32 weights: the test needs an answer that echoes the multibyte text, and the 135M model's
    # answer to this prompt changes with the kernels' rounding (a8 rounds activations to 8 bits and it does not
    # echo); what is tested here is the detokenizer, whatever the numerics.
    config = EngineConfig(dtype="float32", quantization="none", compile=False, speculative=SpeculativeConfig(method="ngram"))
    engine = Engine(config, log=False)
    async with AsyncEngine(engine=engine) as ae:
        msgs = [{"role": "user", "content": "Repeat exactly: caf\u00e9 \u4f60\u597d\u4e16\u754c \U0001f600\U0001f680 na\u00efve \u00fcber"}]
        chunks = [c async for c in ae.stream(msgs, SamplingParams(max_tokens=40, temperature=0))]
    ids = [t for c in chunks for t in c.token_ids]
    assert all("\ufffd" not in c.text for c in chunks)
    # A character cut off by max_tokens is withheld rather than emitted as U+FFFD.
    assert "".join(c.text for c in chunks) == engine.tokenizer.decode(ids, skip_special_tokens=True).rstrip("\ufffd")
    assert "\u4f60\u597d" in "".join(c.text for c in chunks)


async def test_metrics_count_rounds_latencies_and_finishes(aengine):
    from prometheus_client import generate_latest

    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    outs = await asyncio.gather(*(aengine.generate(p, params) for p in PROMPTS[:4]))
    text = generate_latest(aengine.metrics.registry).decode()

    def value(name, labels=""):
        for line in text.splitlines():
            if line.startswith(name + labels + " ") or line.startswith(name + "{" + labels.strip("{}") + "}"):
                return float(line.rsplit(" ", 1)[1])
        raise AssertionError(f"{name}{labels} missing")

    drafted = sum(o.stats.drafted for o in outs)
    accepted = sum(o.stats.accepted for o in outs)
    assert value("specstream_spec_decode_num_draft_tokens_total") == drafted > 0
    assert value("specstream_spec_decode_num_accepted_tokens_total") == accepted
    assert value("specstream_spec_decode_num_accepted_tokens_per_pos_total", '{method="ngram",position="0"}') == sum(
        o.stats.accepted_per_position[0] for o in outs if o.stats.accepted_per_position
    )
    assert value("specstream_generation_tokens_total") == 80
    assert value("specstream_time_to_first_token_seconds_count") == 4
    assert value("specstream_e2e_request_latency_seconds_count") == 4
    assert value("specstream_inter_token_latency_seconds_count") > 0
    assert value("specstream_request_success_total", '{finished_reason="length"}') == 4
    assert value("specstream_num_requests_running") == 0
    assert value("specstream_kv_cache_usage_perc") == 0.0


async def test_engine_is_built_in_the_worker_thread_from_a_config(tiny_model_dir):
    cfg = EngineConfig(model=str(tiny_model_dir), dtype="float32")
    async with AsyncEngine(cfg) as ae:
        out = await ae.generate(PROMPTS[0], SamplingParams(max_tokens=5, temperature=0))
        assert len(out.token_ids) == 5 and ae.is_healthy


async def test_a_model_that_cannot_load_fails_start():
    from specstream import ModelError

    with pytest.raises(ModelError, match="does not exist"):
        async with AsyncEngine(EngineConfig(model="./no/such/model")):
            pass


async def test_abort_ends_the_stream_with_finish_reason_abort(aengine):
    stream = aengine.stream(PROMPTS[0], SamplingParams(max_tokens=500, temperature=0, ignore_eos=True), request_id="to-abort")
    first = await stream.__anext__()
    await aengine.abort("to-abort")
    rest = [c async for c in stream]
    assert rest[-1].finish_reason == "abort" and rest[-1].usage.completion_tokens >= len(first.token_ids)
    await wait_for(lambda: aengine.engine.num_running == 0)


async def test_metrics_show_nothing_running_once_the_last_request_is_aborted(aengine):
    stream = aengine.stream(PROMPTS[0], SamplingParams(max_tokens=500, temperature=0, ignore_eos=True), request_id="last")
    await stream.__anext__()
    registry = aengine.metrics.registry
    assert registry.get_sample_value("specstream_num_requests_running") == 1
    await stream.aclose()
    await wait_for(lambda: aengine.engine.num_running == 0)
    assert registry.get_sample_value("specstream_num_requests_running") == 0
    assert registry.get_sample_value("specstream_kv_cache_usage_perc") == 0


async def test_a_reused_request_id_never_gets_the_old_streams_chunks(aengine):
    params = SamplingParams(max_tokens=300, temperature=0, ignore_eos=True)
    old = aengine.stream(PROMPTS[0], params, request_id="same")
    await old.__anext__()
    await old.aclose()
    new = [c async for c in aengine.stream(PROMPTS[2], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True), request_id="same")]
    assert sum(len(c.token_ids) for c in new) == 5 and all(c.request_id == "same" for c in new)
    await wait_for(lambda: aengine.engine.num_running == 0)


async def test_stop_aborts_requests_left_behind(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    ae = AsyncEngine(engine=engine)
    await ae.start()
    task = asyncio.create_task(ae.generate(PROMPTS[0], SamplingParams(max_tokens=800, temperature=0, ignore_eos=True)))
    await wait_for(lambda: engine.num_running == 1)
    await ae.stop()
    with pytest.raises(EngineDeadError):
        await task
    assert not engine.has_unfinished() and engine.pool.num_free_blocks == engine.pool.num_blocks


async def test_oversized_prompts_never_stall_a_running_stream(tiny_model_dir, aengine):
    """20 prompts of about 4 MB each (strings and chat messages) arrive while a stream runs:
    each is refused as too long, and the stream's worst gap between chunks stays under 1 s
    and within a generous multiple of its own worst gap before they came."""
    stream = aengine.stream(PROMPTS[0], SamplingParams(max_tokens=900, temperature=0, ignore_eos=True))
    arrivals = []

    async def consume():
        async for _ in stream:
            arrivals.append(time.perf_counter())

    consumer = asyncio.create_task(consume())
    await wait_for(lambda: len(arrivals) >= 40)
    baseline = max(b - a for a, b in zip(arrivals, arrivals[1:]))
    flood_start = len(arrivals) - 1
    huge = "word " * 800_000  # 4 MB
    floods = [huge if i % 2 else [{"role": "user", "content": huge}] for i in range(20)]
    refusals = (aengine.generate(p, SamplingParams(max_tokens=4)) for p in floods)
    results = await asyncio.gather(*refusals, return_exceptions=True)
    n = len(arrivals)
    await wait_for(lambda: len(arrivals) >= n + 10)
    consumer.cancel()
    assert all(isinstance(r, InvalidRequestError) for r in results)
    assert all(r.code == "context_length_exceeded" and r.param == "prompt" for r in results)
    during = arrivals[flood_start:]
    worst = max(b - a for a, b in zip(during, during[1:]))
    assert worst < 1.0 and worst < 20 * baseline + 0.05, f"worst gap {worst:.3f} s, baseline {baseline:.3f} s"


async def test_prompts_are_tokenized_off_the_loop_and_the_engine_thread_with_their_own_tokenizer(aengine):
    tok = aengine.tokenizer
    assert tok is not aengine.engine.tokenizer
    threads = []
    for name in ("encode", "apply_chat_template"):
        real = getattr(tok, name)

        def spy(*args, _real=real, **kw):
            threads.append(threading.current_thread().name)
            return _real(*args, **kw)

        setattr(tok, name, spy)
    await aengine.generate(PROMPTS[0], SamplingParams(max_tokens=2))
    await aengine.generate(PROMPTS[4], SamplingParams(max_tokens=2))
    assert len(threads) >= 2 and all(t.startswith("specstream-tokenizer") for t in threads)


async def test_a_failed_model_load_is_state_failed_and_logged(caplog):
    from specstream import ModelError

    ae = AsyncEngine(EngineConfig(model="./no/such/model"))
    with caplog.at_level(logging.ERROR, logger="specstream"), pytest.raises(ModelError):
        await ae.start()
    assert ae.state == "failed" and isinstance(ae.failure, ModelError)
    assert isinstance(await asyncio.wait_for(ae.wait_failed(), 1), ModelError)
    assert any("could not start" in r.getMessage() for r in caplog.records)


async def test_stop_ends_open_streams_even_when_the_engine_cannot_abort(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    ae = await AsyncEngine(engine=engine).start()
    task = asyncio.create_task(ae.generate(PROMPTS[0], SamplingParams(max_tokens=800, temperature=0, ignore_eos=True)))
    await wait_for(lambda: engine.num_running == 1)

    def broken(request_id):
        raise RuntimeError("abort broke")

    engine.abort = broken
    await ae.stop()
    with pytest.raises(EngineDeadError):
        await asyncio.wait_for(task, 10)


async def test_gauges_are_fresh_after_an_abort_on_an_idle_engine(aengine):
    registry = aengine.metrics.registry
    stream = aengine.stream(PROMPTS[0], SamplingParams(max_tokens=500, temperature=0, ignore_eos=True))
    await stream.__anext__()
    assert registry.get_sample_value("specstream_num_requests_running") == 1
    await stream.aclose()
    # No step runs after the abort (nothing is left to run): the abort itself refreshes them.
    await wait_for(lambda: registry.get_sample_value("specstream_num_requests_running") == 0)
    assert registry.get_sample_value("specstream_kv_cache_usage_perc") == 0.0
    assert registry.get_sample_value("specstream_num_requests_waiting") == 0


def _threads() -> set[int]:
    return {int(t) for t in os.listdir("/proc/self/task")}


def test_start_frees_the_calling_threads_idle_openmp_pool(tiny_model_dir):
    """A second OpenMP pool makes every step about twice as slow on a few cores (openmp.py): the
    thread that starts an AsyncEngine, here after running a parallel region of its own, gives up
    its idle worker, and runs torch fine afterwards."""
    import torch

    from specstream.kernels import openmp

    if openmp._libgomp() is None or len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs libgomp with OpenMP 5.0's pause (Linux) and 2 CPUs")
    results = {}

    def caller() -> None:
        torch.set_num_threads(2)
        a = torch.randn(256, 256)
        first = _threads()
        for _ in range(8):
            a @ a  # parallel regions: this thread now has a pool with one worker
        results["pool"] = _threads() - first
        engine = make_engine(tiny_model_dir)

        async def run():
            async with AsyncEngine(engine=engine) as ae:
                # Only this thread's workers are checked: other tests' threads (executors, pools of
                # their own) may come and go meanwhile.
                results["kept"] = results["pool"] & _threads()
                out = await ae.generate("Hello world", SamplingParams(max_tokens=6, temperature=0))
                results["tokens"] = len(out.token_ids)

        asyncio.run(run())
        results["after"] = (a @ a).shape  # the thread runs parallel regions again (a new pool)

    t = threading.Thread(target=caller)
    t.start()
    t.join()
    assert results["tokens"] == 6 and results["after"] == (256, 256)
    assert len(results["pool"]) == 1, f"the caller's pool: {results['pool']}"
    assert results["kept"] == set(), f"workers of the caller's pool still alive: {results['kept']}"
    assert openmp.release_idle_pool() is True
