"""The fused output layer's weight gradient in half precision (ops/fused_output.py, ``wgrad_mode``).

On CUDA with bf16 weights each block's ``gᵀ @ hidden`` is a bf16 GEMM accumulated in fp32; here that path
is forced on CPU in bf16 (``WGRAD_HALF = "force"``) and compared with megatron-core's own output layer in
bf16 (``tensor_parallel.ColumnParallelLinear`` + ``vocab_parallel_cross_entropy``, TP1, whose backward is
``grad_output.t().matmul(total_input)`` in bf16) and with a float64 reference on the same bf16-valued
inputs. Stated bf16 tolerance: relative Frobenius error ≤ 1e-2 against float64 (bf16's unit roundoff is
2^-8 ≈ 3.9e-3; megatron's own gradient is measured against the same bound) and ≤ 1e-2 between the two.
apex's ``fused_weight_gradient_mlp_cuda`` cannot import here: a stand-in with its signature (``total_input
[n, H]``, ``grad_output [n, V]``, fp32 ``main_grad [V, H]`` accumulated in place, as megatron calls it)
checks the argument order and the fp32 accumulation. The fp32 path (CPU default) is unchanged.
"""

from __future__ import annotations

import pytest
import torch

import srpo_megatron.ops.fused_output as fused_ops
from srpo_megatron.ops import OutputShard, token_stats

T, H, V = 64, 32, 256
BF16_TOL = 1e-2


def _inputs():
    g = torch.Generator().manual_seed(3)
    h = torch.randn(T, H, generator=g).to(torch.bfloat16)
    w = (0.3 * torch.randn(V, H, generator=g)).to(torch.bfloat16)
    ids = torch.randint(0, V, (T,), generator=g)
    return h, w, ids


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _reference_wgrad(h, w, ids) -> torch.Tensor:
    """∂(Σ_t −log p(ids_t))/∂W in float64 from the bf16-valued inputs."""
    z = h.double() @ w.double().T
    g = torch.softmax(z, dim=-1)
    g[torch.arange(T), ids] -= 1
    return g.T @ h.double()


def _fused_wgrad(h, w, ids) -> torch.Tensor:
    ww = w.clone().requires_grad_()
    stats = token_stats(OutputShard(h.clone().requires_grad_(), ww), ids[:, None], k=1, chunk_tokens=8)
    (-stats.logp.float().sum()).backward()
    return ww.grad


def _megatron_wgrad(h, w, ids) -> torch.Tensor:
    from megatron.core import tensor_parallel
    from megatron.core.transformer import TransformerConfig

    from srpo_megatron.parallel import initialize_model_parallel

    initialize_model_parallel(1, 1)
    cfg = TransformerConfig(
        num_layers=1, hidden_size=H, num_attention_heads=2, params_dtype=torch.bfloat16, bf16=True
    )
    layer = tensor_parallel.ColumnParallelLinear(
        H, V, config=cfg, init_method=lambda x: None, bias=False, gather_output=False
    )
    with torch.no_grad():
        layer.weight.copy_(w)
    logits, _ = layer(h[:, None, :].clone().requires_grad_())  # [s, b, V] as megatron's output layer
    tensor_parallel.vocab_parallel_cross_entropy(logits, ids[:, None]).sum().backward()
    return layer.weight.grad


@pytest.fixture
def blocks(monkeypatch):
    """Several GEMM blocks per backward (16 rows each), so the fp32 accumulation over blocks is exercised."""
    monkeypatch.setattr(fused_ops, "MIN_CHUNK_ROWS_CPU", 16)


def test_the_bf16_wgrad_is_megatrons_output_layer_gradient_within_bf16(blocks, monkeypatch):
    h, w, ids = _inputs()
    ref = _reference_wgrad(h, w, ids)
    megatron = _megatron_wgrad(h, w, ids)
    assert megatron.dtype == torch.bfloat16 and _rel(megatron, ref) <= BF16_TOL
    monkeypatch.setattr(fused_ops, "WGRAD_HALF", "force")
    assert fused_ops.wgrad_mode(w) == "half"  # CPU: no apex, no addmm out_dtype kernel
    half = _fused_wgrad(h, w, ids)
    assert half.dtype == torch.bfloat16
    assert _rel(half, ref) <= BF16_TOL and _rel(half, megatron) <= BF16_TOL
    monkeypatch.setattr(fused_ops, "WGRAD_HALF", "off")
    fp32 = _fused_wgrad(h, w, ids)
    assert not torch.equal(half, fp32)  # the forced path ran the bf16 GEMM, not the fp32 one
    assert _rel(fp32, ref) <= 2**-8  # one bf16 rounding of an fp32 gradient


def test_the_apex_kernel_gets_megatrons_arguments_and_accumulates_in_fp32(blocks, monkeypatch):
    calls = []

    class StandInApex:  # stand-in for apex's fused_weight_gradient_mlp_cuda (cannot import without CUDA)
        @staticmethod
        def wgrad_gemm_accum_fp32(total_input, grad_output, main_grad):
            assert (
                total_input.dtype == grad_output.dtype == torch.bfloat16 and main_grad.dtype == torch.float32
            )
            assert total_input.shape[1] == H and grad_output.shape[1] == V and main_grad.shape == (V, H)
            calls.append(total_input.shape[0])
            main_grad.addmm_(grad_output.float().t(), total_input.float())  # bf16 products, fp32 sums

    monkeypatch.setattr(fused_ops, "_apex_wgrad", lambda: StandInApex)
    monkeypatch.setattr(fused_ops, "wgrad_mode", lambda weight: "apex")
    h, w, ids = _inputs()
    got = _fused_wgrad(h, w, ids)
    assert calls == [16] * (T // 16)  # one accumulation per block
    assert _rel(got, _reference_wgrad(h, w, ids)) <= 2**-8  # exact bf16 products: one final rounding


def test_the_fp32_path_is_unchanged_on_cpu(blocks):
    """CPU default: bf16 weights keep the fp32 GEMM (the previous formula, bit for bit); fp32 weights too."""
    h, w, ids = _inputs()
    assert fused_ops.WGRAD_HALF == "auto" and fused_ops.wgrad_mode(w) == "fp32"
    got = _fused_wgrad(h, w, ids)
    acc = torch.zeros(V, H)  # the previous backward: fp32 addmm of each block's fp32 ∂L/∂logits
    z = h.float() @ w.float().T
    g = torch.softmax(z.to(torch.bfloat16).float(), dim=-1)
    g[torch.arange(T), ids] -= 1
    for a in range(0, T, 16):
        acc.addmm_(g[a : a + 16].t(), h[a : a + 16].float())
    assert _rel(got, acc.to(torch.bfloat16)) <= 2**-8
    w32 = w.float()
    assert fused_ops.wgrad_mode(w32) == "fp32"
    assert _rel(_fused_wgrad(h.float(), w32, ids), _reference_wgrad(h, w, ids)) <= 1e-5
