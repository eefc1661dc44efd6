"""Mixture of experts (Megatron-core's MoE layer): ``router`` (top-k routing, load-balancing and
z losses, token dropping), ``aux_loss`` (the auxiliary losses' gradient injection and logging),
``experts`` (the local experts, grouped or looped GEMMs), ``token_dispatcher`` (tokens to their
experts and back: all-to-all or all-gather over the expert-parallel group), ``layer`` (the MoE
layer that replaces a transformer layer's MLP)."""
