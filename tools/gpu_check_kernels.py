"""The ``kernels`` step of ``tools/gpu_check.py`` (issue 49), CUDA only:

- attention at the dense layer's shape (h 4096 / s 4096: 32 heads of 128, one sequence, bf16,
  causal), forward + backward, with each fused SDPA kernel alone (cuDNN attention,
  FlashAttention-2, memory-efficient) and with what SDPA picks by default and under
  ``--use-flash-attn`` (``model/fused.py``'s backend list): ms each;
- the fused weight gradient at a real transposed shape: ``main_grad [4096, 4096] fp32 +=
  grad_output^T [4096, 8192] @ input [8192, 4096]`` (bf16) through the path training takes
  (``tensor_parallel/weight_grad.wgrad_accumulation_path``) and through torch's
  ``addmm(out_dtype=float32)`` against the unfused product-then-add: error against an fp32
  product (bar 2^-8 of the largest value) and ms of each.

Verdict: PASS when every fused weight-gradient result is within 2^-8; FAIL otherwise; SKIP on
the CPU (CUDA kernels).
"""

from __future__ import annotations

import torch
from gpu_check import Context, step
from gpu_check_moe_cp import Clock, median, relative

WGRAD_TOLERANCE = 2.0 ** -8


def _time(fn, clock: Clock, reps: int = 5) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        start = clock.mark()
        fn()
        times.append(clock.ms(start, clock.mark()))
    return median(times)


def _attention_rows(ctx: Context, clock: Clock) -> list[dict]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from megatron_chimera.model import fused

    generator = torch.Generator(ctx.device).manual_seed(3)
    q, k, v = (torch.randn(1, 32, 4096, 128, device=ctx.device, dtype=torch.bfloat16,
                           generator=generator).requires_grad_() for _ in range(3))
    grad = torch.randn_like(q)

    def run():
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.backward(grad)

    choices = [("default", None), ("--use-flash-attn", fused._flash_backends())]
    for name in ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION"):
        if hasattr(SDPBackend, name):
            choices.append((name, [getattr(SDPBackend, name)]))
    rows = []
    for name, backends in choices:
        try:
            if backends is None:
                ms = _time(run, clock)
            else:
                with sdpa_kernel(backends):
                    ms = _time(run, clock)
            rows.append({"attention": name, "ms_fwd_bwd": round(ms, 3)})
        except RuntimeError as exc:
            rows.append({"attention": name, "error": str(exc).splitlines()[0][:160]})
    return rows


def _wgrad_rows(ctx: Context, clock: Clock) -> tuple[list[dict], str]:
    from megatron_chimera.tensor_parallel.weight_grad import wgrad_accumulation_path

    generator = torch.Generator(ctx.device).manual_seed(4)
    grad_out = torch.randn(8192, 4096, device=ctx.device, dtype=torch.bfloat16,
                           generator=generator)
    inputs = torch.randn(8192, 4096, device=ctx.device, dtype=torch.bfloat16,
                         generator=generator)
    base = torch.randn(4096, 4096, device=ctx.device, generator=generator)
    want = base + grad_out.float().t() @ inputs.float()
    path = wgrad_accumulation_path(torch.float32, torch.bfloat16, ctx.device)
    rows = []

    def unfused():
        acc = base.clone()
        acc.add_(grad_out.t() @ inputs)
        return acc

    def out_dtype():
        acc = base.clone()
        torch.addmm(acc, grad_out.t(), inputs, out_dtype=torch.float32, out=acc)
        return acc

    for name, fn in (("unfused (bf16 product, fp32 add)", unfused),
                     ("addmm(out_dtype=float32)", out_dtype)):
        try:
            err = relative(fn(), want)
            rows.append({"wgrad": name, "ms": round(_time(fn, clock), 3),
                         "error_vs_fp32": err})
        except (RuntimeError, TypeError) as exc:
            rows.append({"wgrad": name, "error": str(exc).splitlines()[0][:160]})
    return rows, path


@step("kernels", "attention kernels at the layer shape; fused weight gradient, transposed")
def check_kernels(ctx: Context) -> dict:
    """See the module docstring."""
    if not ctx.gpu:
        return {"status": "SKIP", "summary": "CUDA kernels (cuDNN / flash attention, "
                                             "addmm out_dtype): nothing to time on the CPU"}
    clock = Clock(ctx.device)
    attention = _attention_rows(ctx, clock)
    wgrad, path = _wgrad_rows(ctx, clock)
    fused = [r for r in wgrad if r["wgrad"].startswith("addmm")]
    ok = bool(fused) and all(r.get("error_vs_fp32", 1.0) <= WGRAD_TOLERANCE for r in fused)
    return {"status": "PASS" if ok else "FAIL", "attention": attention, "wgrad": wgrad,
            "wgrad_path_training_takes": path,
            "summary": "attention fwd+bwd h4096/s4096 bf16 causal: " + ", ".join(
                f"{r['attention']} {r.get('ms_fwd_bwd', 'n/a')} ms" for r in attention)
            + "; wgrad [4096x8192]^T @ [8192x4096] into fp32: " + ", ".join(
                f"{r['wgrad']} {r.get('ms', 'n/a')} ms, error {r.get('error_vs_fp32', 'n/a')}"
                for r in wgrad) + f" (bar {WGRAD_TOLERANCE:.0e}); training takes {path!r}"}
