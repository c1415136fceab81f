"""CPPO (cppo.py; docs/cppo.md) as a plug-in for TRL's GRPOTrainer: pruning by |A| after the
advantages, before the old-policy and reference passes.

Tested with TRL 1.16.0, accelerate 1.15.0, transformers 5.24.0 (tests/test_scale_out.py).

The method's pieces come from cppo.py, imported: kept_per_question (k = G(1 - P)), prune_batch (the
int(N P) smallest |A| of the batch dropped: the official code, the default) and prune_per_question
(each group's top k: the paper). Advantages are TRL-scaled grpo.py ones on the full groups, not
renormalised after pruning; the coefficients are token_coefficients over the kept rows
(docs/cppo.md#eq-loss). TRL would run its old-policy and reference passes over every completion
before the rewards; here they run on the kept ones only, which is the saving.

Allocation (docs/cppo.md#eq-allocation) is a setting: TRL's per_device_train_batch_size counts
generated completions, so per_device_train_batch_size x processes x steps_per_generation = Q G with
Q = B / (1 - P) questions leaves B G kept rows per step. cppo.py's defaults: num_generations=16,
pruning 0.875, beta=0.04, num_iterations=2 (mu), loss_type="dapo" (token_mean),
lr_scheduler_type="cosine_with_min_lr" with lr_scheduler_kwargs={"min_lr_rate": 0.1} (to 10%)
and warmup_steps=0.1 (a tenth of the steps).

What differs from cppo.py, beyond what trl_grpo.py lists for every plug-in:
  * the batch scope prunes over the generation batch of all processes (verl's port does the same);
    the official open-r1 code prunes per device;
  * each process trains the kept rows it generated: processes can hold different numbers of them,
    and the update waits for the one with most.
"""
from scale_out.trl_grpo import GRPOPlugin
from common import group_advantages, token_coefficients
from cppo import kept_per_question, prune_batch, prune_per_question


class CPPOTrainer(GRPOPlugin):
    """GRPOTrainer for CPPO: `pruning` and `prune_scope` as cppo.py's --pruning, --prune_scope."""

    def __init__(self, *args, pruning=0.875, prune_scope="batch", **kwargs):
        super().__init__(*args, **kwargs)
        if prune_scope not in ("batch", "question"):
            raise ValueError(f"prune_scope={prune_scope!r}: 'batch' or 'question'")
        self.k = kept_per_question(self.num_generations, pruning)  # a ValueError names a bad P
        self.pruning = pruning
        self.prune_scope = prune_scope

    def select(self, rewards, samples):
        """Advantages on the full groups, then the largest |A| kept; c_i over the kept rows."""
        advantages = group_advantages(rewards, self.std_mode, self.adv_eps)  # [Q, G]
        if self.prune_scope == "batch":
            kept = prune_batch(advantages, self.pruning)  # docs/cppo.md#eq-prune-batch
        else:
            kept = prune_per_question(advantages, self.k)  # docs/cppo.md#eq-prune-question
        lengths = [len(samples[i].completion_ids) for i in kept]
        coefs = token_coefficients(lengths, self.loss_agg, max_len=self.max_completion_length)
        return {"advantages": advantages, "kept": kept, "coefs": coefs}
