"""Every memory term of one training step, per rank, in bytes.

Owns the ZeRO model states (`states`: params, grads, optimizer, on the device and offloaded;
`zero3`: ZeRO-3's sub-groups and gathered parameters), what each training method adds
(`method_terms`: the DPO reference, a reward head, the sequences a step runs), what autograd
saves (`activation_memory`: the formulas, over `micro_step`, the shapes of one micro step, and
`padding_mask`, what a padded forward adds), the logits and the loss's share (`logits`,
`held_logits`), what the trainer holds beyond autograd (`trainer_terms`), offloaded activation
checkpoints (`offload_activations`), the phases of a step and which holds the peak (`phases`)
and what it consists of (`breakdown`), the memory no tensor holds: CUDA context, cuBLAS, NCCL,
the allocator's fragmentation and host RAM per node (`overheads`), and the reserved-memory term:
what the caching allocator keeps beyond the allocated peak (`allocator`). May import models/,
the estimator's vocabulary (`memfit.estimate.settings`, `memfit.estimate.errors`), the top-level
vocabulary and the loss math it prices (`memfit.train.vocab_loss`); never trace/, time/ or the
modules above.
"""
