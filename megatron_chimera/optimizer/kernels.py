"""The optimizer's fused kernels: NVIDIA Apex when its CUDA extensions are importable, torch-native
otherwise (the backend is chosen once by :func:`megatron_chimera.model.fused.get_fused_backend`).

* Adam step: Apex ``FusedAdam(adam_w_mode=True)``, else ``torch.optim.AdamW`` with
  ``fused=True`` on CUDA and ``foreach=True`` on the CPU.
* grad norm and fp16/bf16 -> fp32 grad copies: Apex ``amp_C.multi_tensor_l2norm`` /
  ``multi_tensor_scale``, else ``torch._foreach_norm`` / ``torch._foreach_copy_``.
"""

from __future__ import annotations

import importlib

import torch

from megatron_chimera.model.fused import FusedBackend


def multi_tensor_l2norm(tensors: list[torch.Tensor], backend: FusedBackend) -> torch.Tensor:
    """fp32 L2 norm over all ``tensors`` together (a 0-dim tensor on their device)."""
    if not tensors:
        return torch.zeros((), dtype=torch.float32)
    if backend.apex:
        amp_c = importlib.import_module("amp_C")
        applier = importlib.import_module("apex.multi_tensor_apply").multi_tensor_applier
        flag = torch.zeros(1, dtype=torch.int, device=tensors[0].device)
        norm, _ = applier(amp_c.multi_tensor_l2norm, flag, [tensors], False)
        return norm.reshape(()).float()
    norms = torch._foreach_norm(tensors, 2, dtype=torch.float32)
    return torch.linalg.vector_norm(torch.stack(norms))


def multi_tensor_scale_(sources: list[torch.Tensor], targets: list[torch.Tensor], scale: float,
                        backend: FusedBackend) -> None:
    """``targets[i] = sources[i] * scale`` in place (dtype conversion included)."""
    if not sources:
        return
    if backend.apex:
        amp_c = importlib.import_module("amp_C")
        applier = importlib.import_module("apex.multi_tensor_apply").multi_tensor_applier
        flag = torch.zeros(1, dtype=torch.int, device=sources[0].device)
        applier(amp_c.multi_tensor_scale, flag, [sources, targets], scale)
        return
    torch._foreach_copy_(targets, sources)
    if scale != 1.0:
        torch._foreach_mul_(targets, scale)


def build_adam(param_groups: list[dict], lr: float, betas: tuple[float, float], eps: float,
               weight_decay: float, backend: FusedBackend) -> torch.optim.Optimizer:
    """AdamW (decoupled weight decay, as Megatron's Adam): Apex FusedAdam or torch's own."""
    if backend.apex:
        fused_adam = importlib.import_module("apex.optimizers").FusedAdam
        return fused_adam(param_groups, lr=lr, betas=betas, eps=eps,
                          weight_decay=weight_decay, adam_w_mode=True)
    on_cuda = any(p.is_cuda for g in param_groups for p in g["params"])
    kind = {"fused": True} if on_cuda else {"foreach": True}
    return torch.optim.AdamW(param_groups, lr=lr, betas=betas, eps=eps,
                             weight_decay=weight_decay, **kind)
