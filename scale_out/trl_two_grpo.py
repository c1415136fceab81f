"""2-GRPO (two_grpo.py; docs/two_grpo.md) as a plug-in for TRL's GRPOTrainer: exactly +-1
advantages, and tied pairs dropped before the passes that cost.

Tested with TRL 1.16.0, accelerate 1.15.0, transformers 5.24.0 (tests/test_scale_out.py).

The method's pieces come from two_grpo.py and common.py, imported: the advantages are
group_advantages(rewards, "population", 0.0) (docs/two_grpo.md#eq-pair-advantage; TRL's own
scale_rewards="group" gives +-1/sqrt(2)), and rows_to_train drops the zero-advantage rows with the
normaliser still counting all of them (docs/two_grpo.md#skip-tied), so the old-policy and reference
passes and the backward pass see the mixed pairs only.

Set num_generations=2 (G), per_device_train_batch_size x processes x steps_per_generation = 2 B
(the paper's B = 256 pairs), epsilon_high=0.28, beta=0.0 (the default), loss_type="grpo" (the
paper's Eq. 14, seq_mean), learning_rate and warmup_steps=10 as two_grpo.py's recipe.

What differs from two_grpo.py, beyond what trl_grpo.py lists for every plug-in:
  * --resample (2-GRPO+RS) is not here: TRL's sampler hands a fixed number of prompts per step;
  * --std_mode and --adv_eps are fixed at the method's population and 0 (scale_rewards is not read);
  * skip_tied applies with beta = 0 only, as in two_grpo.py.
"""
from scale_out.trl_grpo import GRPOPlugin
from common import group_advantages
from two_grpo import rows_to_train


class TwoGRPOTrainer(GRPOPlugin):
    """GRPOTrainer for 2-GRPO: `skip_tied` as two_grpo.py's --skip_tied."""

    def __init__(self, *args, skip_tied=True, **kwargs):
        super().__init__(*args, **kwargs)
        self.skip_tied = skip_tied

    def select(self, rewards, samples):
        """+-1 per mixed pair, 0 / 0 per tied pair; the rows to train and their c_i over all 2 B."""
        advantages = group_advantages(rewards, "population", 0.0)  # [B, 2]
        for s, a in zip(samples, advantages.flatten().tolist()):
            s.advantage = a
        kept, coefs = rows_to_train(samples, self.loss_agg, self.max_completion_length,
                                    len(samples), self.skip_tied and self.beta == 0)
        return {"advantages": advantages, "kept": kept, "coefs": coefs}
