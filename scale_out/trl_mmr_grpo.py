"""MMR-GRPO (mmr_grpo.py; docs/mmr_grpo.md) as a plug-in for TRL's GRPOTrainer: each whole group's
rewards reweighted by MMR over completion embeddings, after TRL gathers them, before the advantages.

Tested with TRL 1.16.0, accelerate 1.15.0, transformers 5.24.0, sentence-transformers 6.2.0
(tests/test_scale_out.py).

The method's pieces come from mmr_grpo.py, imported: load_encoder, embed (the decoded completions,
no prompt) and mmr_reweight (docs/mmr_grpo.md#eq-mmr), then common.group_advantages on the
reweighted rewards (docs/mmr_grpo.md#eq-advantage). A reward function sees only its process's
slice, and a group may straddle two processes, so the reweighting sits here, on the gathered
batch: each process embeds its own completions and the embeddings are gathered, so every process
reweights the same numbers (none computed twice, none differing across devices).

mmr_grpo.py's defaults are grpo.py's: beta=0.04, loss_type="grpo" (seq_mean), scale_rewards
"group". Pass the encoder as mmr_grpo.py's --embed_model: a sentence-transformers folder or hub
id, or a model folder (mean-pooled).

What differs from mmr_grpo.py, beyond what trl_grpo.py lists for every plug-in:
  * TRL logs its reward metrics from the raw rewards, as mmr_grpo.py does; its completions table
    (log_completions) shows TRL's own advantages of the raw rewards, not these.
"""
import torch

from scale_out.trl_grpo import GRPOPlugin
from common import group_advantages, token_coefficients
from mmr_grpo import embed, load_encoder, mmr_reweight


class MMRGRPOTrainer(GRPOPlugin):
    """GRPOTrainer for MMR-GRPO: `embed_model` and `sim_floor` as mmr_grpo.py's flags."""

    def __init__(self, *args, embed_model, sim_floor=True, trust_remote_code=False, **kwargs):
        super().__init__(*args, **kwargs)
        self.encoder = load_encoder(embed_model, self.accelerator.device, trust_remote_code)
        self.sim_floor = sim_floor

    def select(self, rewards, samples):
        """Rewards [Q, G] reweighted per group by MMR, advantages on them; every completion kept."""
        n_local = len(samples) // self.accelerator.num_processes
        start = self.accelerator.process_index * n_local
        mine = [s.completion_ids for s in samples[start:start + n_local]]
        texts = self._tokenizer.batch_decode(mine, skip_special_tokens=True)
        embeddings = embed(self.encoder, texts).to(self.accelerator.device)  # [n_local, d]
        embeddings = self.accelerator.gather(embeddings).cpu()  # [Q G, d], the rewards' order
        reweighted, lam, _ = mmr_reweight(rewards, embeddings, self.sim_floor)  # [Q, G], [Q]
        advantages = group_advantages(reweighted, self.std_mode, self.adv_eps)  # [Q, G]
        lengths = [len(s.completion_ids) for s in samples]
        coefs = token_coefficients(lengths, self.loss_agg, max_len=self.max_completion_length)
        self._metrics["train"]["mmr_lambda"].append(lam.mean().item())
        return {"advantages": advantages, "kept": list(range(len(samples))), "coefs": coefs,
                "reweighted": reweighted.to(torch.float32)}
