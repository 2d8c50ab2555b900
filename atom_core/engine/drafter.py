"""Runs a ``DraftNetwork`` (spec_decode/proposer.py) beside the target, step by step.

After each target step the network runs over the rows the target kept, writing its own KV
at the same positions through the same block tables (its cache layers are allocated with
the target's, block for block), so its cache covers every token the target's does, and
prefix-cache hits and preemption need nothing of their own. Each sequence that wants
drafts then takes the argmax of its last row, and up to k - 1 more single-token steps
extend the run. The scheduler allocates k tokens of lookahead for these writes. Steps of
at most k + 1 rows per sequence (every decode and verify step's) run as decode rows, on
the GPU from the network's own CUDA graphs (engine/cuda_graphs.py); prompt chunks run
eagerly.

A network that reads the target's hidden states sees at position p the token at p + 1
(the target kept the row, so that token is known: the next prompt token or the one just
sampled); a plain draft model sees the token at p, plus one more row for the newly
sampled token. Drafts are argmaxes: the verifier treats them as a deterministic proposal
(q one-hot), which keeps sampled requests exact.

A position's draft KV depends on the token after it for hidden-state networks, so a cached
block reused by a sequence that continues differently holds one stale draft row: that can
lower acceptance, never change output.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from atom_core.engine.cuda_graphs import CudaGraphRunner
from atom_core.engine.input_batch import DecodeInputs
from atom_core.engine.sequence import Sequence
from atom_core.engine.step_inputs import eager_inputs
from atom_core.layers.attention.layer import Attention
from atom_core.layers.context import forward_context
from atom_core.layers.transfer import host_to_device
from atom_core.spec_decode.proposer import DraftNetwork


@dataclass
class DraftRows:
    """One sequence's part of a target step, as the drafter needs it."""

    seq: Sequence
    start: int  # first position the target computed
    kept: int  # rows the target kept (rejected drafts excluded)
    tokens: list[int]  # tokens at positions start .. start + kept (kept + 1 of them)
    hidden_row: int  # the target output row of position ``start``
    wanted: int  # drafts to propose (0: only keep the draft cache in step)


class Drafter:
    def __init__(self, network: DraftNetwork, block_size: int, device: torch.device) -> None:
        self.network = network
        self.block_size = block_size
        self.device = device
        # The decode-row path (the GPU's): static rows, their graphs, the hidden input.
        self.rows: DecodeInputs | None = None
        self.graphs: CudaGraphRunner | None = None
        self.max_rows_per_seq = 1
        self.max_model_len = 1
        self._hidden_in: torch.Tensor | None = None

    def attention_layers(self) -> list[Attention]:
        return list(self.network.attention_layers())

    def use_rows(self, max_rows: int, max_model_len: int, rows_per_seq: int) -> None:
        """Run steps of at most ``rows_per_seq`` rows per sequence as decode rows in static
        buffers (engine/cuda_graphs.py), as the target's verify steps run."""
        self.rows = DecodeInputs(max_rows, -(-max_model_len // self.block_size),
                                 self.block_size, self.device)
        self.max_rows_per_seq = rows_per_seq
        self.max_model_len = max_model_len

    def capture_graphs(self, sizes: list[int], hidden_template: torch.Tensor | None,
                       pool: object | None) -> None:
        """After ``use_rows``: a graph of the network's forward per row count in ``sizes``;
        ``hidden_template``: a tensor shaped like the network's hidden input rows."""
        assert self.rows is not None
        if hidden_template is not None:
            self._hidden_in = hidden_template.new_zeros(
                (self.rows.max_seqs, hidden_template.shape[-1]))
        self.graphs = CudaGraphRunner(self._rows_forward, self.rows, sizes, self.max_model_len,
                                      new_rows_per_seq=self.max_rows_per_seq, name="draft")
        self.graphs.capture(pool)

    def _rows_forward(self, n: int, meta: object) -> tuple[torch.Tensor, torch.Tensor | None]:
        assert self.rows is not None
        hidden = self._hidden_in[:n] if self._hidden_in is not None else None
        return self.network.forward(self.rows.input_ids(n), self.rows.positions(n), hidden)

    def _run(self, starts: list[int], counts: list[int], tables: list[list[int]],
             ids: list[int] | torch.Tensor, hidden: torch.Tensor | None,
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The network over ``counts[i]`` rows of sequence i from position ``starts[i]``,
        over block table ``tables[i]``; ``ids`` (host or device) and ``hidden`` hold the
        rows in that order, and so do the outputs (rows for the logits, carry)."""
        n = sum(counts)
        rows = self.rows
        if rows is None or max(counts) > self.max_rows_per_seq or n > rows.max_seqs:
            inputs = eager_inputs(None, starts, counts, tables, self.block_size, self.device)
            if isinstance(ids, list):
                ids = host_to_device(ids, torch.long, self.device)
            with forward_context(inputs.meta):
                return self.network.forward(ids, inputs.positions, hidden)
        positions = [a + j for a, c in zip(starts, counts) for j in range(c)]
        row_tables = [t for t, c in zip(tables, counts) for _ in range(c)]
        padded = self.graphs.padded_size(n) if self.graphs is not None else None
        lens = rows.prepare_rows(ids if isinstance(ids, list) else None, positions, row_tables,
                                 padded or n)
        if not isinstance(ids, list):
            rows.input_ids(n).copy_(ids)
        return self._forward_rows(n, padded, lens, max(counts), hidden)

    def _forward_rows(self, n: int, padded: int | None, lens: list[int], per_seq: int,
                      hidden: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The network over the first ``n`` rows already in ``self.rows``: a graph replay
        of size ``padded``, else eagerly (``lens``: the rows' context lengths or lower
        bounds of them, with up to ``max_rows_per_seq`` more)."""
        assert self.rows is not None
        if hidden is not None:
            if self._hidden_in is None:
                self._hidden_in = hidden.new_zeros((self.rows.max_seqs, hidden.shape[-1]))
            self._hidden_in[:n].copy_(hidden)
        if padded is not None:
            assert self.graphs is not None
            out, carry = self.graphs.replay(padded)
            return out[:n], carry[:n] if carry is not None else None
        meta = self.rows.metadata(n, lens, self.max_model_len, per_seq)
        meta.max_seq_len = min(meta.max_seq_len + self.max_rows_per_seq, self.max_model_len)
        with forward_context(meta):
            return self._rows_forward(n, meta)

    @torch.inference_mode()
    def propose(self, rows: list[DraftRows],
                hidden: torch.Tensor | None) -> dict[int, list[int]]:
        """Drafts by sequence id for the rows that want them (one host read). ``hidden``:
        the network's hidden input (``target_hidden`` of the target's output) for every
        row of the target's step, where it reads one."""
        if not rows:
            return {}
        net = self.network
        reads_hidden = net.reads_target_hidden
        starts, counts, ids, hidden_rows = [], [], [], []
        for r in rows:
            extra = 0 if reads_hidden or r.wanted == 0 else 1
            starts.append(r.start)
            counts.append(r.kept + extra)
            ids.extend(r.tokens[1 : r.kept + 1] if reads_hidden else r.tokens[: r.kept + extra])
            hidden_rows.extend(range(r.hidden_row, r.hidden_row + r.kept))
        if reads_hidden:
            assert hidden is not None
            hidden = hidden.index_select(0, host_to_device(hidden_rows, torch.long, self.device))
        out, carry = self._run(starts, counts, [r.seq.block_table for r in rows], ids,
                               hidden if reads_hidden else None)
        active = [i for i, r in enumerate(rows) if r.wanted > 0]
        if not active:
            return {}
        ends = list(itertools.accumulate(counts))
        last = host_to_device([ends[i] - 1 for i in active], torch.long, self.device)
        first = net.compute_logits(out.index_select(0, last)).argmax(dim=-1)
        carry = carry.index_select(0, last) if carry is not None else None
        nexts = [starts[i] + counts[i] for i in active]
        drafts = self._extend(first, carry, [rows[i].seq for i in active],
                              [rows[i].wanted for i in active],
                              host_to_device(nexts, torch.long, self.device), nexts)
        return self.collect([r.seq for r in rows], [r.wanted for r in rows], drafts,
                            torch.cat(drafts).tolist())

    @torch.inference_mode()
    def propose_verified(
        self, seqs: list[Sequence], counts: list[int], token_ids: torch.Tensor,
        num_accepted: torch.Tensor, hidden: torch.Tensor | None, wanted: list[int],
    ) -> list[torch.Tensor]:
        """Drafts after a verify step that ran as decode rows, without reading its result
        on the host: sequence i computed ``counts[i]`` rows from its ``num_computed_tokens``
        and emitted ``token_ids[i]`` (-1 past its ``num_accepted[i] + 1`` tokens), both on
        the device; ``hidden`` holds the network's input for those rows. The network runs
        over every row (a rejected row's draft KV lies past the accepted ones and is
        overwritten later), the first draft comes from each sequence's row of its last
        emitted token, and the positions of the next steps move on by ``num_accepted`` on
        the device. ``wanted[i]``: drafts for sequence i. Returns each step's argmaxes,
        over the sequences wanting more than j drafts."""
        net = self.network
        device = self.device
        width = token_ids.shape[1]
        emitted = token_ids.clamp_min(0)
        # A draft model also reads each sequence's newest token, the row before the emitted.
        offset = 0 if net.reads_target_hidden else 1
        if offset:
            newest = host_to_device([s.token_ids[s.num_computed_tokens] for s in seqs],
                                    torch.long, device)
            emitted = torch.cat([newest[:, None], emitted], dim=1)
            width += 1
        run_counts = [c + offset for c in counts]
        flat = [i * width + j for i, c in enumerate(run_counts) for j in range(c)]
        ids = emitted.flatten().index_select(0, host_to_device(flat, torch.long, device))
        starts = [s.num_computed_tokens for s in seqs]
        assert self.rows is not None and max(run_counts) <= self.max_rows_per_seq
        out, carry = self._run(starts, run_counts, [s.block_table for s in seqs], ids, hidden)
        active = [i for i, w in enumerate(wanted) if w > 0]
        if not active:
            return []
        firsts = [0, *itertools.accumulate(run_counts)]
        at = host_to_device([[firsts[i] for i in active], active,
                             [starts[i] + offset for i in active]], torch.long, device)
        accepted = num_accepted.index_select(0, at[1])
        last = at[0] + offset + accepted
        first = net.compute_logits(out.index_select(0, last)).argmax(dim=-1)
        carry = carry.index_select(0, last) if carry is not None else None
        # Past the accepted drafts: known on the device only; the host's are lower bounds.
        nexts = [starts[i] + offset + 1 for i in active]
        return self._extend(first, carry, [seqs[i] for i in active], [wanted[i] for i in active],
                            at[2] + 1 + accepted, nexts)

    def _extend(self, first: torch.Tensor, carry: torch.Tensor | None, seqs: list[Sequence],
                wanted: list[int], positions: torch.Tensor, lower: list[int],
                ) -> list[torch.Tensor]:
        """After the first drafts ``first`` (one per sequence of ``seqs``, with the hidden
        state each step reads next, ``carry``): single-token steps while a sequence wants
        more, sequence i at device position ``positions[i]`` (at least ``lower[i]``) and
        on. Their rows are written on the device (``DecodeInputs.load_rows``): the host
        neither waits for the rows' last copy nor needs the positions. Returns every
        step's argmaxes, over the sequences wanting more than j drafts."""
        assert self.rows is not None
        drafts = [first]
        # Only the columns the tables fill cross over: a row is as wide as --max-model-len.
        used = max(len(s.block_table) for s in seqs)
        tables = self.rows.dev_tables.new_full((len(seqs), self.rows.dev_tables.shape[1]), -1)
        tables[:, :used] = host_to_device([s.block_table + [-1] * (used - len(s.block_table))
                                           for s in seqs], torch.int32, self.device)
        for j in range(1, max(wanted)):
            keep = [n for n, w in enumerate(wanted) if w > j]
            ids = drafts[-1]
            if len(keep) < len(wanted):
                sel = host_to_device(keep, torch.long, self.device)
                ids, tables, positions = (t.index_select(0, sel) for t in (ids, tables,
                                                                           positions))
                carry = carry.index_select(0, sel) if carry is not None else None
                wanted, lower = [wanted[n] for n in keep], [lower[n] for n in keep]
            n = len(wanted)
            padded = self.graphs.padded_size(n) if self.graphs is not None else None
            self.rows.load_rows(n, padded or n, ids, positions, tables)
            out, carry = self._forward_rows(n, padded, [p + 1 for p in lower], 1, carry)
            drafts.append(self.network.compute_logits(out).argmax(dim=-1))
            positions, lower = positions + 1, [p + 1 for p in lower]
        return drafts

    @staticmethod
    def collect(seqs: list[Sequence], wanted: list[int], drafts: list[torch.Tensor],
                host: list[int]) -> dict[int, list[int]]:
        """Drafts by sequence id from ``host``, the step argmaxes ``drafts`` concatenated
        and read: step j's are over the sequences wanting more than j, in order."""
        out: dict[int, list[int]] = {}
        at = 0
        for j in range(len(drafts)):
            for seq, w in zip(seqs, wanted, strict=True):
                if w > j:
                    out.setdefault(seq.seq_id, []).append(host[at])
                    at += 1
        return out
