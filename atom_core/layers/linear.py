"""Linear layers that know how tensor parallelism splits them.

Each parameter carries a ``weight_loader(param, loaded_weight, shard_id=None)`` that copies
a Hugging Face checkpoint tensor into this rank's slice; fused layers (qkv, gate_up) take
``shard_id`` to say which of their parts the tensor is. The rank and group size come from
``atom_core.distributed.state`` when the layer is built; a row-parallel layer sums the
ranks' partial products (one all-reduce). The product itself is the registry's ``linear``
op (``F.linear`` contract), resolved once for the build context's device.

``quantize_fp8`` (``--quantization fp8``, after loading) swaps the weight for its e4m3
values and per-row scales; ``op_weight`` is what the ops are handed, the plain weight or
the ``Fp8Weight``. Where the build defers the weights (``BuildContext.defer_weights``),
``allocate_weights`` gives them their format before loading instead, and the weight loaders
quantize the checkpoint's rows as they copy them (``store_rows``).
"""

from __future__ import annotations

import torch
from torch import nn

from atom_core.distributed.collectives import all_reduce
from atom_core.distributed.state import tp_rank_and_size
from atom_core.errors import ConfigError
from atom_core.layers.context import get_build_context
from atom_core.ops import resolve_op
from atom_core.ops.deferred_norm import AddNorm, DeferredNorm
from atom_core.quant.fp8 import FP8_DTYPE, Fp8Weight, RowsOnLoad, quantize_rows, quantize_weight


def default_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
    """Copy a whole tensor into ``param`` (same shape; dtype and device converted)."""
    _check_fits(param, loaded_weight)
    if param.dtype == FP8_DTYPE and loaded_weight.dtype != FP8_DTYPE:
        # A cast would drop the scale: e4m3 weights take their rows through store_rows.
        raise TypeError("an e4m3 weight is filled by store_rows, not copied into")
    param.data.copy_(loaded_weight)


def _check_fits(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
    if param.shape != loaded_weight.shape:
        raise ValueError(
            f"checkpoint tensor of shape {tuple(loaded_weight.shape)} does not fit "
            f"parameter of shape {tuple(param.shape)}"
        )


def store_rows(param: nn.Parameter, index: tuple[int | slice, ...],
               loaded_weight: torch.Tensor) -> None:
    """Copy ``loaded_weight`` into ``param.data[index]``, ``index`` over the leading
    dimensions (whole rows). A weight allocated in e4m3 before loading (its
    ``quantize_on_load``) takes the rows rounded to the model dtype and quantized one scale
    a row, the scales at the same index: the bits ``quantize_fp8`` gives after loading."""
    target = param.data[index]
    rows: RowsOnLoad | None = getattr(param, "quantize_on_load", None)
    if rows is None:
        return default_weight_loader(target, loaded_weight)
    _check_fits(target, loaded_weight)
    q, scale = quantize_rows(loaded_weight.to(target.device, rows.dtype))
    target.copy_(q)
    rows.scale[index].copy_(scale)


def deferrable_weight(*shape: int) -> nn.Parameter:
    """A linear's or an expert stack's weight, uninitialized; on the meta device (no memory)
    where the build defers the weights (``BuildContext.defer_weights``)."""
    device = "meta" if get_build_context().defer_weights else None
    return nn.Parameter(torch.empty(*shape, device=device), requires_grad=False)


def allocated(shape: torch.Size, device: torch.device, dtype: torch.dtype,
              w8a8_min_rows: int | None) -> tuple[nn.Parameter, Fp8Weight | None]:
    """A deferred weight's storage: in ``dtype``, or (``w8a8_min_rows`` given) e4m3 values
    with fp32 scales [..., N] that ``store_rows`` fills as the checkpoint is read."""
    if w8a8_min_rows is None:
        return nn.Parameter(torch.empty(shape, dtype=dtype, device=device),
                            requires_grad=False), None
    weight = nn.Parameter(torch.empty(shape, dtype=FP8_DTYPE, device=device), requires_grad=False)
    scale = nn.Parameter(torch.empty(shape[:-1], dtype=torch.float32, device=device),
                         requires_grad=False)
    weight.quantize_on_load = RowsOnLoad(scale, dtype)
    return weight, Fp8Weight(weight, scale, w8a8_min_rows)


def _divide(numerator: int, denominator: int, what: str) -> int:
    """numerator / denominator, or a ConfigError saying what does not split evenly."""
    if numerator % denominator:
        raise ConfigError(f"{what}: {numerator} does not split evenly into {denominator} "
                          "(--tensor-parallel-size)")
    return numerator // denominator


class Fp8Quantizable:
    """A module whose ``weight`` [N, K] the ops multiply by (a linear, the LM head), which
    ``--quantization fp8`` may swap for e4m3 values and per-row scales.

    ``quantizable`` False keeps the weight in the model dtype: for a model that reads the
    weight itself instead of calling ``forward``."""

    quantizable = True
    fp8: Fp8Weight | None = None
    weight: nn.Parameter

    @property
    def op_weight(self) -> torch.Tensor | Fp8Weight:
        """The weight as the ops take it: the parameter, or its ``Fp8Weight``."""
        return self.weight if self.fp8 is None else self.fp8

    def quantize_fp8(self, w8a8_min_rows: int) -> None:
        """Replace the weight by its e4m3 values (``weight``, same name) and one fp32 scale
        per output row (``weight_scale``); the model-dtype weight is freed."""
        fp8 = quantize_weight(self.weight.data, w8a8_min_rows)
        self.weight = nn.Parameter(fp8.qweight, requires_grad=False)
        self.weight_scale = nn.Parameter(fp8.scale, requires_grad=False)
        self.fp8 = Fp8Weight(self.weight, self.weight_scale, w8a8_min_rows)

    def allocate_weights(self, device: torch.device, dtype: torch.dtype,
                         w8a8_min_rows: int | None) -> None:
        """Give the deferred weight its storage (``allocated``) before loading: e4m3 where
        ``w8a8_min_rows`` is given (as ``quantize_fp8`` would leave it), else ``dtype``."""
        weight, fp8 = allocated(self.weight.shape, device, dtype, w8a8_min_rows)
        weight.weight_loader = self.weight.weight_loader
        self.weight = weight
        if fp8 is not None:
            self.weight_scale = weight.quantize_on_load.scale
            self.fp8 = fp8


class LinearBase(Fp8Quantizable, nn.Module):
    """y = x W^T + b with W of shape [output_size, input_size] on this rank."""

    def __init__(self, input_size: int, output_size: int, bias: bool, tp_dim: int | None) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank_and_size()
        self.tp_dim = tp_dim  # the weight dimension split across ranks (None: replicated)
        self.input_size = input_size
        self.output_size = output_size
        self.weight = deferrable_weight(output_size, input_size)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)
        self._linear = resolve_op("linear", get_build_context().device)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: str | int | None = None
    ) -> None:
        # Biases split along dim 0 like the output rows; a row-parallel bias is replicated.
        dim = self.tp_dim if self.tp_dim is not None and self.tp_dim < param.dim() else None
        if dim is not None and self.tp_size > 1:
            size = param.shape[dim]
            loaded_weight = loaded_weight.narrow(dim, self.tp_rank * size, size)
        store_rows(param, (), loaded_weight)

    def forward(self, x: torch.Tensor | DeferredNorm) -> torch.Tensor:
        return self._linear(x, self.op_weight, self.bias)

    def extra_repr(self) -> str:
        quant = ", fp8" if self.fp8 is not None else ""
        return f"in={self.input_size}, out={self.output_size}, bias={self.bias is not None}{quant}"


class ReplicatedLinear(LinearBase):
    """The full weight on every rank."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__(input_size, output_size, bias, tp_dim=None)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; each rank returns its slice of y."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        _, tp_size = tp_rank_and_size()
        out = _divide(output_size, tp_size, "a column-parallel layer's output features")
        super().__init__(input_size, out, bias, tp_dim=0)


class RowParallelLinear(LinearBase):
    """Input features split across ranks; the partial products are summed (all-reduce)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        _, tp_size = tp_rank_and_size()
        inp = _divide(input_size, tp_size, "a row-parallel layer's input features")
        super().__init__(inp, output_size, bias, tp_dim=1)

    def forward(
        self, x: torch.Tensor, add_norm: AddNorm | None = None
    ) -> torch.Tensor | DeferredNorm:
        """``add_norm``: the next block's residual add and norm, for the op to finish where it
        can (``atom_core.ops.deferred_norm``); declined with TP > 1, where the sum of the
        ranks' products comes first."""
        # The bias is added once: rank 0's partial product carries it.
        bias = self.bias if self.tp_rank == 0 else None
        if self.tp_size > 1:
            return all_reduce(self._linear(x, self.op_weight, bias))
        return self._linear(x, self.op_weight, bias, add_norm=add_norm)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one GEMM (gate_up): shard_id is the part's index."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), bias)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: str | int | None = None
    ) -> None:
        if shard_id is None:  # an already-fused checkpoint tensor
            return super().weight_loader(param, loaded_weight)
        shard_id = int(shard_id)
        sizes = [s // self.tp_size for s in self.output_sizes]
        offset = sum(sizes[:shard_id])
        loaded_weight = loaded_weight.narrow(0, self.tp_rank * sizes[shard_id], sizes[shard_id])
        store_rows(param, (slice(offset, offset + sizes[shard_id]),), loaded_weight)


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one GEMM; output is [q | k | v] with this rank's heads.

    K/V heads are replicated when there are fewer of them than ranks.
    """

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        total_num_heads: int,
        total_num_kv_heads: int | None = None,
        bias: bool = False,
    ) -> None:
        total_num_kv_heads = total_num_kv_heads or total_num_heads
        _, tp_size = tp_rank_and_size()
        self.head_size = head_size
        self.num_heads = _divide(total_num_heads, tp_size, "the attention heads")
        if tp_size >= total_num_kv_heads:
            self.num_kv_heads = 1
            self.num_kv_head_replicas = _divide(
                tp_size, total_num_kv_heads, "ranks over the KV heads they replicate")
        else:
            self.num_kv_heads = _divide(total_num_kv_heads, tp_size, "the KV heads")
            self.num_kv_head_replicas = 1
        output_size = (self.num_heads + 2 * self.num_kv_heads) * tp_size * head_size
        super().__init__(hidden_size, output_size, bias)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_size

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_size

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: str | int | None = None
    ) -> None:
        if shard_id is None:
            return super().weight_loader(param, loaded_weight)
        if shard_id == "q":
            offset, size, rank = 0, self.q_size, self.tp_rank
        elif shard_id == "k":
            offset, size = self.q_size, self.kv_size
            rank = self.tp_rank // self.num_kv_head_replicas
        elif shard_id == "v":
            offset, size = self.q_size + self.kv_size, self.kv_size
            rank = self.tp_rank // self.num_kv_head_replicas
        else:
            raise ValueError(
                f"QKVParallelLinear shard_id must be 'q', 'k' or 'v', got {shard_id!r}")
        loaded_weight = loaded_weight.narrow(0, rank * size, size)
        store_rows(param, (slice(offset, offset + size),), loaded_weight)
