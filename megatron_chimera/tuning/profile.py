"""Measured costs for the performance model (``tools/autotune.py --profile / --measure-p2p``).

:class:`MeasuredCompute` times the real model classes on this machine, per micro-batch size:
one transformer layer (a middle stage of one layer), the extra cost of the first stage
(embeddings) and of the last stage (final norm, LM head and loss), each forward and backward;
a stage of ``n`` layers costs ``n`` layers plus its extras. It also times an Adam step per
parameter, which the model adds after the last gradient all-reduce. :func:`measure_p2p_link`
runs a gloo ping-pong between two local processes at two message sizes and fits alpha and beta.
:func:`time_partition` is ``--partition-method time``: the same layer timings, agreed on by every
rank, balance the stages of a training run.
"""

from __future__ import annotations

import os
import socket
import statistics
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron_chimera.config import TrainConfig
from megatron_chimera.model.family import GPT2, ModelFamily
from megatron_chimera.model.partition import partition_layers
from megatron_chimera.schedules.actions import Schedule
from megatron_chimera.tuning.analytic_costs import ModelSpec, StagePiece, stage_forward_flops
from megatron_chimera.tuning.hardware import LinkProfile
from megatron_chimera.tuning.perf_model import StageTimes

Step = Callable[[], torch.Tensor]


class MeasuredCompute:
    """Stage times from timings of the real GPT-2 / BERT classes (cached per micro-batch size)."""

    def __init__(self, spec: ModelSpec, device: str | None = None, warmup: int = 1,
                 iters: int = 3) -> None:
        self.spec = spec
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.warmup, self.iters = warmup, iters
        self._cache: dict[int, tuple[StageTimes, StageTimes, StageTimes]] = {}
        self._adam_s_per_param: float | None = None

    # ------------------------------------------------------------------ measurement
    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _time(self, build: Callable[[], tuple[torch.nn.Module, Step]]) -> StageTimes:
        """Median forward and backward seconds of ``step`` (returns a scalar to backward)."""
        module, step = build()
        forwards, backwards = [], []
        for i in range(self.warmup + self.iters):
            module.zero_grad(set_to_none=True)
            self._sync()
            start = time.perf_counter()
            loss = step()
            self._sync()
            middle = time.perf_counter()
            loss.backward()
            self._sync()
            end = time.perf_counter()
            if i >= self.warmup:
                forwards.append(middle - start)
                backwards.append(end - middle)
        return StageTimes(statistics.median(forwards), statistics.median(backwards), 0.0)

    def _builder(self, micro_batch: int, pre: bool, post: bool):
        cfg, device = self.spec.config, self.device
        s, h = cfg.seq_length, cfg.hidden_size
        layers = (0, 1) if not post else (cfg.num_layers - 1, cfg.num_layers)
        generator = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, cfg.vocab_size, (micro_batch, s), generator=generator)
        tokens = tokens.to(device)
        hidden = torch.randn(s, micro_batch, h, generator=generator).to(device, cfg.torch_dtype)

        def build() -> tuple[torch.nn.Module, Step]:
            if self.spec.family is GPT2:
                from megatron_chimera.model.gpt2 import GPTModel

                model = GPTModel(cfg, pre_process=pre, post_process=post, layer_range=layers)
            else:
                from megatron_chimera.model.bert import BertModel

                model = BertModel(cfg, pre_process=pre, post_process=post, layer_range=layers)
            model.to(device)
            positions = torch.arange(s, device=device).expand(micro_batch, s)
            padding = torch.ones(micro_batch, s, device=device)

            def step() -> torch.Tensor:
                if not pre:
                    model.set_input_tensor(hidden.detach().requires_grad_())
                ids = tokens if pre else None
                if self.spec.family is GPT2:
                    out = model(ids, positions if pre else None,
                                labels=tokens if post else None)
                else:
                    types = torch.zeros_like(tokens) if pre and model.num_tokentypes else None
                    out = model(ids, padding, types, lm_labels=tokens if post else None)
                    if post:
                        loss, sop = out
                        return loss.float().sum() + (sop.float().sum() if sop is not None else 0)
                return out.float().sum()

            return model, step

        return build

    def measure(self, micro_batch: int) -> tuple[StageTimes, StageTimes, StageTimes]:
        """(one layer, first-stage extra, last-stage extra) for ``micro_batch``."""
        if micro_batch not in self._cache:
            layer = self._time(self._builder(micro_batch, pre=False, post=False))
            first = self._time(self._builder(micro_batch, pre=True, post=False))
            last = self._time(self._builder(micro_batch, pre=False, post=True))

            def extra(t: StageTimes) -> StageTimes:
                return StageTimes(max(t.forward - layer.forward, 0.0),
                                  max(t.backward - layer.backward, 0.0), 0.0)

            self._cache[micro_batch] = (layer, extra(first), extra(last))
        return self._cache[micro_batch]

    def optimizer_step_s(self, num_params: int) -> float:
        """Seconds of one Adam step over ``num_params`` parameters (measured once on 2^20
        parameters in the model dtype, with fp32 main copies for 16-bit, scaled linearly)."""
        if self._adam_s_per_param is None:
            size = 1 << 20
            dtype = self.spec.config.torch_dtype
            model = torch.zeros(size, dtype=dtype, device=self.device, requires_grad=True)
            main = torch.zeros(size, dtype=torch.float32, device=self.device, requires_grad=True)
            optimizer = torch.optim.AdamW([main], lr=1e-4)
            model.grad = torch.ones_like(model)
            times = []
            for i in range(self.warmup + self.iters):
                self._sync()
                start = time.perf_counter()
                if dtype != torch.float32:
                    main.grad = model.grad.float()
                else:
                    main.grad = model.grad
                optimizer.step()
                if dtype != torch.float32:
                    model.data.copy_(main.data)
                self._sync()
                if i >= self.warmup:
                    times.append(time.perf_counter() - start)
            self._adam_s_per_param = statistics.median(times) / size
        return num_params * self._adam_s_per_param

    # ------------------------------------------------------------------ ComputeCosts
    def stage_times(self, piece: StagePiece, micro_batch: int, recompute: bool) -> StageTimes:
        """Measured times of the stage ``piece``; recomputation adds its forward to the backward,
        the weight-gradient share of the backward is its share of the FLOPs."""
        layer, first, last = self.measure(micro_batch)
        forward = piece.num_layers * layer.forward
        backward = piece.num_layers * layer.backward
        if piece.pre_process:
            forward, backward = forward + first.forward, backward + first.backward
        if piece.post_process:
            forward, backward = forward + last.forward, backward + last.backward
        weights, other = stage_forward_flops(self.spec, piece, micro_batch)
        weight = backward * weights / (2 * (weights + other)) if weights + other else 0.0
        if recompute:
            backward += forward
        return StageTimes(forward, backward, weight)


# ---------------------------------------------------------------------------- ping-pong
def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _ping_pong(rank: int, port: int, sizes: list[int], rounds: int, queue) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=60))
    try:
        results = []
        for size in sizes:
            buffer = torch.zeros(size // 4, dtype=torch.float32)
            times = []
            for i in range(rounds + 2):
                start = time.perf_counter()
                if rank == 0:
                    dist.send(buffer, 1)
                    dist.recv(buffer, 1)
                else:
                    dist.recv(buffer, 0)
                    dist.send(buffer, 0)
                if i >= 2:
                    times.append((time.perf_counter() - start) / 2)
            results.append(statistics.median(times))
        if rank == 0:
            queue.put(results)
    finally:
        dist.destroy_process_group()


def measure_p2p_link(small: int = 4096, large: int = 4 << 20, rounds: int = 20,
                     timeout_s: float = 120.0) -> LinkProfile:
    """alpha and bandwidth of a local gloo ping-pong (two processes), fitted at two sizes."""
    import torch.multiprocessing as mp

    context = mp.get_context("spawn")
    queue = context.Queue()
    port = _free_port()
    procs = [context.Process(target=_ping_pong, args=(r, port, [small, large], rounds, queue))
             for r in range(2)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            try:
                t_small, t_large = queue.get(timeout=1.0)
                break
            except Exception:  # queue.Empty: check that both ranks are still alive
                failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if failed or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"--measure-p2p: ping-pong failed (exit codes {failed}) or timed out"
                    ) from None
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
    beta = max((t_large - t_small) / (large - small), 1e-15)
    alpha = max(t_small - small * beta, 0.0)
    return LinkProfile(alpha_s=alpha, bandwidth_gbps=1.0 / beta / 1e9)


def time_partition(config: TrainConfig, family: ModelFamily, schedule: Schedule,
                   device: torch.device, verbose: bool) -> list[tuple[int, int]]:
    """``--partition-method time``: time one transformer layer and the extra cost of the first
    (embeddings) and last stage (final norm, LM head, loss) with the real classes on this rank's
    device, average over all ranks (one all-reduce, so every rank splits alike), and balance the
    ranks' total time over the stages each holds (both replicas for Chimera)."""
    compute = MeasuredCompute(ModelSpec(config.model, family), device=str(device))
    layer, first, last = compute.measure(config.training.micro_batch_size)
    recompute = config.model.recompute_granularity == "full"  # the backward re-runs the forward
    seconds = [t.forward * (2 if recompute else 1) + t.backward for t in (layer, first, last)]
    times = torch.tensor(seconds, dtype=torch.float64, device=device)
    dist.all_reduce(times)
    unit = float(times[0]) / dist.get_world_size()
    layer_s, first_s, last_s = (round(float(t) / dist.get_world_size() / unit, 3)
                                for t in times)
    rank_stages = [schedule.stages_of_rank(r) for r in range(schedule.num_ranks)]
    partition = partition_layers(config.model.num_layers, schedule.num_stages, "time",
                                 layer_times=[layer_s] * config.model.num_layers,
                                 embedding_time=first_s, head_time=last_s,
                                 rank_stages=rank_stages)
    if verbose:
        print(f" --partition-method time: layer {unit * 1e3:.3g} ms (forward + backward per "
              f"micro-batch), first stage +{first_s:.3g} layers, last stage +{last_s:.3g} "
              f"layers -> layers per stage {[end - start for start, end in partition]}",
              flush=True)
    return partition
