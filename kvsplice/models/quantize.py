"""Weight formats for a whole model: pick one (`resolve_weight_format`) and round a Decoder's
linear weights to it (`apply_weight_format`), so that the reference path (the Decoder) and the
fast path (FastDecoder, which multiplies with the packed integers) compute the same model.

    --weight-format  projections (q k v o gate up down)   lm_head
    dense            model dtype                          model dtype
    int8             int8 per output channel              int8
    int4             int4, groups of 32                   int8 (as GGUF Q4 files keep their
                                                          output / embedding tensor at 6-8 bits)
    auto             int4 where the checkpoint already    model dtype
                     is int4 data (a GGUF Q4_0 / Q4_1),
                     with bf16 activations; gguf where
                     its blocks were loaded for auto (a
                     GGUF of other block formats, bf16,
                     on the fast path); else dense
    gguf             the GGUF's own blocks (Q4_K, Q5_0,   the GGUF's own blocks
                     Q8_0 ...) as int4 planes for a few
                     rows, model dtype for more (a GGUF
                     checkpoint with bf16 activations)

`auto` never loses more than the bf16 rounding of the int4 scales (the packed kernels take bf16
activations, so with an fp32 model it stays dense and exact). Models the fast path does not run
(hybrids, sliding windows) get their weights rounded all the same, but compute with the dense copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kvsplice.layers.gguf_blocks import BLOCK_FORMATS
from kvsplice.layers.quant_linear import check_format, is_lossless, round_to_format, supports
from kvsplice.models.decoder import Decoder

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class WeightFormat:
    """The format of the projections and of the lm_head."""

    projections: str
    lm_head: str

    def describe(self) -> str:
        return self.projections if self.projections == self.lm_head else f"{self.projections}+lm_head:{self.lm_head}"


def projection_linears(model: Decoder) -> list[nn.Linear]:
    """Every q/k/v/o and gate/up/down projection of `model`'s attention and MLP blocks."""
    return [module for name, module in model.named_modules()
            if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in PROJECTIONS]


def resolve_weight_format(name: str, model: Decoder) -> WeightFormat:
    """The WeightFormat `name` stands for on `model` (see the module table); ValueError if unknown."""
    if name == "int4":
        return WeightFormat("int4", "int8")
    if name == "gguf":
        if not model.gguf_blocks or model.lm_head.weight.dtype != torch.bfloat16:
            raise ValueError("--weight-format gguf needs a GGUF checkpoint whose projections are block formats, "
                             "and --dtype bfloat16")
        return WeightFormat("gguf", "gguf")
    if name != "auto":
        return WeightFormat(check_format(name), name)
    dtype = model.lm_head.weight.dtype
    linears = projection_linears(model)
    if dtype == torch.bfloat16 and linears and all(is_lossless(m.weight, "int4") for m in linears):
        return WeightFormat("int4", "dense")
    if dtype == torch.bfloat16 and model.gguf_blocks:   # loaded for auto: see `wants_gguf_blocks`
        return WeightFormat("gguf", "gguf")
    return WeightFormat("dense", "dense")


def wants_gguf_blocks(name: str, gguf_types: set[str], bf16: bool, fast_path: bool) -> bool:
    """Whether a checkpoint's GGUF blocks are to be loaded for weight format `name`: always for
    "gguf"; for "auto" where the GGUF's projections hold block formats other than Q4_0 / Q4_1 (those
    auto multiplies as int4, exactly) and the model runs bf16 on the fast path. `gguf_types`: the
    GGUF's 2-D tensor types (empty for other checkpoints). Why auto takes them: on Gemma 3 270M's
    Q4_K_M file one decode row runs faster on the blocks' int4 planes than on the dense bf16 copy,
    at the same prompt-logprob error (docs/BENCHMARKS_HISTORY.md, "--weight-format auto on Gemma 3")."""
    if not may_want_gguf_blocks(name, bf16, fast_path):
        return False
    if name == "gguf":
        return bool(gguf_types)
    return bool(gguf_types & BLOCK_FORMATS.keys() - {"Q4_0", "Q4_1"})


def may_want_gguf_blocks(name: str, bf16: bool, fast_path: bool) -> bool:
    """Whether `wants_gguf_blocks` can be True for any GGUF: the part of its decision that needs no
    tensor types (so a caller reads a GGUF's header only where they matter)."""
    return name == "gguf" or (name == "auto" and bf16 and fast_path)


@torch.no_grad()
def apply_weight_format(model: Decoder, fmt: WeightFormat) -> None:
    """Round `model`'s projection and lm_head weights to `fmt` in place (in their dtype).

    Side effects: a tied lm_head that is rounded gets a Parameter of its own (the embedding
    keeps its weights) and the model's `head_blocks` are dropped; a weight the format cannot hold (int4 needs inputs divisible by 32)
    stays as it is, and the fast path keeps it dense as well.
    """
    if fmt.projections == "gguf":   # the dense weights already are the blocks' values, in the model dtype
        return
    for linear in projection_linears(model):
        if supports(fmt.projections, linear.weight):
            linear.weight.copy_(round_to_format(linear.weight, fmt.projections))
    if fmt.lm_head != "dense" and supports(fmt.lm_head, model.lm_head.weight):
        rounded = round_to_format(model.lm_head.weight, fmt.lm_head)
        model.lm_head.weight = nn.Parameter(rounded, requires_grad=False)
        model.head_blocks = None   # the checkpoint's blocks no longer describe this head
