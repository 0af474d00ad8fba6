"""AsyncEngine: the engine behind asyncio, with streams of chunks.

Three threads, none waiting on another's work:
- the event loop: streams are async generators over an asyncio.Queue of chunks;
- a tokenizer thread (a one-worker executor with a tokenizer of its own): validates and
  tokenizes each request into a complete Sequence, so neither a long prompt nor a chat
  template ever runs on the loop or between engine steps;
- the engine thread, which owns the Engine: it takes commands (add a built Sequence, abort)
  from a thread-safe queue, runs steps while there is work, and hands each step's chunks to
  the loop with call_soon_threadsafe.
Leaving a stream early or cancelling its task sends an abort, applied before the next step.

Faults follow the fault model (docs/ARCHITECTURE.md): a refused request raises InvalidRequestError from stream()
before it reaches the engine; a request that fails while generating ends with RequestFailed
alone; a fatal error (the model cannot load, or the engine thread cannot go on) sets state
to "failed", is logged with its traceback, and ends every open stream with EngineDeadError.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import itertools
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from specstream.config import EngineConfig
from specstream.kernels import openmp
from specstream.engine.engine import Engine
from specstream.errors import EngineDeadError, InvalidRequestError, QueueFull, RequestFailed
from specstream.engine.outputs import RequestOutput, StreamChunk
from specstream.engine.processor import InputProcessor, template_calls_tools
from specstream.sampling import SamplingParams
from specstream.sequence import Sequence, SpecStats

logger = logging.getLogger(__name__)

# Seconds between looks at a background compile while the engine has no work (Engine.idle installs it).
_COMPILE_POLL = 0.5


def _settle(loop: asyncio.AbstractEventLoop, ready: asyncio.Future, exc: BaseException | None) -> None:
    """From the engine thread: resolve start()'s future, unless start() stopped waiting for it (a
    cancelled future, a closed loop)."""

    def resolve() -> None:
        if ready.done():
            return
        if exc is None:
            ready.set_result(None)
        else:
            ready.set_exception(exc)

    try:
        loop.call_soon_threadsafe(resolve)
    except RuntimeError:  # the loop is closed: nobody is waiting
        pass


@dataclass
class _Stream:
    queue: asyncio.Queue
    arrival: float = field(default_factory=time.perf_counter)
    last: float | None = None


class AsyncEngine:
    """``async with AsyncEngine(config) as engine: async for chunk in engine.stream(...)``.

    max_waiting bounds requests accepted but not yet running (being tokenized or queued);
    past it stream() raises QueueFull.
    """

    def __init__(
        self, config: EngineConfig | None = None, *, engine: Engine | None = None, max_waiting: int = 256
    ) -> None:
        self.config = config or (engine.config if engine else EngineConfig())
        self.engine = engine
        self.max_waiting = max_waiting
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        # Streams by engine id ("<request id>#<n>"): a request id reused right after a
        # cancelled stream never receives the old stream's chunks still in flight.
        self._streams: dict[str, _Stream] = {}
        self._active: dict[str, str] = {}  # request id -> engine id of its open stream
        self._ids = itertools.count()
        self._pending_adds = 0  # accepted by stream(), not yet drained by the engine thread
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._tokenizing: ThreadPoolExecutor | None = None
        self._processor: InputProcessor | None = None  # the tokenizer thread's
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False
        self._running = False  # the engine thread has an engine and is taking requests
        self._dead: BaseException | None = None
        self._failed = asyncio.Event()

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> AsyncEngine:
        """Start the engine thread; when no Engine was given, that thread builds it, so that
        model loading and every step run in one thread. This thread's idle OpenMP workers, if
        it ran torch work before (built the given Engine, say), are freed first: with two
        thread pools on a few cores every step runs about twice as slow (openmp.py). A model
        that cannot load raises here and leaves state "failed"."""
        if self._thread is not None:
            return self
        if self._dead is not None:
            raise EngineDeadError("the engine failed; start a new one")
        self._loop = asyncio.get_running_loop()
        openmp.release_idle_pool()
        self._stopping = False
        self._tokenizing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specstream-tokenizer")
        ready: asyncio.Future = self._loop.create_future()
        self._thread = threading.Thread(target=self._run, args=(ready,), name="specstream-engine", daemon=True)
        self._thread.start()
        try:
            await ready
        except asyncio.CancelledError:
            # Stopped while loading (a server shut down, SIGTERM): the engine thread, a daemon, stops once
            # the model is built, and nothing waits for it; the process may exit meanwhile.
            self._stopping = True
            self._wakeup.set()
            self._thread = None
            self._tokenizing.shutdown(wait=False)
            raise
        except BaseException:
            await asyncio.to_thread(self._thread.join)
            self._thread = None
            self._tokenizing.shutdown(wait=False)
            raise
        return self

    async def stop(self) -> None:
        """Stop the engine thread; every open stream ends with EngineDeadError, even when
        cleaning up after a failed engine goes wrong."""
        if self._thread is None:
            return
        self._stopping = True
        self._wakeup.set()
        await asyncio.to_thread(self._thread.join)
        self._thread = None
        self._running = False
        left = list(self._streams)
        self._fail_all(EngineDeadError("the engine was stopped"))
        self._tokenizing.shutdown(wait=False, cancel_futures=True)
        # The engine thread is gone: drop queued commands and abort what the streams left
        # behind, so a restarted engine does not keep generating for nobody.
        while not self._commands.empty():
            if self._commands.get_nowait()[0] == "add":
                with self._lock:
                    self._pending_adds -= 1
        for engine_id in left:
            try:
                self.engine.abort(engine_id)
            except Exception:  # noqa: BLE001 - a failed engine may not abort cleanly; its streams are ended already
                logger.exception("could not abort a request while stopping")

    async def __aenter__(self) -> AsyncEngine:
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    @property
    def is_ready(self) -> bool:
        """The model is loaded and the engine thread takes requests."""
        return self._running and self._thread is not None and self._thread.is_alive()

    @property
    def is_healthy(self) -> bool:
        return self._dead is None and self.is_ready

    @property
    def state(self) -> str:
        """"loading" until the model is loaded, "ready" while serving, "failed" after a
        failed load or a fatal engine error (never confused with loading), "stopped"."""
        if self._dead is not None:
            return "failed"
        if self.is_ready:
            return "ready"
        if self._thread is None and self.engine is not None:
            return "stopped"
        return "loading"

    @property
    def failure(self) -> BaseException | None:
        """The error that failed the engine (state "failed"), else None."""
        return self._dead

    async def wait_failed(self) -> BaseException:
        """Wait until the engine fails (a failed load or a fatal error); return the error.
        The gateway awaits this to exit non-zero, so that its supervisor restarts it."""
        await self._failed.wait()
        return self._dead

    # The narrow surface the gateway uses (like vLLM's EngineClient); valid once ready.
    @property
    def template_calls_tools(self) -> bool:
        """Whether the model's chat template renders tools itself, in the <tool_call> format
        (processor.template_calls_tools), so chat with tools goes to it as a ChatPrompt; False
        until the model is loaded."""
        return self._processor is not None and template_calls_tools(self._processor.tokenizer)

    @property
    def tokenizer(self):
        """The tokenizer thread's own instance (never the engine thread's); safe for the
        loop to decode with."""
        if self._processor is None:
            raise EngineDeadError("the engine is not loaded")
        return self._processor.tokenizer

    @property
    def max_model_len(self) -> int:
        return self._require_engine().max_model_len

    @property
    def model_name(self) -> str:
        return self.config.model

    @property
    def speculative_method(self) -> str:
        spec = self.config.speculative
        return spec.method if spec.enabled else "off"

    @property
    def metrics(self):
        return self._require_engine().metrics

    @property
    def num_running(self) -> int:
        return self.engine.num_running if self.engine is not None else 0

    @property
    def num_waiting(self) -> int:
        """Requests accepted but not yet running (being tokenized, queued in the engine or on their way)."""
        return (self.engine.num_waiting if self.engine is not None else 0) + self._pending_adds

    @property
    def kv_usage(self) -> float:
        """Fraction of the target's KV pool in use (0.0 when idle and nothing leaked)."""
        return self.engine.pool.usage if self.engine is not None else 0.0

    def _require_engine(self) -> Engine:
        if self.engine is None:
            raise EngineDeadError("the engine is not loaded")
        return self.engine

    # -------------------------------------------------------------------- requests
    async def stream(
        self, prompt, params: SamplingParams | None = None, request_id: str | None = None
    ) -> AsyncIterator[StreamChunk]:
        """Chunks of one request as its rounds complete; the last carries finish_reason and
        usage. Raises InvalidRequestError, QueueFull, RequestFailed or EngineDeadError."""
        self._check_accepting()
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._active:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        if self._pending_adds + self.engine.num_waiting >= self.max_waiting:
            raise QueueFull(f"{self.max_waiting} requests are already waiting; retry later")
        engine_id = f"{request_id}#{next(self._ids)}"
        state = _Stream(asyncio.Queue())
        self._streams[engine_id] = state
        self._active[request_id] = engine_id
        with self._lock:
            self._pending_adds += 1
        submitted = finished = False
        try:
            seq = await self._prepare(prompt, params, engine_id)
            self._check_accepting()
            self._commands.put(("add", seq))
            submitted = True
            self._wakeup.set()
            while True:
                item = await state.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                if item.error is not None:
                    finished = True
                    raise RequestFailed(f"the request failed: {item.error}")
                finished = item.finished
                yield dataclasses.replace(item, request_id=request_id)
                if finished:
                    return
        finally:
            if not submitted:
                with self._lock:
                    self._pending_adds -= 1
            self._streams.pop(engine_id, None)
            self._active.pop(request_id, None)
            if submitted and not finished:
                self._commands.put(("abort", engine_id))
                self._wakeup.set()

    def _check_accepting(self) -> None:
        if self._dead is not None:
            raise EngineDeadError("the engine failed; no request can run")
        if not self.is_ready:
            raise EngineDeadError("the engine is not running")

    async def _prepare(self, prompt, params: SamplingParams | None, engine_id: str) -> Sequence:
        """Validate and tokenize in the tokenizer thread; InvalidRequestError when refused."""
        try:
            process = self._processor.process
            return await self._loop.run_in_executor(self._tokenizing, process, prompt, params, engine_id)
        except InvalidRequestError:
            raise
        except Exception as exc:  # noqa: BLE001 - a request that cannot be prepared fails alone
            logger.error("request %s could not be prepared", engine_id, exc_info=exc)
            raise RequestFailed(f"the request could not be prepared ({type(exc).__name__})") from None

    async def generate(
        self, prompt, params: SamplingParams | None = None, request_id: str | None = None
    ) -> RequestOutput:
        """The whole completion at once (streams internally)."""
        text, ids, prompt_ids, stats = [], [], [], SpecStats()
        last = None
        async for chunk in self.stream(prompt, params, request_id):
            text.append(chunk.text)
            ids.extend(chunk.token_ids)
            prompt_ids = chunk.prompt_token_ids or prompt_ids
            stats.record(chunk.num_drafted, chunk.num_accepted, chunk.num_forced, chunk.method)
            last = chunk
        return RequestOutput(last.request_id, prompt_ids, "".join(text), ids, last.finish_reason, stats)

    async def encode(self, prompt, add_special_tokens: bool = True) -> list[int]:
        """The token ids stream() would give prompt (a string, chat messages or a ChatPrompt), bounded the
        same way, tokenized on the tokenizer thread; raises InvalidRequestError or EngineDeadError.
        add_special_tokens=False: a string without the tokenizer's own special tokens (its BOS)."""
        self._check_accepting()
        return await self._loop.run_in_executor(self._tokenizing, self._processor.encode, prompt, add_special_tokens)

    async def decode(self, token_ids: list[int]) -> str:
        """Token ids (within the vocabulary, fewer than the context) as text, on the tokenizer thread."""
        self._check_accepting()
        return await self._loop.run_in_executor(self._tokenizing, self._processor.decode, token_ids)

    async def abort(self, request_id: str) -> None:
        """Stop a request; its stream ends with a last chunk whose finish_reason is "abort"."""
        engine_id = self._active.get(request_id)
        if engine_id is not None:
            self._commands.put(("abort", engine_id))
            self._wakeup.set()

    # ------------------------------------------------------- event-loop side of hand-off
    def _deliver(self, chunks: list) -> None:
        now = time.perf_counter()
        m = self.engine.metrics
        for request_id, item in chunks:
            state = self._streams.get(request_id)
            if state is None:
                continue
            if isinstance(item, StreamChunk):
                if state.last is None:
                    m.time_to_first_token.observe(now - state.arrival)
                else:
                    m.inter_token_latency.observe(now - state.last)
                state.last = now
                if item.finished:
                    m.e2e_latency.observe(now - state.arrival)
            state.queue.put_nowait(item)

    def _fail_all(self, exc: BaseException) -> None:
        for state in list(self._streams.values()):
            state.queue.put_nowait(exc)

    def _mark_failed(self, exc: BaseException) -> None:
        """Engine thread: record a fatal error and end every open stream with it."""
        self._dead = exc
        try:
            self._loop.call_soon_threadsafe(self._failed.set)
            self._loop.call_soon_threadsafe(self._fail_all, EngineDeadError("the engine failed; no request can run"))
        except RuntimeError:  # the loop is closed: no stream is left to end
            pass

    # ------------------------------------------------------------------ engine thread
    def _drain(self) -> list:
        """Apply queued commands; return (engine id, item) pairs to deliver."""
        out = []
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return out
            if cmd[0] == "add":
                with self._lock:
                    self._pending_adds -= 1
                try:
                    self.engine.submit(cmd[1])
                except InvalidRequestError as exc:
                    out.append((cmd[1].request_id, exc))
            else:
                last = self.engine.abort(cmd[1])
                if last is not None:
                    out.append((cmd[1], last))

    def _run(self, ready: asyncio.Future) -> None:
        loop = self._loop
        try:
            if self.engine is None:
                self.engine = Engine(self.config)
            # The tokenizer thread gets a tokenizer of its own: tokenizers are not safe to
            # share between threads.
            self._processor = self.engine.processor.with_tokenizer(copy.deepcopy(self.engine.tokenizer))
        except BaseException as exc:  # noqa: BLE001 - reported to start()'s caller
            logger.error("the engine could not start: %s", exc, exc_info=exc)
            self._mark_failed(exc)
            _settle(loop, ready, exc)
            return
        if self._stopping:  # start() was cancelled while the model loaded
            return
        self._running = True
        _settle(loop, ready, None)
        engine = self.engine
        idle = False  # engine.idle() ran since the last step
        try:
            while not self._stopping:
                self._wakeup.clear()
                handed = self._drain()
                if handed:
                    loop.call_soon_threadsafe(self._deliver, handed)
                if not engine.has_unfinished():
                    if not idle or engine.compiling:
                        engine.idle()
                        idle = not engine.compiling
                    # While a compile runs in the background, look again now and then to install it.
                    self._wakeup.wait(_COMPILE_POLL if engine.compiling else None)
                    continue
                idle = False
                chunks = engine.step()
                if chunks:
                    loop.call_soon_threadsafe(self._deliver, [(c.request_id, c) for c in chunks])
        except BaseException as exc:  # noqa: BLE001 - anything here is fatal for every stream
            logger.critical("fatal engine error; every open stream ends with an error", exc_info=exc)
            self._mark_failed(exc)
