"""LLMEngine: the engine driven in-process (add_request, step, generate)."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

import torch

from atom_core.config import OFFLINE_MIXED_PREFILL_TOKENS, Config
from atom_core.distributed.dp_attention import Lockstep, check_has_moe, join_dp_attention
from atom_core.distributed.engine_ranks import EngineRanks
from atom_core.distributed.state import destroy_tensor_parallel
from atom_core.distributed.workers import BUILD_RUNNER
from atom_core.engine.block_manager import BlockManager
from atom_core.engine.model_runner import ModelRunner, resolve_block_size
from atom_core.engine.output import RequestText
from atom_core.engine.profiler import ProfileOrder, TraceWrite, rank_profiler
from atom_core.engine.scheduler import ScheduledBatch, Scheduler
from atom_core.engine.sequence import Logprob, RequestTimings, Sequence
from atom_core.engine.spec_decode import Speculator
from atom_core.engine.stats import StatsLogger
from atom_core.engine.step_graphs import MAX_PROMPTS
from atom_core.engine.step_results import PendingStep, StepOutput
from atom_core.engine.validation import check_request
from atom_core.errors import ConfigError, InvalidRequestError
from atom_core.generation_defaults import GenerationDefaults
from atom_core.loader import load_model
from atom_core.loader.hub import resolve_model
from atom_core.sampling_params import SamplingParams
from atom_core.spec_decode.proposer import ProposerContext
from atom_core.structured.compiler import GrammarCompiler
from atom_core.structured.matcher import GrammarMatcher

logger = logging.getLogger(__name__)

DTYPES = {
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
    "float32": torch.float32, "fp32": torch.float32,
}


@dataclass
class RequestOutput:
    """One request's progress, as handed to a stream callback after each step."""

    request_id: str
    text: str  # new text since the last callback ("" when the engine does not detokenize)
    token_ids: list[int]  # new token ids since the last callback
    finished: bool
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[Logprob] = field(default_factory=list)  # one per new token, if asked
    prompt_logprobs: list[Logprob | None] | None = None  # with the first output, if asked
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    ttft_s: float | None = None  # set from the first output on
    latency_s: float | None = None  # set on the finished output
    timings: RequestTimings | None = None  # set on the finished output


@dataclass
class _Request:
    seq: Sequence
    text: RequestText | None
    callback: Callable[[RequestOutput], None] | None
    sent_tokens: int = 0
    pieces: list[str] = field(default_factory=list)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda asked for, but torch sees no CUDA device")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


class LLMEngine:
    """``LLMEngine(model=..., **config_fields)`` or ``LLMEngine(config=Config(...))``.

    With ``detokenize=False`` outputs carry token ids only and stop strings are not
    checked: the caller owns the text (the server's frontend does). Built from keyword
    options, ``mixed_prefill_tokens`` defaults to ``OFFLINE_MIXED_PREFILL_TOKENS`` (no cap:
    an offline batch has no stream waiting on its next token); a ``Config``, as the server
    builds from its flags, keeps its own.
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        config: Config | None = None,
        detokenize: bool = True,
        **kwargs: Any,
    ):
        if config is None:
            kwargs.setdefault("mixed_prefill_tokens", OFFLINE_MIXED_PREFILL_TOKENS)
            config = Config.from_kwargs(model=model, **kwargs)
        elif model is not None or kwargs:
            raise ConfigError("pass either config= or model/keyword options, not both")
        par = config.parallel_config
        if par.data_parallel_size != 1 and par.data_parallel_rank is None:
            raise ConfigError("--data-parallel-size > 1 is served by `atom serve` (one engine "
                              "replica per rank behind its frontend); an LLMEngine is one "
                              "replica: use -dp 1")
        mc = config.model_config
        mc.model = resolve_model(mc.model, mc.revision, mc.download_dir)
        mc.revision = None  # resolved: the directory is that revision's snapshot
        self.config = config
        sc = config.scheduler_config
        torch.manual_seed(mc.seed)
        self.device = resolve_device(mc.device)
        self.dtype = resolve_dtype(mc.dtype, self.device)
        # With -tp N > 1: the other ranks, this process rank 0 (on GPUs, its local rank's).
        self.ranks = (EngineRanks(self, config, self.device)
                      if par.tensor_parallel_size > 1 else None)
        if self.ranks is not None:
            self.device = self.ranks.device
        self.lockstep: Lockstep | None = None  # DP attention's agreement with the replicas
        try:
            if par.enable_dp_attention:
                join_dp_attention(par)
            self._build(config, sc, detokenize)
            if par.enable_dp_attention:
                check_has_moe(self.runner.model)
                self.lockstep = Lockstep(self)
        except BaseException:
            self.shutdown()
            raise

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any (also done when the engine is collected
        or the process exits)."""
        if self.ranks is not None:
            self.ranks.shutdown()
            self.ranks = None
        if self.config.parallel_config.enable_dp_attention:
            destroy_tensor_parallel()

    def _build(self, config: Config, sc: Any, detokenize: bool) -> None:
        loaded = load_model(config, self.device, self.dtype)
        resolve_block_size(config, loaded.model, self.device)
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        # The server's engine process leaves text (and so stop strings) to the frontend.
        self.detokenize = detokenize and loaded.tokenizer is not None
        self.hf_config = loaded.hf_config
        limit = getattr(self.hf_config, "max_position_embeddings", None) or 2048
        if sc.max_model_len is None:
            sc.max_model_len = limit
        elif sc.max_model_len > limit:
            raise ConfigError(
                f"--max-model-len {sc.max_model_len} exceeds the model's {limit} positions"
            )
        self.max_model_len = sc.max_model_len
        self.eos_token_ids = self._eos_ids(loaded.generation_defaults)
        self.grammars = GrammarCompiler(loaded.tokenizer, self.hf_config.vocab_size,
                                        self.eos_token_ids)
        self.speculator: Speculator | None = None
        if config.speculative_config.method is not None:
            ctx = ProposerContext(config, loaded.model, self.hf_config, self.device, self.dtype)
            self.speculator = Speculator(config, self.max_model_len, ctx)
        if self.ranks is not None:  # the ranks plan the cache and capture graphs together
            self.ranks.send(BUILD_RUNNER)
        self.runner = ModelRunner(config, loaded, self.device, self.dtype, self.speculator)
        capacity = self.runner.num_blocks * config.cache_config.block_size
        if capacity < self.max_model_len:
            raise ConfigError(
                f"the KV cache holds {capacity} tokens, fewer than --max-model-len "
                f"{self.max_model_len}: one long request could never finish. Lower "
                "--max-model-len or give the cache more memory"
            )
        self.block_manager = BlockManager(
            self.runner.num_blocks, config.cache_config.block_size,
            config.cache_config.enable_prefix_caching,
        )
        self.scheduler = Scheduler(
            sc, self.block_manager, self.max_model_len,
            lookahead=self.speculator.lookahead if self.speculator is not None else 0,
        )
        self.stats = StatsLogger(config.observability_config, self.scheduler, self.block_manager)
        self.profiler = rank_profiler(config, tp_rank=0)
        self._requests: dict[str, _Request] = {}
        self._next_id = 0
        self.num_preemptions = 0
        self.last_step_tokens = (0, 0)  # (prompt, generated) tokens of the latest step
        self._pending: PendingStep | None = None  # a step queued and not read yet
        if self.speculator is not None and sc.async_scheduling:
            logger.info("speculative decoding: steps run one at a time (a step's drafts "
                        "follow from the tokens before it), not ahead")
        logger.info(
            "engine ready: model=%s (%s, %s) device=%s dtype=%s kv_blocks=%d x %d tokens "
            "max_model_len=%d prefix_caching=%s attention=%s",
            loaded.source, type(loaded.model).__name__, self.hf_config.architectures[0]
            if getattr(self.hf_config, "architectures", None) else "?",
            self.device, str(self.dtype).removeprefix("torch."), self.runner.num_blocks,
            config.cache_config.block_size, self.max_model_len,
            config.cache_config.enable_prefix_caching, self.runner.attention_backend_name,
        )

    def _eos_ids(self, generation_defaults: dict[str, Any]) -> set[int]:
        ids: set[int] = set()
        for value in (generation_defaults.get("eos_token_id"),
                      getattr(self.hf_config, "eos_token_id", None),
                      getattr(self.tokenizer, "eos_token_id", None)):
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, (list, tuple)):
                ids.update(v for v in value if isinstance(v, int))
        return ids

    # --- requests -----------------------------------------------------------------------

    @functools.cached_property
    def generation_defaults(self) -> GenerationDefaults:
        """The model's sampling defaults under ``--generation-config``, resolved as the
        server resolves them; on first use, since the server's engine process never asks."""
        mc = self.config.model_config
        defaults = GenerationDefaults.resolve(mc.generation_config, mc.model)
        logger.info("default sampling: %s", defaults.describe())
        return defaults

    def get_default_sampling_params(self) -> SamplingParams:
        """A new SamplingParams with the model's generation config over SamplingParams'
        own defaults (nothing over them with ``--generation-config none``): what
        ``generate`` and ``add_request`` use when given no SamplingParams."""
        return self.generation_defaults.apply(SamplingParams(), frozenset())

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError(
                    "this model has no tokenizer; pass token ids", param="prompt"
                )
            return list(self.tokenizer.encode(prompt))
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise InvalidRequestError(
                "a token-id prompt must be a list of integers", param="prompt"
            )
        return list(prompt)

    def apply_chat_template(self, messages: list[dict[str, Any]], **template_kwargs: Any) -> str:
        """The prompt text for ``messages`` under the model's chat template."""
        template = self.loaded.chat_template
        if self.tokenizer is None or template is None:
            raise InvalidRequestError("this model has no chat template", param="messages")
        return self.tokenizer.apply_chat_template(
            messages, chat_template=template, tokenize=False, add_generation_prompt=True,
            **template_kwargs,
        )

    def add_request(
        self,
        prompt_or_tokens_list: Seq[str | list[int]] | str,
        sampling_params_list: SamplingParams | Seq[SamplingParams] | None = None,
        stream_callback: Callable[[RequestOutput], None] | None = None,
        request_ids: Seq[str] | None = None,
    ) -> list[str]:
        """Queue prompts (text or token ids); returns their request ids. Each passes
        ``check_request`` before any is queued, so a bad one rejects the call and queues
        nothing. No SamplingParams: ``get_default_sampling_params()``."""
        prompts = (
            [prompt_or_tokens_list] if isinstance(prompt_or_tokens_list, str)
            else list(prompt_or_tokens_list)
        )
        if sampling_params_list is None:
            sampling_params_list = self.get_default_sampling_params()
        params = (
            [sampling_params_list] * len(prompts)
            if isinstance(sampling_params_list, SamplingParams)
            else list(sampling_params_list)
        )
        if len(params) != len(prompts):
            raise InvalidRequestError("one SamplingParams per prompt, or a single one for all")
        if request_ids is not None and len(request_ids) != len(prompts):
            raise InvalidRequestError("one request id per prompt")
        token_lists = [self.tokenize(p) for p in prompts]
        vocab = self.hf_config.vocab_size
        for ids, sp in zip(token_lists, params):
            check_request(ids, sp, self.max_model_len, vocab)
        out = []
        for k, (ids, sp) in enumerate(zip(token_lists, params)):
            rid = request_ids[k] if request_ids is not None else self._new_id()
            self.add_checked_request(ids, sp, rid, stream_callback)
            out.append(rid)
        return out

    def add_checked_request(
        self,
        token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        stream_callback: Callable[[RequestOutput], None] | None = None,
    ) -> None:
        """Queue one request that has passed ``check_request``: the engine process's way
        in, since the server's frontend checks every request before sending it."""
        if request_id in self._requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in flight")
        seq = Sequence(token_ids, params, request_id=request_id)
        if params.structured is not None:
            seq.grammar = self._grammar(params)
        text = RequestText(self.tokenizer, token_ids, params) if self.detokenize else None
        self.scheduler.add(seq)
        self._requests[request_id] = _Request(seq, text, stream_callback)

    def _grammar(self, params: SamplingParams) -> GrammarMatcher:
        """The request's matcher, compiled here (cached per spec) so that a grammar the
        tokenizer cannot serve is refused at admission, never mid-step."""
        spec = params.structured
        assert spec is not None
        if self.speculator is not None:
            raise InvalidRequestError(
                f"{spec.param}: structured outputs are not supported with speculative "
                "decoding (this engine runs --method "
                f"{self.config.speculative_config.method}); serve without it",
                param=spec.param)
        return self.grammars.matcher(spec)

    def _new_id(self) -> str:
        self._next_id += 1
        return f"req-{self._next_id}"

    def abort_request(self, request_id: str) -> bool:
        """Stop a request now; its KV blocks are freed at once."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return False
        self.scheduler.abort(request_id)
        return True

    def warmup(self, mixed_rounds: bool | None = None) -> None:
        """A short prefill and decode, then (``mixed_rounds``) prompts beside 1, 2, 4, ...
        running decodes and beside the most there is room for, so that serving does not stop
        to compile kernels: the attention kernels of a mixed step are specialised on how
        many decodes it holds (the Triton backend's KV split count and tile), and a Triton
        compile takes ~0.5-2 s with every running request waiting. The rounds run by default
        on a GPU only: on a CPU nothing compiles, and up to 128 decodes there took ~17 s of a
        server's start on a 2-core VM.

        Each round's prompts outnumber what a step graph holds (``MAX_PROMPTS``), so its
        mixed step runs eagerly, as a step past the graphs does in serving: a graph sizes its
        decode attention for its capacity, whatever the decodes it replays, so rounds
        replayed from graphs compiled nothing that eager steps ask for."""
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        self.generate([[0] * min(32, self.max_model_len - 4)], params)
        if not (self.device.type != "cpu" if mixed_rounds is None else mixed_rounds):
            return
        sched = self.config.scheduler_config
        # Each round: d one-token prompts start decoding, then 17-token prompts join them.
        # d: the powers of two, then the most decodes that leave room for the prompts. Past
        # one wave of programs a decode grid's tile is fitted to its size (decode_attention's
        # fit_fp8_grid): with rounds up to 256 decodes, the offline fp8 run (up to 511
        # decodes beside prompts) compiled the narrow tile's eager variant mid-run (H100).
        bs = self.block_manager.block_size
        vocab = self.hf_config.vocab_size
        joining = MAX_PROMPTS + 1
        most = max(sched.max_num_seqs - joining, 1)
        rounds = [1 << i for i in range(most.bit_length())]
        if rounds[-1] != most:
            rounds.append(most)
        for d in rounds:
            if (d >= sched.max_num_seqs or self.max_model_len <= 20
                    or d * -(-4 // bs) + joining * -(-19 // bs) > self.block_manager.num_blocks):
                break
            short = self.add_request(
                [[0]] * d, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
            )
            self.step()
            # Their own first tokens each, so that a prefix cache cannot turn one into a
            # decode: (i, d) differ in the first block.
            joined = self.add_request(
                [[i % vocab, d % vocab, d // vocab % vocab] + [j % vocab for j in range(14)]
                 for i in range(joining)],
                SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True),
            )
            while any(r in self._requests for r in short + joined):
                self.step()
        self.block_manager.reset_prefix_cache_stats()

    def start_profile(self) -> None:
        """Start the torch profiler (needs --torch-profiler-dir or ATOM_TORCH_PROFILER_DIR),
        on every tensor-parallel rank."""
        self.profiler.start()
        if self.ranks is not None:
            self.ranks.send(ProfileOrder(start=True))

    def stop_profile_nowait(self) -> TraceWrite | None:
        """End the trace on every rank; rank 0's trace being written (``TorchProfiler.
        stop_nowait``). The other ranks write theirs before they take the next step."""
        if self.ranks is not None:
            self.ranks.send(ProfileOrder(start=False))
        return self.profiler.stop_nowait()

    def stop_profile(self) -> None:
        """Stop the profiler and write each rank's trace (``{torch_profiler_dir}/rank_0/``
        for a lone engine; ``profiler.rank_trace_dir``)."""
        self.stop_profile_nowait()
        self.profiler.stop()

    def is_finished(self) -> bool:
        return not self.scheduler.has_unfinished()

    # --- the loop -----------------------------------------------------------------------

    def step(self) -> list[Sequence]:
        """Run one scheduled batch; returns the sequences that finished in it.

        With ``--async-scheduling`` steps run one ahead: a call schedules and queues step
        k+1 on the device (the input ids of sequences that step k samples are step k's
        sampled ids, never read by the host) and then reads and processes step k's tokens,
        so the host's scheduling, input building and bookkeeping overlap the GPU's work and
        the sequences it returns finished in step k. Sequences certain to stop at step k's
        token sit step k+1 out; a step that needs the host (logprobs, penalties, a grammar's
        mask, which needs step k's token) runs on its own, after step k is read.
        """
        self.last_step_tokens = (0, 0)
        pending, self._pending = self._pending, None
        finished: list[Sequence] = []
        done = self._certain_stops(pending.seqs) if pending is not None else frozenset()
        batch = self.scheduler.schedule(skip=done)
        self.num_preemptions += batch.num_preempted
        if batch.seqs and self._may_launch_ahead(batch):
            queued = self.runner.launch(batch, ids_from=pending)
            if pending is not None:
                finished += self._read(pending)
            self._queue(batch, queued)
            return finished
        if pending is not None:  # its placeholders are resolved before this batch is built
            finished += self._read(pending)
        if not batch.seqs:
            return finished
        out = self._execute(batch)
        finished += self._process(batch.seqs, out)
        # After the tokens are appended: a verified draft is computed and in the token ids
        # before the scheduler hashes the blocks it fills.
        self.scheduler.advance(batch, out.accepted)
        if self.speculator is not None:
            for seq, drafts in zip(batch.seqs, batch.drafts, strict=True):
                if drafts:
                    self.speculator.stats.record(len(drafts), out.accepted.get(seq.seq_id, 0))
            if self.speculator.drafter is not None:
                self.speculator.take(batch.seqs, out.drafts)
            else:
                self.speculator.propose(self.scheduler.running)
        return finished

    def _execute(self, batch: ScheduledBatch) -> StepOutput:
        if self.ranks is None:
            return self.runner.execute(batch)
        return self.ranks.run_step(batch, lambda: self.runner.execute(batch))

    def print_mtp_statistics(self) -> None:
        """Print speculative decoding's acceptance statistics (the guide's MTP statistics)."""
        if self.speculator is None:
            print("speculative decoding is off (no --method)")
        else:
            print(self.speculator.stats.report())

    def _read(self, pending: PendingStep) -> list[Sequence]:
        return self._process(pending.seqs, self.runner.collect(pending), resolve=True)

    def _queue(self, batch: ScheduledBatch, launched: PendingStep) -> None:
        """``launched`` computes ``batch`` and is read next step: the tokens it samples are
        placeholders until then."""
        for seq in launched.seqs:
            if not seq.is_finished:
                seq.append_placeholder()
        self.scheduler.advance(batch)
        self._pending = launched

    def _may_launch_ahead(self, batch: ScheduledBatch) -> bool:
        """Whether ``batch`` may be queued and its tokens read one step late: nothing in it
        reads the device on the host (prompt logprobs, logprobs, penalties over the token
        history) or needs the host's copy of the tokens (a grammar's mask)."""
        return (
            self.config.scheduler_config.async_scheduling
            and self.speculator is None
            and self.ranks is None
            and self.runner.decode_inputs is not None
            and all(
                self._host_free_sampling(s.sampling_params)
                and (s.sampling_params.prompt_logprobs is None
                     or len(s.prompt_logprobs) >= s.num_prompt_tokens)
                for s in batch.seqs
            )
        )

    def _certain_stops(self, seqs: list[Sequence]) -> frozenset[int]:
        """The sequences of the queued step (``seqs``, each ending in a placeholder) certain
        to stop at their placeholder (``max_tokens``, ``--max-model-len``): the next step
        leaves them out rather than run past the stop. (A stop token or string is not
        certain: such a sequence's extra token is computed and dropped.)"""
        return frozenset(
            s.seq_id for s in seqs
            if not s.is_finished
            and (s.num_output_tokens >= s.sampling_params.max_tokens
                 or s.num_tokens >= self.max_model_len)
        )

    @staticmethod
    def _host_free_sampling(sp: SamplingParams) -> bool:
        """Sampling that needs no host-side token history or per-step host reads."""
        return (
            sp.structured is None
            and sp.logprobs is None
            and sp.repetition_penalty == 1.0
            and sp.presence_penalty == 0.0
            and sp.frequency_penalty == 0.0
        )

    def _process(
        self, seqs: list[Sequence], out: StepOutput, resolve: bool = False
    ) -> list[Sequence]:
        """Append (or, for a step read late, resolve) each sequence's sampled token; stop
        checks, stats and callbacks. Returns the sequences that finished."""
        finished: list[Sequence] = []
        num_prompt = num_gen = 0
        for seq in seqs:
            if seq.is_finished:  # aborted while the step ran, or stopped a step earlier
                continue
            req = self._requests.get(seq.request_id)
            if seq.seq_id in out.prompt_logprobs:
                seq.prompt_logprobs.extend(out.prompt_logprobs[seq.seq_id])
            tokens = out.emitted.get(seq.seq_id)
            if tokens is None:
                token = out.sampled.get(seq.seq_id)
                if token is None:
                    continue
                tokens = [token]
            text = ""
            reason = None
            # Speculation emits several tokens a step; a stop among them ends the run there.
            for token in tokens:
                num_gen += 1
                if resolve:
                    seq.resolve_placeholder(token)
                else:
                    seq.append_token(token)
                if seq.num_output_tokens == 1:
                    # As vLLM counts them: a request's prompt, once, when its first token
                    # arrives (cached prefix included, recomputation after preemption not).
                    num_prompt += seq.num_prompt_tokens
                if seq.seq_id in out.logprobs:
                    seq.logprobs.append(out.logprobs[seq.seq_id])
                reason = self._finish_reason(seq, token)
                if req is not None and req.text is not None:
                    piece, reason, seq.stop_reason = req.text.update([token], reason,
                                                                     seq.stop_reason)
                    text += piece
                if reason is not None:
                    break
            if reason is not None:
                seq.finish_time = time.monotonic()
                self.scheduler.finish(seq, reason)
                finished.append(seq)
            if req is not None:
                self._notify(req, text, reason is not None)
        for seq in finished:
            self._requests.pop(seq.request_id, None)
        prompt, gen = self.last_step_tokens
        self.last_step_tokens = (prompt + num_prompt, gen + num_gen)
        self.stats.record(num_prompt, num_gen)
        return finished

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        """Whether ``token`` ends ``seq`` by its id, its grammar or its count (a stop
        string is the request's RequestText's to find). A grammar that takes the token as
        its EOS ends it even under ignore_eos: nothing could follow."""
        sp = seq.sampling_params
        matched = seq.grammar is not None and seq.grammar.accept(token)
        if not sp.ignore_eos and token in self.eos_token_ids:
            return "stop"
        if token in sp.stop_token_ids:
            seq.stop_reason = token
            return "stop"
        if matched:
            return "stop"
        if seq.num_output_tokens >= sp.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _notify(self, req: _Request, text: str, finished: bool) -> None:
        req.pieces.append(text)
        if req.callback is None:
            return
        seq = req.seq
        first = req.sent_tokens == 0
        new_ids = seq.output_token_ids[req.sent_tokens :]
        sp = seq.sampling_params
        new_logprobs = seq.logprobs[req.sent_tokens :] if sp.logprobs is not None else []
        req.sent_tokens = seq.num_output_tokens
        prompt_lps = seq.prompt_logprobs if first and sp.prompt_logprobs is not None else None
        ttft = seq.first_token_time - seq.arrival_time if seq.first_token_time is not None else None
        latency = (seq.finish_time or time.monotonic()) - seq.arrival_time if finished else None
        req.callback(
            RequestOutput(
                seq.request_id, text, new_ids, finished, seq.finish_reason, seq.stop_reason,
                new_logprobs, prompt_lps, seq.num_prompt_tokens, seq.num_output_tokens, ttft,
                latency, seq.timings() if finished else None,
            )
        )

    def generate(
        self,
        prompts: Seq[str | list[int]] | str,
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
    ) -> list[dict[str, Any]]:
        """Run prompts to completion; one output dict per prompt, in order. No
        SamplingParams: ``get_default_sampling_params()``."""
        rids = self.add_request(prompts, sampling_params)
        reqs = [self._requests[r] for r in rids]
        while not all(r.seq.is_finished for r in reqs):
            self.step()
        return [self._output(r) for r in reqs]

    @staticmethod
    def _output(req: _Request) -> dict[str, Any]:
        seq = req.seq
        end = seq.finish_time or time.monotonic()
        first = seq.first_token_time or end
        n_out = seq.num_output_tokens
        return {
            "text": "".join(req.pieces),
            "token_ids": seq.output_token_ids,
            "latency": end - seq.arrival_time,
            "finish_reason": seq.finish_reason,
            "stop_reason": seq.stop_reason,
            "num_tokens_input": seq.num_prompt_tokens,
            "num_tokens_output": n_out,
            "ttft": first - seq.arrival_time,
            "tpot": (end - first) / (n_out - 1) if n_out > 1 else 0.0,
            "logprobs": seq.logprobs if seq.sampling_params.logprobs is not None else None,
            "prompt_logprobs": (
                seq.prompt_logprobs if seq.sampling_params.prompt_logprobs is not None else None
            ),
        }
