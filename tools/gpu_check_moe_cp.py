"""Two steps of ``tools/gpu_check.py`` (registered with its :func:`~gpu_check.step`): one MoE
layer's dispatch / experts / combine with grouped GEMMs (issue 41) and ring attention at 32K
tokens against one-GPU SDPA (issue 42). Both run in one process on one device (EP = 1; the
context-parallel ranks one after another), bf16 on CUDA, tiny shapes on the CPU dry run.

``moe_experts``
    our ``MoELayer`` (router, ``TokenDispatcher``, ``Experts``; SwiGLU experts, softmax top-k
    routing with the load-balancing loss, dropless), built with ``--moe-grouped-gemm``, forward
    + backward split at the pieces' boundaries (detached inputs, gradients handed on by hand) and
    timed per piece with CUDA events: route + dispatch, experts (both GEMMs and the activation),
    combine. Once with the grouped GEMM (``torch._grouped_mm``) and once with the per-expert loop
    (the same layer, its experts' ``grouped`` off: what the flag off builds). Shapes: Mixtral-8x7B's
    layer (h 4096, 8 experts of 14336, top-2) and a fine-grained one (h 2048, 64 experts of 1408,
    top-6, DeepSeekMoE-16B's), 8192 tokens. TFLOP/s of the expert GEMMs: ``6 h f`` FLOPs per
    routed row forward (SwiGLU: ``[h, 2f]`` and ``[f, h]``), twice that backward.
    Verdict: PASS when the grouped path ran and its output and gradients equal the loop's
    (max difference <= 2^-5 of the largest value: bf16 results of two summation orders); INFO
    when this torch and device cannot run the grouped GEMM (the loop alone timed).
``ring_attention``
    ``--cp-comm-type p2p`` ring attention at 32K tokens, causal, bf16, 8 query heads on 2
    key/value heads of 128, CP in {2, 4}: every rank's forward and backward run serially
    (``context_parallel/serial.py: SerialRing``, the distributed ring's own per-rank functions)
    and are compared with one ``scaled_dot_product_attention`` call over all the tokens (bf16,
    the kernel SDPA picks): output, dQ, dK, dV, and both with an fp32 SDPA of the same bf16
    values. Verdict: PASS when, for each, the ring is within 2^-6 of the fp32 result (its own
    bf16 rounding: it computes in fp32 and rounds its results once; 4 unit roundoffs) and within
    SDPA's own difference from fp32 + 2^-6 of SDPA (the triangle inequality; SDPA's fused kernel
    also rounds its probabilities and score gradients to bf16, and that error grows with the
    length) -- differences relative to the largest value; 2^-5 against SDPA where the fp32
    reference cannot run. The queries are scaled so that the scores have a standard deviation of 3
    (peaked attention, as trained models have): with unit scores a late query averages
    thousands of keys and its output nearly vanishes, so a wrong block would hide under the
    largest values. Time (INFO): the ranks' compute summed and the slowest rank against SDPA.
"""

from __future__ import annotations

import time

import torch
from gpu_check import Context, sdpa_choice, spec_peak_tflops, step

MOE_TOLERANCE = 2.0 ** -5  # grouped vs loop, relative to the largest value (bf16: 4 epsilons)
RING_OWN = 2.0 ** -6  # ring vs the fp32 reference: its own bf16 rounding (4 unit roundoffs)
RING_TOLERANCE = 2.0 ** -5  # ring vs SDPA when there is no fp32 reference (4 bf16 epsilons)
SCORE_STD = 3.0  # standard deviation of the attention scores of the ring check's inputs
NAMES = ("out", "dq", "dk", "dv")  # what the ring check compares


class Clock:
    """Marks on the device's timeline: CUDA events on a GPU (a piece that synchronizes the host,
    as the dispatch's read of the per-expert counts does, includes the device's idle time it
    causes); on the CPU the host's clock (its work is done when a call returns)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def mark(self):
        """A point in time (read with :meth:`ms` once the work is done)."""
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def ms(self, start, end) -> float:
        """Milliseconds from ``start`` to ``end`` (waits for the device)."""
        if self.device.type == "cuda":
            end.synchronize()
            return start.elapsed_time(end)
        return (end - start) * 1e3


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    """``max |got - want| / max |want|`` (float32)."""
    got, want = got.float(), want.float()
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


def median(values: list[float]) -> float:
    """The middle value (the upper one of an even count)."""
    return sorted(values)[len(values) // 2]


# ------------------------------------------------------------------------------ MoE experts
MOE_PIECES = ("dispatch_fwd", "experts_fwd", "combine_fwd", "combine_bwd", "experts_bwd",
              "dispatch_bwd")


def moe_shapes(gpu: bool) -> list[tuple[str, int, int, int, int, int]]:
    """(name, hidden, experts, top-k, expert ffn, tokens) of the MoE layers to time."""
    if not gpu:
        return [("tiny h64 e4 top2 f96", 64, 4, 2, 96, 64)]
    return [("mixtral h4096 e8 top2 f14336", 4096, 8, 2, 14336, 8192),
            ("fine-grained h2048 e64 top6 f1408", 2048, 64, 6, 1408, 8192)]


def build_moe_layer(hidden: int, experts: int, topk: int, ffn: int, dtype: torch.dtype,
                    device: torch.device):
    """Our MoE layer with ``--moe-grouped-gemm`` on ``device``: built on the meta device and
    drawn there (the per-expert host generators would take tens of seconds at 8 x 4096 x
    28672), weights ``N(0, 0.02)``, the output projection scaled as Megatron scales it."""
    from megatron_chimera.config import ModelConfig, MoEConfig
    from megatron_chimera.model.moe.layer import MoELayer
    from megatron_chimera.model.utils import scaled_init_std

    config = ModelConfig(
        num_layers=1, hidden_size=hidden, num_attention_heads=max(1, hidden // 128),
        swiglu=True, normalization="RMSNorm", add_bias_linear=False, hidden_dropout=0.0,
        attention_dropout=0.0, params_dtype="bf16" if dtype == torch.bfloat16 else "fp32",
        moe=MoEConfig(num_experts=experts, moe_ffn_hidden_size=ffn, moe_router_topk=topk,
                      moe_aux_loss_coeff=0.01, moe_grouped_gemm=True))
    with torch.device("meta"):
        layer = MoELayer(config, 1, seed=1234)
    layer = layer.to_empty(device=device)
    generator = torch.Generator(device).manual_seed(1234)
    with torch.no_grad():
        for name, param in layer.named_parameters():
            std = scaled_init_std(0.02, 1) if name.endswith("weight2") else 0.02
            param.normal_(0.0, std, generator=generator)
    return layer


def moe_pass(layer, hidden: torch.Tensor, grad: torch.Tensor, clock: Clock
             ) -> tuple[dict[str, float], torch.Tensor, int]:
    """One forward + backward of ``layer`` on ``hidden`` ``[s, b, h]``, cut where
    ``MoELayer.forward`` calls its pieces: ms per piece, the output, the routed rows."""
    s, b, h = hidden.shape
    marks = [clock.mark()]
    tokens = hidden.reshape(s * b, h)
    probs, routing_map = layer.router(tokens, s)
    dispatched = layer.dispatcher.dispatch(tokens, probs, routing_map)
    marks.append(clock.mark())
    rows = dispatched.tokens.detach().requires_grad_()
    expert_out = layer.experts(rows, dispatched.counts)
    marks.append(clock.mark())
    expert_leaf = expert_out.detach().requires_grad_()
    probs_leaf = dispatched.probs.detach().requires_grad_()
    out = layer.dispatcher.combine(expert_leaf, dispatched._replace(probs=probs_leaf))
    marks.append(clock.mark())
    out.backward(grad.reshape(out.shape))
    marks.append(clock.mark())
    expert_out.backward(expert_leaf.grad)
    marks.append(clock.mark())
    torch.autograd.backward([dispatched.tokens, dispatched.probs], [rows.grad, probs_leaf.grad])
    marks.append(clock.mark())
    times = {piece: clock.ms(a, b) for piece, a, b in zip(MOE_PIECES, marks, marks[1:])}
    return times, out.detach(), int(dispatched.counts.sum())


def time_moe(layer, hidden: torch.Tensor, grad: torch.Tensor, clock: Clock, reps: int,
             warmup: int) -> tuple[dict[str, float], torch.Tensor, list[torch.Tensor], int]:
    """Median ms per piece over ``reps`` passes after ``warmup``; the last pass's output,
    parameter gradients (router, weight1, weight2, then the input's) and routed rows."""
    runs = []
    for i in range(warmup + reps):
        for param in layer.parameters():
            param.grad = None
        hidden.grad = None
        times, out, rows = moe_pass(layer, hidden, grad, clock)
        if i >= warmup:
            runs.append(times)
    grads = [p.grad for p in layer.parameters()] + [hidden.grad]
    return {k: median([r[k] for r in runs]) for k in MOE_PIECES}, out, grads, rows


def moe_row(name: str, variant: str, times: dict[str, float], rows: int, hidden: int,
            ffn: int, spec: float | None) -> dict:
    """One table row: ms per piece and the expert GEMMs' TFLOP/s."""
    flops_fwd = 6.0 * rows * hidden * ffn  # SwiGLU: [h, 2f] then [f, h], 2 FLOPs a MAC
    fwd, bwd = times["experts_fwd"], times["experts_bwd"]
    tflops = 3 * flops_fwd / ((fwd + bwd) * 1e-3) / 1e12
    return {"shape": name, "gemm": variant, "routed_rows": rows,
            **{k: round(v, 3) for k, v in times.items()},
            "total_ms": round(sum(times.values()), 3),
            "experts_tflops_fwd": round(flops_fwd / (fwd * 1e-3) / 1e12, 3),
            "experts_tflops_bwd": round(2 * flops_fwd / (bwd * 1e-3) / 1e12, 3),
            "experts_tflops": round(tflops, 3),
            "experts_share_of_spec": round(tflops / spec, 4) if spec else None}


def time_moe_shape(ctx: Context, shape: tuple, dtype: torch.dtype, variants: tuple[str, ...],
                   spec: float | None) -> tuple[list[dict], str, bool]:
    """Both variants of one MoE shape on the same layer and inputs: (table rows, summary text,
    whether the grouped GEMM differs from the loop beyond :data:`MOE_TOLERANCE`). A variant that
    raises (out of memory, a kernel this build lacks) gives a row with its error."""
    name, hidden, experts, topk, ffn, tokens = shape
    reps, warmup = (5, 2) if ctx.gpu else (2, 1)
    clock = Clock(ctx.device)
    layer = build_moe_layer(hidden, experts, topk, ffn, dtype, ctx.device)
    generator = torch.Generator(ctx.device).manual_seed(7)
    x = torch.randn(tokens // 2, 2, hidden, device=ctx.device, dtype=dtype,
                    generator=generator).requires_grad_()
    grad = torch.randn(tokens // 2, 2, hidden, device=ctx.device, dtype=dtype,
                       generator=generator)
    rows, results = {}, {}
    for variant in variants:
        layer.experts.grouped = variant == "grouped"
        try:
            results[variant] = time_moe(layer, x, grad, clock, reps, warmup)
        except RuntimeError as exc:  # torch.OutOfMemoryError included
            rows[variant] = {"shape": name, "gemm": variant,
                             "error": f"{type(exc).__name__}: {str(exc)[:160]}"}
            continue
        rows[variant] = moe_row(name, variant, results[variant][0], results[variant][3],
                                hidden, ffn, spec)
    texts = [f"{v} experts {r['experts_tflops']} TFLOP/s "
             f"({r['experts_fwd'] + r['experts_bwd']:.3g} ms, layer {r['total_ms']:.3g} ms)"
             if "error" not in r else f"{v}: {r['error']}" for v, r in rows.items()]
    differs = False
    if len(results) == 2:
        diff = max(relative(a, b) for a, b in zip([results["grouped"][1], *results["grouped"][2]],
                                                  [results["loop"][1], *results["loop"][2]]))
        rows["grouped"]["max_difference_vs_loop"] = round(diff, 6)
        differs = diff > MOE_TOLERANCE
        texts.append(f"grouped - loop {diff:.1e}")
    return list(rows.values()), f"{name}: " + ", ".join(texts), differs


@step("moe_experts", "one MoE layer: dispatch / experts / combine, grouped GEMM vs loop")
def check_moe_experts(ctx: Context) -> dict:
    """Times and compares the grouped and looped expert GEMMs (see the module docstring)."""
    from megatron_chimera.model.moe.experts import grouped_mm_runs

    dtype = torch.bfloat16 if ctx.gpu else torch.float32
    spec = spec_peak_tflops(torch.cuda.get_device_name(ctx.device)) if ctx.gpu else None
    grouped_runs = grouped_mm_runs(ctx.device.type, dtype)
    variants = ("grouped", "loop") if grouped_runs else ("loop",)
    rows, parts, failed = [], [], False
    for shape in moe_shapes(ctx.gpu):
        if ctx.remaining() < 15:
            parts.append(f"{shape[0]}: skipped (step budget)")
            failed = True
            continue
        shape_rows, text, differs = time_moe_shape(ctx, shape, dtype, variants, spec)
        rows += shape_rows
        parts.append(text)
        failed = failed or differs or any("error" in r for r in shape_rows)
        if ctx.gpu:
            torch.cuda.empty_cache()
    if not grouped_runs:
        parts.append(f"torch._grouped_mm does not run here ({ctx.device.type}, {dtype}): "
                     "loop only")
    status = "FAIL" if failed else ("PASS" if grouped_runs else "INFO")
    return {"status": status, "rows": rows, "grouped_gemm_runs": grouped_runs,
            "spec_peak_tflops": spec, "table": moe_table(rows, spec),
            "summary": "; ".join(parts)}


def moe_table(rows: list[dict], spec: float | None) -> list[str]:
    """The step's Markdown table: ms per piece (forward / backward) and the experts' TFLOP/s."""
    lines = ["| MoE layer (EP=1) | expert GEMM | routed rows | dispatch ms fwd / bwd | experts ms "
             "fwd / bwd | combine ms fwd / bwd | layer ms | experts TFLOP/s fwd / bwd / all | "
             "of spec | grouped - loop |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['shape']} | {r['gemm']} | - | - | - | - | - | - | - | "
                         f"{r['error']} |")
            continue
        share = f"{100 * r['experts_share_of_spec']:.1f}%" if spec else "-"
        lines.append(
            f"| {r['shape']} | {r['gemm']} | {r['routed_rows']} | {r['dispatch_fwd']} / "
            f"{r['dispatch_bwd']} | {r['experts_fwd']} / {r['experts_bwd']} | "
            f"{r['combine_fwd']} / {r['combine_bwd']} | {r['total_ms']} | "
            f"{r['experts_tflops_fwd']} / {r['experts_tflops_bwd']} / {r['experts_tflops']} | "
            f"{share} | {r.get('max_difference_vs_loop', '-')} |")
    return lines


# ------------------------------------------------------------------------------ ring attention
def ring_shape(gpu: bool) -> tuple[int, int, int, int]:
    """(tokens, query heads, key/value heads, head dim) of the ring check (batch 1)."""
    return (32768, 8, 2, 128) if gpu else (256, 4, 2, 32)


def sdpa_pass(query, key, value, grad, clock: Clock, backend=None
              ) -> tuple[list[torch.Tensor], float, float]:
    """One ``scaled_dot_product_attention`` over the whole sequence (causal; grouped-query keys
    and values repeated, their gradients summed back by autograd) and its backward:
    ([out, dQ, dK, dV], forward ms, backward ms). ``backend``: an ``SDPBackend`` to force."""
    import contextlib

    from torch.nn.attention import sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention

    leaves = [t.detach().requires_grad_() for t in (query, key, value)]
    repeat = query.shape[1] // key.shape[1]
    with sdpa_kernel([backend]) if backend is not None else contextlib.nullcontext():
        start = clock.mark()
        out = scaled_dot_product_attention(
            leaves[0], leaves[1].repeat_interleave(repeat, 1),
            leaves[2].repeat_interleave(repeat, 1), is_causal=True)
        middle = clock.mark()
        out.backward(grad)
        end = clock.mark()
    return [out.detach(), *(t.grad for t in leaves)], clock.ms(start, middle), clock.ms(middle,
                                                                                       end)


def serial_ring_pass(query, key, value, grad, tokens: list, clock: Clock
                     ) -> tuple[list[torch.Tensor], list[float], list[float]]:
    """Ring attention's ranks run one after another (``SerialRing``; ``tokens``: every rank's
    ``ContextTokens``, built once per micro-batch as training does, their masks cached): ([out,
    dQ, dK, dV] of the whole sequence, forward ms per rank, backward ms per rank)."""
    from megatron_chimera.model.context_parallel import merge_sequence, split_sequence
    from megatron_chimera.model.context_parallel.serial import SerialRing

    cp = len(tokens)
    share = [[split_sequence(t, 2, cp, r) for r in range(cp)] for t in (query, key, value, grad)]
    ring = SerialRing(share[1], share[2], tokens)
    outs, dqs, forward, backward = [], [], [], []
    for r in range(cp):
        start = clock.mark()
        outs.append(ring.forward(r, share[0][r]))
        forward.append(clock.ms(start, clock.mark()))
    for r in range(cp):
        start = clock.mark()
        dqs.append(ring.backward(r, share[3][r]))
        backward.append(clock.ms(start, clock.mark()))
    dks, dvs = zip(*ring.key_value_grads())
    whole = [merge_sequence(list(parts), 2) for parts in (outs, dqs, dks, dvs)]
    return whole, forward, backward


def ring_bars(sdpa_row: dict) -> dict[str, float]:
    """The bar of ring vs SDPA per tensor: SDPA's own difference from the fp32 reference plus
    the ring's allowance :data:`RING_OWN` (the triangle inequality), or :data:`RING_TOLERANCE`
    without a reference."""
    return {n: sdpa_row[f"{n}_vs_fp32"] + RING_OWN if f"{n}_vs_fp32" in sdpa_row
            else RING_TOLERANCE for n in NAMES}


def ring_within(row: dict, sdpa_row: dict) -> bool:
    """Whether ring attention's row is within its bars: against SDPA (:func:`ring_bars`) and,
    where measured, within :data:`RING_OWN` of the fp32 reference."""
    bars = ring_bars(sdpa_row)
    return all(row[f"{n}_vs_sdpa"] <= bars[n] and row.get(f"{n}_vs_fp32", 0.0) <= RING_OWN
               for n in NAMES)


def ring_row(query, key, value, grad, cp: int, clock: Clock, reps: int,
             sdpa: list[torch.Tensor], sdpa_ms: float, exact: list[torch.Tensor] | None) -> dict:
    """The table row of ring attention at ``cp``: one untimed pass (its results compared with
    SDPA's and the fp32 reference's), then ``reps`` timed ones (each rank's fastest)."""
    from megatron_chimera.model.context_parallel.serial import zigzag_tokens

    tokens = zigzag_tokens(query.shape[2], cp, True, query.device)
    whole, _, _ = serial_ring_pass(query, key, value, grad, tokens, clock)
    forward, backward = [float("inf")] * cp, [float("inf")] * cp
    for _ in range(reps):
        _, f, b = serial_ring_pass(query, key, value, grad, tokens, clock)
        forward, backward = list(map(min, forward, f)), list(map(min, backward, b))
    per_rank = [f + b for f, b in zip(forward, backward)]
    return {"what": f"ring CP={cp}", "fwd_ms": round(sum(forward), 3),
            "bwd_ms": round(sum(backward), 3), "slowest_rank_ms": round(max(per_rank), 3),
            "per_rank_ms": [round(t, 3) for t in per_rank],
            "sum_over_sdpa": round(sum(per_rank) / sdpa_ms, 3),
            "slowest_over_sdpa": round(max(per_rank) / sdpa_ms, 3),
            **{f"{n}_vs_sdpa": round(relative(a, b), 6) for n, a, b in zip(NAMES, whole, sdpa)},
            **({f"{n}_vs_fp32": round(relative(a, b), 6)
                for n, a, b in zip(NAMES, whole, exact)} if exact else {})}


@step("ring_attention", "ring attention (p2p), CP ranks run serially, vs one SDPA call")
def check_ring_attention(ctx: Context) -> dict:
    """Ring attention at CP 2 and 4 against SDPA (see the module docstring)."""
    from torch.nn.attention import SDPBackend

    seq, heads, groups, head_dim = ring_shape(ctx.gpu)
    dtype = torch.bfloat16  # the CPU runs bf16 too: the tolerance is what is checked
    clock, reps = Clock(ctx.device), 3 if ctx.gpu else 1
    generator = torch.Generator(ctx.device).manual_seed(42)

    def draw(h: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(1, h, seq, head_dim, device=ctx.device, generator=generator)
                * scale).to(dtype)

    query = draw(heads, SCORE_STD)  # scores q.k / sqrt(d) of standard deviation SCORE_STD
    key, value, grad = draw(groups), draw(groups), draw(heads)
    # fp32 SDPA of the same (bf16) values: memory-efficient kernel on CUDA (flash has no fp32)
    try:
        exact, _, _ = sdpa_pass(query.float(), key.float(), value.float(), grad.float(), clock,
                                SDPBackend.EFFICIENT_ATTENTION if ctx.gpu else None)
    except RuntimeError as exc:  # no fp32 kernel that fits: the INFO columns stay empty
        print(f"fp32 SDPA reference: {type(exc).__name__}: {exc}", flush=True)
        exact = None
        if ctx.gpu:
            torch.cuda.empty_cache()
    sdpa_runs = [sdpa_pass(query, key, value, grad, clock) for _ in range(1 + reps)]
    sdpa, sdpa_fwd, sdpa_bwd = sdpa_runs[-1][0], median([r[1] for r in sdpa_runs[1:]]), \
        median([r[2] for r in sdpa_runs[1:]])
    kernel = sdpa_choice(ctx.device, dtype, heads, heads, seq, head_dim, 0.0)
    rows, ok = [], True
    rows.append({"what": f"SDPA {kernel}", "fwd_ms": round(sdpa_fwd, 3),
                 "bwd_ms": round(sdpa_bwd, 3),
                 **({f"{n}_vs_fp32": round(relative(a, b), 6)
                     for n, a, b in zip(NAMES, sdpa, exact)} if exact else {})})
    for cp in (2, 4):
        if ctx.remaining() < 10:
            rows.append({"what": f"ring CP={cp}", "error": "skipped (step budget)"})
            ok = False
            continue
        try:
            row = ring_row(query, key, value, grad, cp, clock, reps, sdpa, sdpa_fwd + sdpa_bwd,
                           exact)
        except RuntimeError as exc:  # torch.OutOfMemoryError included
            row = {"what": f"ring CP={cp}", "error": f"{type(exc).__name__}: {str(exc)[:160]}"}
        rows.append(row)
        ok = ok and "error" not in row and ring_within(row, rows[0])
        if ctx.gpu:
            torch.cuda.empty_cache()
    parts = [f"{seq} tokens, {heads} heads on {groups} K/V heads of {head_dim}, causal, bf16; "
             f"SDPA ({kernel}) {sdpa_fwd + sdpa_bwd:.3g} ms fwd+bwd"]
    for r in rows[1:]:
        if "error" in r:
            parts.append(f"{r['what']}: {r['error']}")
            continue
        worst = max(r[f"{n}_vs_sdpa"] for n in NAMES)
        bar = min(ring_bars(rows[0]).values())
        parts.append(f"{r['what']}: max difference vs SDPA {worst:.2e} (bars from {bar:.2e}),"
                     f" ranks' compute {r['fwd_ms'] + r['bwd_ms']:.4g} ms summed "
                     f"({r['sum_over_sdpa']}x SDPA), slowest rank {r['slowest_rank_ms']:.4g} ms")
    tf32 = torch.backends.cuda.matmul.allow_tf32 if ctx.gpu else None
    return {"status": "PASS" if ok else "FAIL", "rows": rows, "score_std": SCORE_STD,
            "bars_vs_sdpa": {n: round(b, 6) for n, b in ring_bars(rows[0]).items()},
            "bar_vs_fp32": RING_OWN if "out_vs_fp32" in rows[0] else None, "tf32_matmul": tf32,
            "table": ring_table(rows), "summary": "; ".join(parts)}


def ring_table(rows: list[dict]) -> list[str]:
    """The step's Markdown table: times and the differences from SDPA (bf16) and fp32 SDPA."""
    lines = ["| attention | fwd ms | bwd ms | slowest rank ms | x SDPA (sum / slowest) | "
             "out, dQ, dK, dV vs SDPA | out, dQ, dK, dV vs fp32 |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['what']} | - | - | - | - | {r['error']} | - |")
            continue
        vs = [", ".join(f"{r[f'{n}_vs_{ref}']:.1e}" for n in NAMES)
              if f"out_vs_{ref}" in r else "-" for ref in ("sdpa", "fp32")]
        ratio = (f"{r['sum_over_sdpa']} / {r['slowest_over_sdpa']}" if "sum_over_sdpa" in r
                 else "1")
        lines.append(f"| {r['what']} | {r['fwd_ms']} | {r['bwd_ms']} | "
                     f"{r.get('slowest_rank_ms', '-')} | {ratio} | {vs[0]} | {vs[1]} |")
    return lines
