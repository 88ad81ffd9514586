"""bitsandbytes' 8-bit optimizer state read as values (``--ucp-requantize-8bit``), and quantized again in a live
bitsandbytes optimizer: the reading is exact against an independent formula (and bitsandbytes' own dequantization
where it is installed); the new form is bitsandbytes' own quantization, and its optimizer steps on it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_ucp.deepspeed.quantized_states import BNB_QUANT_STATE, expand, expanded, packed_states
from megatron_ucp.deepspeed.state_kinds import ELEMENT, kind_of, unplaceable_error
from megatron_ucp.deepspeed.tensor_reads import read_tensor_range
from megatron_ucp.errors import UnsupportedError
from megatron_ucp.format import dsformat as F
from megatron_ucp.format.blockwise8bit import Blockwise8bit
from megatron_ucp.format.rawtensor import RawTensor, from_torch

BLOCK = 256


def _dynamic_map() -> torch.Tensor:
    """A 256-entry code book in [-1, 1], sorted (the shape of bitsandbytes' dynamic map; any book serves here)."""
    return torch.sort(torch.cat([torch.linspace(-1, 1, 255), torch.zeros(1)])).values


def _packed(n: int, seed: int = 0) -> tuple[dict, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    absmax = torch.rand(-(-n // BLOCK), generator=g) * 1e-2
    qmap = _dynamic_map()
    packed = {"state1": codes, "absmax1": absmax, "qmap1": qmap, "state2": codes.flip(0), "absmax2": absmax * 2}
    packed["qmap2"] = qmap.abs().sort().values
    return {k: from_torch(v) for k, v in packed.items()}, codes, absmax, qmap


def test_a_range_of_codes_decodes_to_its_values_on_its_own() -> None:
    n = 5000  # 20 blocks, the last one short
    packed, codes, absmax, qmap = _packed(n)
    state = expand({"step": 3, BNB_QUANT_STATE: packed}, "file: param group 0")
    assert set(state) == {"step", "state1", "state2"}
    decoded = state["state1"]
    assert isinstance(decoded, Blockwise8bit) and decoded.blocksize == BLOCK and decoded.numel() == n
    assert kind_of("state1", decoded) == ELEMENT
    whole = qmap[codes.long()] * absmax.repeat_interleave(BLOCK)[:n]  # independent of the reading's arithmetic
    for start, length in [(0, n), (0, 1), (255, 2), (300, 1000), (4999, 1), (4700, 300), (1024, 256)]:
        out = torch.full((length,), float("nan"))
        read_tensor_range(None, decoded, start, out)
        assert torch.equal(out, whole[start : start + length]), (start, length)


def test_the_reading_equals_bitsandbytes_own_dequantization() -> None:
    functional = pytest.importorskip("bitsandbytes.functional")
    values = torch.randn(9000, generator=torch.Generator().manual_seed(1)) * 1e-3
    qmap = functional.create_dynamic_map(signed=True)
    codes, quant = functional.quantize_blockwise(values, code=qmap, blocksize=BLOCK)
    packed = {"state1": codes, "absmax1": quant.absmax, "qmap1": qmap, "state2": codes, "absmax2": quant.absmax}
    packed["qmap2"] = qmap
    state = expand({BNB_QUANT_STATE: {k: from_torch(v) for k, v in packed.items()}}, "file")
    out = torch.empty(9000)
    read_tensor_range(None, state["state1"], 0, out)
    assert torch.equal(out, functional.dequantize_blockwise(codes, quant))


def test_a_small_partitions_fp32_state_is_lifted_out_as_it_is() -> None:
    packed = {"state1": from_torch(torch.arange(80.0)), "state2": from_torch(torch.ones(80))}
    state = expand({"step": 3, BNB_QUANT_STATE: packed}, "file")
    assert isinstance(state["state1"], RawTensor) and state["state1"] is packed["state1"]
    optim = {F.BASE_OPTIMIZER_STATE: {"state": {0: {"step": 1, BNB_QUANT_STATE: packed}}, "param_groups": []}}
    assert packed_states(optim[F.BASE_OPTIMIZER_STATE]["state"].values()) == ("state1", "state2")
    assert set(expanded(optim, "file")[F.BASE_OPTIMIZER_STATE]["state"][0]) == {"step", "state1", "state2"}
    assert packed_states([{"step": 1, "exp_avg": None}]) == ()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"unorm_vec": from_torch(torch.zeros(1))}, r"holds \['unorm_vec'\]"),
        ({"absmax1": from_torch(torch.zeros(7))}, "fit no block size"),
        ({"qmap1": from_torch(torch.zeros(16))}, "256-entry fp32 code book"),
        ({"state1": from_torch(torch.zeros(5000, dtype=torch.int32))}, "neither fp32 values nor uint8 codes"),
    ],
)
def test_a_dict_this_reading_does_not_know_is_refused_by_name(change: dict, message: str) -> None:
    packed, *_ = _packed(5000)
    with pytest.raises(UnsupportedError, match=message) as raised:
        expand({BNB_QUANT_STATE: {**packed, **change}}, "rank_3.pt: param group 1")
    assert str(raised.value).startswith("rank_3.pt: param group 1")


def test_the_refusal_without_the_option_names_it() -> None:
    error = unplaceable_error("rank_0.pt", [f"'{BNB_QUANT_STATE}' of param group 0 is a dict"], "Adam8bit")
    assert "--ucp-requantize-8bit" in str(error) and "not exact" in str(error) and "nothing was loaded" in str(error)
    assert "--ucp-requantize-8bit" not in str(
        unplaceable_error("rank_0.pt", ["'quant' of param group 0 is a dict"], "X")
    )


def test_a_live_bitsandbytes_optimizer_gets_its_own_8bit_form_and_steps_on_it() -> None:
    bnb = pytest.importorskip("bitsandbytes")
    functional = pytest.importorskip("bitsandbytes.functional")
    from megatron_ucp.integration.resume.native.requantize import blocksize_of_live, requantize_partition

    big, small = torch.nn.Parameter(torch.zeros(5000)), torch.nn.Parameter(torch.zeros(100))
    opt = bnb.optim.Adam8bit([big, small], lr=1e-3)
    assert blocksize_of_live(opt) == BLOCK
    g = torch.Generator().manual_seed(2)
    values = {
        p: (torch.randn(p.numel(), generator=g) * 1e-3, torch.rand(p.numel(), generator=g) * 1e-6) for p in (big, small)
    }
    for p, (m, v) in values.items():
        opt.state[p].update(step=3, state1=m.clone(), state2=v.clone())
    done = requantize_partition(opt, big, BLOCK)
    assert done.elements == 5000 and 0 < done.max_error < 0.1
    state = opt.state[big]
    expected, quant = functional.quantize_blockwise(values[big][0], code=opt.name2qmap["dynamic"], blocksize=BLOCK)
    assert state["state1"].dtype == torch.uint8 and torch.equal(state["state1"], expected)
    assert torch.equal(state["absmax1"], quant.absmax) and state["qmap2"] is not None
    assert requantize_partition(opt, small, BLOCK).elements == 0  # bitsandbytes keeps fp32 under min_8bit_size
    assert torch.equal(opt.state[small]["state1"], values[small][0])
    for p in (big, small):
        p.grad = torch.ones_like(p)
    opt.step()  # bitsandbytes' own step accepts both forms
    assert opt.state[big]["step"] == 4 and np.isfinite(big.detach().numpy()).all()
    with pytest.raises(UnsupportedError, match="not one of bitsandbytes' 8-bit optimizers"):
        blocksize_of_live(torch.optim.Adam([big]))
