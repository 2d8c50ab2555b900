"""ModelRunner: owns the model and its KV cache; turns a ScheduledBatch into sampled tokens."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch

from atom_core.config import DEFAULT_BLOCK_SIZE, Config
from atom_core.distributed.collectives import min_over_ranks
from atom_core.engine.annotations import annotate
from atom_core.engine.capture_traces import CaptureTracer
from atom_core.engine.cuda_graphs import CudaGraphRunner
from atom_core.engine.input_batch import DecodeInputs
from atom_core.engine.kv_calibration import calculate_kv_scales, calibration_ids
from atom_core.engine.profiler import profiler_dir
from atom_core.engine.scheduler import ScheduledBatch
from atom_core.engine.sequence import PLACEHOLDER_TOKEN, Logprob, Sequence
from atom_core.engine.spec_decode import Speculator
from atom_core.engine.spec_steps import SpeculativeSteps
from atom_core.engine.step_graphs import StepGraphs
from atom_core.engine.step_inputs import eager_inputs
from atom_core.engine.step_results import PendingStep, StepOutput
from atom_core.errors import ConfigError
from atom_core.layers.context import forward_context
from atom_core.layers.sampler import Sampler, SamplerOutput, SamplingBatch, prompt_logprobs
from atom_core.layers.transfer import host_to_device
from atom_core.loader import LoadedModel
from atom_core.ops.native.kv_cache import FP8_KV_DTYPE
from atom_core.quant.online import require_fp8_device
from atom_core.structured.matcher import fill_bitmask

logger = logging.getLogger(__name__)

GIB = 1 << 30


def resolve_block_size(config: Config, model: torch.nn.Module, device: torch.device) -> int:
    """``--block-size``, else the largest page size the model's attention backends prefer on
    ``device``, else ``DEFAULT_BLOCK_SIZE``. Written into the config, which the drafter, the
    runner and the block manager read after the model is loaded; every tensor-parallel rank
    builds the same layers and so decides the same."""
    cache = config.cache_config
    if cache.block_size is None:
        wanted = [layer.backend.preferred_block_size(device) for layer in model.attention_layers()]
        cache.block_size = max([w for w in wanted if w] or [DEFAULT_BLOCK_SIZE])
    return cache.block_size


class ModelRunner(SpeculativeSteps):
    def __init__(
        self, config: Config, loaded: LoadedModel, device: torch.device, dtype: torch.dtype,
        speculator: Speculator | None = None,
    ):
        self.config = config
        self.model = loaded.model
        self.hf_config = loaded.hf_config
        self.device = device
        self.dtype = dtype
        self.block_size = config.cache_config.block_size
        self.sampler = Sampler()
        self.attention_layers = list(self.model.attention_layers())
        backend_names = {a.backend_name for a in self.attention_layers}
        self.attention_backend_name = ",".join(sorted(backend_names))
        # A draft network runs beside the target (engine/drafter.py): its attention layers
        # get caches of the same blocks, and it reads every step's rows.
        self.speculator = speculator
        self.drafter = speculator.drafter if speculator is not None else None
        self.kv_layers = self.attention_layers + (
            self.drafter.attention_layers() if self.drafter is not None else [])
        self.kv_dtype = self._kv_dtype()
        if config.cache_config.calculate_kv_scales:
            self._calculate_kv_scales(loaded.tokenizer)
        self.num_blocks = self._plan_kv_blocks()
        self._allocate_kv_cache(self.num_blocks)
        if self.drafter is not None and speculator is not None:
            # Its decode and draft steps run as decode rows (the GPU graphs them); a draft
            # model also reads each sequence's newest token: one row more.
            sched = config.scheduler_config
            per_seq = 1 + speculator.k + (0 if self.drafter.network.reads_target_hidden else 1)
            self.drafter.use_rows(sched.max_num_seqs * per_seq, sched.max_model_len or 1,
                                  per_seq)
        # The GPU decode path: persistent inputs, CUDA graphs, one D2H copy per step. The
        # CPU keeps the general path (``fast_decode`` can be switched on for tests).
        self.fast_decode = device.type == "cuda"
        self.decode_inputs: DecodeInputs | None = None
        self.graphs: CudaGraphRunner | None = None
        self.steps: StepGraphs | None = None
        self._sampling_cache: tuple[tuple[int, ...], SamplingBatch] | None = None
        self._verify_cache: tuple[tuple[tuple[int, int], ...], SamplingBatch] | None = None
        if self.fast_decode:
            self._setup_fast_decode()

    # --- the GPU decode path --------------------------------------------------------------

    def _setup_fast_decode(self) -> None:
        sched = self.config.scheduler_config
        max_len = sched.max_model_len or 1
        # With speculation a verify step's drafts are decode rows too: k + 1 per sequence.
        new_rows = 1 + self.speculator.k if self.speculator is not None else 1
        rows = sched.max_num_seqs * new_rows
        self.decode_inputs = DecodeInputs(
            rows, -(-max_len // self.block_size), self.block_size, self.device
        )
        pin = self.device.type == "cuda"
        # Two of each: with --async-scheduling step k+1 is queued before step k's ids are read.
        self._sampled_host = [torch.empty(sched.max_num_seqs, dtype=torch.long, pin_memory=pin)
                              for _ in range(2)]
        self._sampled_ready = [torch.cuda.Event() if pin else None for _ in range(2)]
        self._launches = 0
        comp = self.config.compilation_config
        obs = self.config.observability_config
        if obs.mark_trace and (self.device.type != "cuda" or comp.enforce_eager):
            logger.info("--mark-trace: no CUDA graphs are captured here (%s%s), "
                        "so no capture traces",
                        self.device.type, ", --enforce-eager" if comp.enforce_eager else "")
        graph_safe = all(getattr(a.backend, "cuda_graph_safe", False)
                         for a in self.attention_layers)
        if self.device.type != "cuda" or comp.enforce_eager or not comp.cudagraph_capture_sizes:
            return
        if not graph_safe:
            logger.info(
                "attention backend %s is not CUDA-graph safe: decode runs eagerly",
                self.attention_backend_name,
            )
            return
        tracer = CaptureTracer(profiler_dir(obs.torch_profiler_dir) if obs.mark_trace else None)
        self.graphs = CudaGraphRunner(
            self._graph_forward, self.decode_inputs, comp.cudagraph_capture_sizes, max_len,
            tracer, new_rows,
        )
        self.graphs.capture()
        if self.drafter is not None and self.graphs.sizes:
            template = self.graphs.outputs[self.graphs.sizes[-1]][1]
            self.drafter.capture_graphs(comp.cudagraph_capture_sizes, template, self.graphs.pool)
            logger.info("a draft network reads every step's rows: steps with prompt tokens "
                        "run eagerly")
        elif all(getattr(a.backend, "step_graph_safe", False) for a in self.attention_layers):
            self._setup_step_graphs(use_graphs=True)
        else:
            logger.info("attention backend %s has no graph-safe mixed steps: steps with "
                        "prompt tokens run eagerly", self.attention_backend_name)

    def _setup_step_graphs(self, use_graphs: bool) -> None:
        """Static inputs for steps with prompt tokens and (``use_graphs``) their graphs;
        without graphs, the CPU runs the same padded inputs eagerly (tests)."""
        sched = self.config.scheduler_config
        comp = self.config.compilation_config
        max_len = sched.max_model_len or 1
        # Up to the first size that holds a whole step: larger ones are never replayed.
        budget = sched.max_num_batched_tokens
        sizes = sorted(comp.prefill_cudagraph_sizes)
        sizes = [s for i, s in enumerate(sizes) if i == 0 or sizes[i - 1] < budget]
        if not sizes:
            return
        # A captured step holds as many sequences as the largest decode graph.
        max_seqs = min(sched.max_num_seqs, max(comp.cudagraph_capture_sizes, default=1))
        self.steps = StepGraphs(
            self.model, sizes, max_seqs, -(-max_len // self.block_size), self.block_size,
            max_len, self.device,
        )
        if use_graphs:
            self.steps.capture(self.graphs.pool if self.graphs is not None else None)

    # --- KV cache -----------------------------------------------------------------------

    def _kv_dtype(self) -> torch.dtype:
        """The cache's dtype: the model's, or e4m3 for ``--kv_cache_dtype fp8`` where every
        attention backend stores it."""
        if self.config.cache_config.kv_cache_dtype != "fp8":
            return self.dtype
        lacking = sorted({a.backend_name for a in self.kv_layers
                          if not getattr(a.backend, "fp8_kv_cache", False)})
        if lacking:
            raise ConfigError(f"--kv_cache_dtype fp8: the {', '.join(lacking)} attention "
                              "backend has no fp8 KV cache yet; use --kv_cache_dtype bf16")
        require_fp8_device(self.device, "--kv_cache_dtype fp8")
        return FP8_KV_DTYPE

    def _calculate_kv_scales(self, tokenizer: Any) -> None:
        """``--calculate-kv-scales``: the target model's layers, and a draft network's,
        measure theirs (kv_calibration.py) before any cache is planned or graph captured."""
        if tokenizer is None:
            raise ConfigError("--calculate-kv-scales reads a calibration text: the model "
                              "has no tokenizer; give the scales with --kv-cache-scales")
        sched = self.config.scheduler_config
        # The whole text, in chunks of the token budget: measured on a small budget's first
        # chunk alone, the scales clipped K on other text.
        ids = calibration_ids(tokenizer, sched.max_model_len or sched.max_num_batched_tokens)
        draft = self.drafter.network if self.drafter is not None else None
        logger.info("%s", calculate_kv_scales(self.model, self.attention_layers, ids,
                                              self.block_size, self.dtype, self.device, draft,
                                              chunk=sched.max_num_batched_tokens))

    def _kv_shape(self, layer, num_blocks: int) -> tuple[int, ...]:
        return layer.kv_cache_shape(num_blocks, self.block_size)

    def _bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.kv_dtype).element_size()
        total = 0
        for layer in self.kv_layers:
            n = 1
            for d in self._kv_shape(layer, 1):
                n *= d
            total += n * elem
        return total

    def _plan_kv_blocks(self) -> int:
        cache = self.config.cache_config
        if cache.num_gpu_blocks_override is not None:
            return cache.num_gpu_blocks_override
        per_block = self._bytes_per_block()
        sched = self.config.scheduler_config
        # Never more than every sequence at full length could use.
        ceiling = sched.max_num_seqs * -(-sched.max_model_len // self.block_size)
        if self.device.type == "cpu":
            budget = int(cache.cpu_kv_cache_space_gib * GIB)
        else:
            free, total = torch.cuda.mem_get_info(self.device)
            used_by_others = total - free
            budget = (int(total * cache.gpu_memory_utilization) - used_by_others
                      - self._activation_reserve())
        # Every tensor-parallel rank's cache holds the same blocks: the least any GPU fits.
        blocks = min_over_ranks(min(ceiling, budget // per_block))
        if blocks < 1:
            raise RuntimeError(
                f"no memory left for the KV cache ({per_block} bytes per block); "
                "raise --gpu-memory-utilization or --cpu-kv-cache-space, or lower --max-model-len"
            )
        return blocks

    def _activation_reserve(self) -> int:
        """Peak activation memory of the largest step, measured by a profiling forward."""
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        n = min(self.config.scheduler_config.max_num_batched_tokens,
                self.config.scheduler_config.max_model_len)
        self._allocate_kv_cache(1)
        ids = torch.zeros(n, dtype=torch.long, device=self.device)
        table = [0] * -(-n // self.block_size)
        meta = eager_inputs(None, [0], [n], [table], self.block_size, self.device).meta
        meta.slot_mapping.fill_(-1)
        with torch.inference_mode(), forward_context(meta):
            hidden = self.model(ids, torch.arange(n, device=self.device))
            self.model.compute_logits(hidden[-min(n, self.config.scheduler_config.max_num_seqs):])
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - before
        torch.cuda.empty_cache()
        return peak

    def _allocate_kv_cache(self, num_blocks: int) -> None:
        for layer in self.kv_layers:
            layer.kv_cache = torch.empty(self._kv_shape(layer, num_blocks),
                                         dtype=self.kv_dtype, device=self.device)

    # --- the step -----------------------------------------------------------------------

    def execute(self, batch: ScheduledBatch) -> StepOutput:
        """Run one step and read its tokens."""
        return self.collect(self.launch(batch))

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch, ids_from: PendingStep | None = None) -> PendingStep:
        """Queue one step: its inputs, the forward, the sampler and an asynchronous copy of
        the sampled ids; nothing waits for the device unless the batch owes prompt logprobs
        (read on the host). ``ids_from``: the step queued before this one, not read yet; the
        sequences it samples end in a placeholder on the host, and their input ids here are
        its sampled ids, copied on the device. docs/host_timeline.md walks through it."""
        with annotate(batch):
            if self.is_row_verify(batch):
                return self._launch_rows(batch)
            if self.drafter is not None:
                return self._launch_eager(batch, ids_from)
            if self.decode_inputs is not None and self.is_plain_decode(batch):
                return self._launch_decode(batch.seqs, ids_from)
            if self.steps is not None and self.is_graphed_step(batch):
                return self._launch_graphed(batch, ids_from)
            return self._launch_eager(batch, ids_from)

    def _launch_eager(self, batch: ScheduledBatch, ids_from: PendingStep | None) -> PendingStep:
        seqs, counts = batch.seqs, batch.num_scheduled_tokens
        starts = [s.num_computed_tokens for s in seqs]
        sampling = [i for i, last in enumerate(batch.sample_mask) if last]
        inputs = eager_inputs(
            [s.token_ids for s in seqs], starts, counts, [s.block_table for s in seqs],
            self.block_size, self.device, sampling, _fill_map(seqs, sampling, ids_from),
            batch.drafts if batch.has_drafts else None,
        )
        if batch.has_drafts:
            return self._verify(batch, inputs, starts, sampling)
        if inputs.fill_rows.numel():
            fill_ids = ids_from.sampled.index_select(0, inputs.fill_from)
            inputs.input_ids.index_copy_(0, inputs.fill_rows, fill_ids)
        chosen = [seqs[i] for i in sampling]
        # Built before the forward is queued: its small copies then go ahead of it.
        sbatch = self._sampling_batch(chosen) if chosen else None
        with forward_context(inputs.meta):
            hidden = self.model(inputs.input_ids, inputs.positions)
        prompt_lps: dict[int, list[Logprob | None]] = {}
        self._prompt_logprobs(seqs, starts, counts, inputs.meta.query_start_loc_cpu, hidden,
                              prompt_lps)
        new: dict[int, list[int]] = {}
        if sbatch is None:
            nothing = torch.empty(0, dtype=torch.long, device=self.device)
            pending = PendingStep([], nothing, torch.empty(0, dtype=torch.long), None, [],
                                  prompt_lps)
        else:
            logits = self.model.compute_logits(hidden.index_select(0, inputs.sample_rows))
            result = self.sampler(logits, self._constrain(chosen, sbatch))
            pending = self._send_back(chosen, result)
            pending.prompt_logprobs = prompt_lps
            if self.drafter is not None:  # its inputs include the sampled tokens
                new = {i: [t] for i, t in zip(sampling, result.token_ids.tolist(), strict=True)}
        if self.drafter is not None:
            pending.drafts = self._draft(batch, starts, inputs.meta.query_start_loc_cpu,
                                         self._draft_hidden(hidden), new)
        return pending

    def _graph_forward(self, n: int, meta: object) -> tuple[torch.Tensor, torch.Tensor | None]:
        """What a decode graph computes over its n rows: every row's logits and, for a
        draft network that reads them, its hidden input."""
        inputs = self.decode_inputs
        assert inputs is not None
        hidden = self.model(inputs.input_ids(n), inputs.positions(n))
        return self.model.compute_logits(hidden), self._draft_hidden(hidden)

    @staticmethod
    def is_plain_decode(batch: ScheduledBatch) -> bool:
        """Every sequence computes its one newest token and samples; none owes prompt logprobs."""
        for s, n in zip(batch.seqs, batch.num_scheduled_tokens):
            if n != 1 or s.num_computed_tokens + 1 != s.num_tokens:
                return False
            if (s.sampling_params.prompt_logprobs is not None
                    and len(s.prompt_logprobs) < s.num_prompt_tokens):
                return False
        return True

    def is_graphed_step(self, batch: ScheduledBatch) -> bool:
        """A step graph holds the batch (engine/step_graphs.py) and no sequence owes prompt
        logprobs (they read every prompt row's hidden state, eagerly)."""
        assert self.steps is not None
        if batch.has_drafts:  # a graph samples only each sequence's last row
            return False
        for s in batch.seqs:
            sp = s.sampling_params
            if sp.prompt_logprobs is not None and len(s.prompt_logprobs) < s.num_prompt_tokens:
                return False
        return self.steps.fits(batch.seqs, batch.num_scheduled_tokens)

    def _launch_graphed(self, batch: ScheduledBatch, ids_from: PendingStep | None) -> PendingStep:
        seqs = batch.seqs
        sampling = [i for i, last in enumerate(batch.sample_mask) if last]
        fill = _fill_map(seqs, sampling, ids_from)
        chosen = [seqs[i] for i in sampling]
        # Built before the forward is queued, so its small copies go ahead of it.
        sbatch = self._sampling_batch(chosen) if chosen else None
        assert self.steps is not None
        hidden = self.steps.run(seqs, batch.num_scheduled_tokens, sampling, fill,
                                ids_from.sampled if ids_from is not None else None)
        if sbatch is None:  # chunks short of their prompts' ends: nothing to sample
            nothing = torch.empty(0, dtype=torch.long, device=self.device)
            return PendingStep([], nothing, torch.empty(0, dtype=torch.long), None, [])
        logits = self.model.compute_logits(hidden)
        return self._send_back(chosen, self.sampler(logits, self._constrain(chosen, sbatch)))

    def _launch_decode(self, seqs: list[Sequence], ids_from: PendingStep | None) -> PendingStep:
        """The GPU decode path: inputs into the static buffers, then a graph replay (or the
        same forward eagerly)."""
        inputs = self.decode_inputs
        assert inputs is not None
        n = len(seqs)
        padded = self.graphs.padded_size(n) if self.graphs is not None else None
        lens = inputs.prepare(seqs, padded or n)
        if ids_from is not None and ids_from.seqs == seqs:  # a steady batch: all of them, in order
            inputs.input_ids(n).copy_(ids_from.sampled)
        else:
            fill = _fill_map(seqs, range(n), ids_from)  # row i is sequence i's token
            if fill[0]:
                rows, src = host_to_device(list(fill), torch.long, self.device)
                inputs.input_ids(n).index_copy_(0, rows, ids_from.sampled.index_select(0, src))
        # Built before the forward is queued, so its small copies go ahead of it; reused
        # while the batch is unchanged.
        sbatch = self._decode_sampling_batch(seqs)
        if padded is not None:
            logits = self.graphs.replay(padded)[0][:n]
        else:
            meta = inputs.metadata(n, lens, self.config.scheduler_config.max_model_len or 1)
            with forward_context(meta):
                hidden = self.model(inputs.input_ids(n), inputs.positions(n))
                logits = self.model.compute_logits(hidden)
        return self._send_back(seqs, self.sampler(logits, self._constrain(seqs, sbatch)))

    def _send_back(self, seqs: list[Sequence], result: SamplerOutput) -> PendingStep:
        """Start the copy of the sampled ids to the host; record when it is done."""
        if self.decode_inputs is None:  # the CPU engine: the ids are already on the host
            return PendingStep(list(seqs), result.token_ids, result.token_ids, None,
                               result.logprobs)
        slot = self._launches % 2
        self._launches += 1
        host = self._sampled_host[slot][: len(seqs)]
        host.copy_(result.token_ids, non_blocking=host.is_pinned())
        ready = self._sampled_ready[slot]
        if ready is not None:
            ready.record()
        return PendingStep(list(seqs), result.token_ids, host, ready, result.logprobs)

    def collect(self, pending: PendingStep) -> StepOutput:
        """Wait for a launched step's sampled ids (the step's one host wait) and return them."""
        if pending.ready is not None:
            pending.ready.synchronize()
        tokens = pending.host.tolist()
        out = StepOutput({}, {}, pending.prompt_logprobs, pending.emitted, pending.accepted,
                         pending.drafts)
        for j, s in enumerate(pending.seqs):
            out.sampled[s.seq_id] = tokens[j]
            if pending.logprobs[j] is not None:
                out.logprobs[s.seq_id] = pending.logprobs[j]
        return out

    def _decode_sampling_batch(self, seqs: list[Sequence]) -> SamplingBatch:
        key = tuple(s.seq_id for s in seqs)
        cached = self._sampling_cache
        if cached is not None and cached[0] == key:
            return cached[1]
        sbatch = self._sampling_batch(seqs)
        # Penalties read the growing output ids: such a batch is rebuilt every step.
        self._sampling_cache = None if sbatch.any_penalty else (key, sbatch)
        return sbatch

    def _constrain(self, seqs: list[Sequence], sbatch: SamplingBatch) -> SamplingBatch:
        """``sbatch`` with this step's grammar bitmask for its constrained rows (structured
        outputs), filled on the host after the forward is queued, so that on a GPU the
        fill overlaps it. A batch without constraints passes through untouched. Such a
        step never runs ahead of the host (LLMEngine._may_launch_ahead): each matcher has
        taken the previous step's token."""
        if not sbatch.constrained:
            return sbatch
        matchers = [seqs[i].grammar for i in sbatch.constrained]
        if matchers[0] is None:  # a tensor-parallel worker's copy: its tokens are not used
            return sbatch
        pin = self.device.type == "cuda"
        bitmask = fill_bitmask(matchers, self.hf_config.vocab_size, pin)
        return sbatch.with_bitmask(bitmask.to(self.device, non_blocking=pin))

    def _sampling_batch(self, seqs: list[Sequence]) -> SamplingBatch:
        return SamplingBatch.build(
            [s.sampling_params for s in seqs],
            [s.prompt_token_ids for s in seqs],
            [s.output_token_ids for s in seqs],
            [self._generator(s) for s in seqs],
            self.device,
        )

    def _prompt_logprobs(
        self, seqs, starts, counts, ends, hidden, out: dict[int, list[Logprob | None]]
    ) -> None:
        """Logprobs of prompt tokens computed this step (position p predicts token p + 1).

        Entry j of ``seq.prompt_logprobs`` is prompt token j's (entry 0 is None); a
        sequence recomputed after preemption skips entries it already has.
        """
        for i, (s, start, n) in enumerate(zip(seqs, starts, counts)):
            k = s.sampling_params.prompt_logprobs
            have = len(s.prompt_logprobs)
            if k is None or have >= s.num_prompt_tokens:
                continue
            first = max(start, have - 1)
            stop = min(start + n, s.num_prompt_tokens - 1)
            entries: list[Logprob | None] = [None] if have == 0 else []
            if stop > first:
                h = hidden[ends[i] + first - start : ends[i] + stop - start]
                logits = self.model.compute_logits(h).float()
                targets = torch.tensor(s.token_ids[first + 1 : stop + 1], device=self.device)
                entries.extend(prompt_logprobs(logits, targets, k))
            out[s.seq_id] = entries

    def _generator(self, seq: Sequence) -> torch.Generator | None:
        seed = seq.sampling_params.seed
        if seed is None:
            return None
        gen = getattr(seq, "generator", None)
        if gen is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(seed)
            seq.generator = gen
        return gen


def _fill_map(
    seqs: list[Sequence], computing_newest: Iterable[int], ids_from: PendingStep | None
) -> tuple[list[int], list[int]]:
    """(i, j) pairs as two lists: sequence ``seqs[i]`` ends in a placeholder, and ``ids_from``
    sampled its token at index j. ``computing_newest``: the sequences whose newest token the
    step computes (a placeholder is always the newest; one elsewhere is a bug)."""
    index = {s.seq_id: j for j, s in enumerate(ids_from.seqs)} if ids_from is not None else {}
    computing = set(computing_newest)
    seq_rows: list[int] = []
    src: list[int] = []
    for i, s in enumerate(seqs):
        if s.token_ids[-1] != PLACEHOLDER_TOKEN:
            continue
        if s.seq_id not in index or i not in computing:
            raise RuntimeError(
                f"sequence {s.request_id} ends in a placeholder no queued step samples")
        seq_rows.append(i)
        src.append(index[s.seq_id])
    return seq_rows, src
