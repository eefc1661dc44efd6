"""Times one paired F&B piece sequence of a real MoE layer on one device (issue 48).

The layer is the project's :class:`MoELayer` (router, experts, ``alltoall`` dispatcher) in a
world of one rank. On CUDA each token all-to-all is a **fake all-to-all**: a copy kernel of the
same tensor (same length) on a communication stream of its own, after an event of the compute
stream, repeated so that it lasts as long as the real exchange would over ``--link-gbs`` (the
copy bandwidth is measured first); its handle's ``wait`` makes the compute stream wait on its
event (no host sync). The per-expert counts stay a real (tiny) collective. On CPU the
all-to-alls are gloo's async work to itself. The pair is the forward of one micro-batch beside
the backward of another (cut at its all-to-alls), run by the paired runtime
(:class:`~megatron_chimera.pipeline.overlap.PairRuntime`) three ways:

* ``paired``: interleaved (the backward leads), as ``--overlap-moe-expert-parallel-comm`` runs it;
* ``in turn``: one half after the other, every all-to-all waited at once (exposed);
* ``no comm``: ``in turn`` with the token all-to-alls issuing no kernel (compute only).

It prints the three times and the exposed communication ``paired - no comm`` against the whole
``in turn - no comm`` (on CPU, where an all-to-all to itself costs next to nothing, it says so
instead of a share). ``--device cpu`` is a quick dry run of the same code::

    python tools/gpu_check_overlap.py                 # CUDA when present
    python tools/gpu_check_overlap.py --device cpu    # dry run (seconds)
"""

from __future__ import annotations

import contextlib
import os
import socket
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_chimera import parallel_state  # noqa: E402
from megatron_chimera.config import ModelConfig, MoEConfig  # noqa: E402
from megatron_chimera.errors import ToolArgumentParser, run_tool  # noqa: E402
from megatron_chimera.model.moe.expert_comm import BackwardTape  # noqa: E402
from megatron_chimera.model.moe.layer import MoELayer  # noqa: E402
from megatron_chimera.model.moe.token_dispatcher import TokenDispatcher  # noqa: E402
from megatron_chimera.pipeline.overlap import Half, PairRuntime, leading_half  # noqa: E402
from megatron_chimera.schedules.actions import BACKWARD, FORWARD, Action  # noqa: E402


class _SelfAllToAll(TokenDispatcher):
    """The ``alltoall`` dispatcher's collectives over a world of one rank (to itself)."""

    def dispatch(self, tokens, probs, routing_map):  # noqa: D102
        return self._dispatch_alltoall(tokens, probs, routing_map)

    def combine(self, expert_output, state):  # noqa: D102
        from megatron_chimera.model.moe.token_dispatcher import all_to_all, unpermute
        rows = self._regroup(expert_output, state.recv_counts, by_expert=False)
        rows = all_to_all(self.comm, rows, self.group, state.send_splits, state.recv_splits,
                          "combine")
        return unpermute(rows, state.token_index, state.probs, state.num_tokens)


class _Layer(MoELayer):
    def backward_tape(self):  # noqa: D102 - the one-rank dispatcher cuts too
        return self.dispatcher.comm.tape


@contextlib.contextmanager
def _no_token_kernels():
    """Token all-to-alls issue nothing (the counts still travel: their values route)."""
    real = dist.all_to_all_single

    def fake(out, x, *args, **kwargs):
        if x.is_floating_point():
            return _Done()
        return real(out, x, *args, **kwargs)

    dist.all_to_all_single = fake
    try:
        yield
    finally:
        dist.all_to_all_single = real


class _Done:
    def wait(self) -> bool:
        return True


class _StreamWork:
    """The handle of a fake all-to-all: ``wait`` orders the current stream after it."""

    def __init__(self, event: torch.cuda.Event) -> None:
        self.event = event

    def wait(self) -> bool:
        torch.cuda.current_stream().wait_event(self.event)
        return True


@contextlib.contextmanager
def _copy_all_to_alls(stream: torch.cuda.Stream, copies: int):
    """Token all-to-alls become ``copies`` copies of the same tensor on ``stream`` (a world of
    one rank: the output has the input's length); the counts stay real."""
    real = dist.all_to_all_single

    def fake(out, x, *args, **kwargs):
        if not x.is_floating_point():
            return real(out, x, *args, **kwargs)
        stream.wait_stream(torch.cuda.current_stream())  # the input is computed
        with torch.cuda.stream(stream):
            for _ in range(copies):
                out.copy_(x)
            event = torch.cuda.Event()
            event.record(stream)
        x.record_stream(stream)
        out.record_stream(stream)
        return _StreamWork(event)

    dist.all_to_all_single = fake
    try:
        yield
    finally:
        dist.all_to_all_single = real


def _copy_bandwidth(device: torch.device) -> float:
    """Bytes per second of one device-to-device copy of a 256 MiB tensor (each byte counted
    once, as an all-to-all's volume is)."""
    x = torch.empty(64 << 20, device=device)
    y = torch.empty_like(x)
    y.copy_(x)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        y.copy_(x)
    end.record()
    end.synchronize()
    return 10 * x.numel() * x.element_size() / (start.elapsed_time(end) / 1e3)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    parser = ToolArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto", help="auto (cuda when available), cuda, cpu")
    parser.add_argument("--tokens", type=int, default=None, help="tokens per micro-batch")
    parser.add_argument("--hidden", type=int, default=None)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--link-gbs", type=float, default=50.0,
                        help="CUDA: the emulated all-to-all bandwidth per GPU, GB/s (default 50: "
                             "one 400 Gb/s NIC)")
    args = parser.parse_args(argv)
    if args.link_gbs <= 0:
        parser.error(f"--link-gbs must be > 0, got {args.link_gbs}")
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    tokens = args.tokens or (8192 if cuda else 64)
    hidden = args.hidden or (2048 if cuda else 16)
    reps = args.reps or (10 if cuda else 2)
    if cuda:
        torch.cuda.set_device(device)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1,
                            timeout=timedelta(seconds=120))
    try:
        parallel_state.initialize_model_parallel(1, [[0]], 1, timeout=timedelta(seconds=120))
        config = ModelConfig(num_layers=1, hidden_size=hidden, num_attention_heads=8,
                             hidden_dropout=0.0, attention_dropout=0.0,
                             moe=MoEConfig(num_experts=args.experts, moe_router_topk=2,
                                           moe_ffn_hidden_size=4 * hidden,
                                           moe_token_dispatcher_type="alltoall"))
        layer = _Layer(config, 1, seed=1).to(device).train()
        dispatcher = layer.dispatcher
        layer.dispatcher = _SelfAllToAll("alltoall", args.experts, 1, 0, dist.group.WORLD)
        del dispatcher
        runtime = PairRuntime(device)
        layer.set_expert_comm(runtime)
        counter = iter(range(10**9))

        def forward(action: Action | None = None):
            runtime.tape = tape = BackwardTape()
            runtime.action = action or Action(FORWARD, 0, 0, next(counter))
            x = torch.randn(tokens, 1, hidden, device=device, requires_grad=True)
            try:
                out, _ = layer(x)
                return out.float().square().mean(), tape
            finally:
                runtime.tape = None

        def backward(taped) -> Half:
            loss, tape = taped
            return Half(Action(BACKWARD, 0, 0, next(counter)),
                        lambda: tape.pieces(runtime, loss, torch.ones_like(loss),
                                            torch.autograd.backward), True)

        def timed(mode: str) -> float:
            seconds = []
            for _ in range(reps + 1):
                earlier = backward(forward())
                action = Action(FORWARD, 0, 0, next(counter))
                halves = (Half(action, lambda a=action: forward(a), False), earlier)
                if cuda:
                    torch.cuda.synchronize(device)
                start = time.perf_counter()
                if mode == "paired":
                    runtime.run_pair(halves, leading_half((FORWARD, BACKWARD)))
                else:
                    runtime.run_in_turn(halves)
                if cuda:
                    torch.cuda.synchronize(device)
                seconds.append(time.perf_counter() - start)
            return statistics.median(seconds[1:])

        fake = contextlib.nullcontext()
        note = "gloo's async all-to-all to itself"
        if cuda:
            bandwidth = _copy_bandwidth(device)
            copies = max(1, round(bandwidth / (args.link_gbs * 1e9)))
            fake = _copy_all_to_alls(torch.cuda.Stream(device), copies)
            note = (f"fake all-to-all: {copies} copies of each token tensor on a communication "
                    f"stream, emulating {args.link_gbs:g} GB/s (copy {bandwidth / 1e9:.0f} GB/s)")
        with fake:
            paired, in_turn = timed("paired"), timed("in turn")
        with _no_token_kernels():
            no_comm = timed("in turn")
        comm = max(in_turn - no_comm, 0.0)
        exposed = max(paired - no_comm, 0.0)
        print(f"overlap check on {device} ({tokens} tokens x {hidden} hidden, "
              f"{args.experts} experts, top-2; median of {reps}; {note}):")
        print(f"  paired {paired * 1e3:.3f} ms, in turn {in_turn * 1e3:.3f} ms, "
              f"no comm {no_comm * 1e3:.3f} ms")
        ratio = f"paired / in turn = {paired / in_turn:.3f}"
        if not cuda and comm <= 0.05 * no_comm:  # below the timing noise: nothing to hide
            print(f"  exposed communication: none to hide on CPU (the all-to-alls cost "
                  f"{comm * 1e3:.3f} ms of {in_turn * 1e3:.3f} ms); {ratio}")
        else:
            hidden_share = f"hidden {1 - exposed / comm:.0%}" if comm > 0 else "none to hide"
            print(f"  exposed communication: {exposed * 1e3:.3f} ms of {comm * 1e3:.3f} ms "
                  f"({hidden_share}); {ratio}")
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    run_tool(main)
