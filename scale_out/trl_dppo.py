"""DPPO (dppo.py; docs/dppo.md, a reconstruction from the paper's abstract) as a plug-in for TRL's
GRPOTrainer: prompt pruning before the rollout, completion pruning after the advantages, and the
1/pi weights over the unpruned normalisers (docs/dppo.md#eq-estimator).

Tested with TRL 1.16.0, accelerate 1.15.0, transformers 5.24.0 (tests/test_scale_out.py).

The method's pieces come from dppo.py, imported: candidate_window (each prompt's pi_q from its
tie history), systematic_sample (the fixed-size draws, docs/dppo.md#eq-draw), update_history,
completion_keep_probs (pi_i ~ |A|) and importance_coefficients (c_i = w_i / the unpruned
examined batch's normaliser, w = 1 / (pi_q pi_i)). The two draws take u from
numpy.random.default_rng([seed, step]) in dppo.py's order, so every process draws the same masks.

One step: TRL's sampler hands the generation batch (its prompts, G copies each); every process
gathers the whole window, gives each prompt pi_q from the history and draws the kept prompts; the
kept prompts are shared out over the processes, and only they are rolled out (the rollout saving);
on the gathered rewards come the full-group advantages, the history update, the completion draw
and the coefficients; the old-policy and reference passes and the update see the kept completions.

What differs from dppo.py, beyond what trl_grpo.py lists for every plug-in:
  * no refill (docs/dppo.md#eq-refill): the examined set S is TRL's window of prompts, fixed
    before any draw as the estimator needs, so N = |S| is the window and the rollout holds about
    sum pi_q of its prompts, fewer than the window when prompts are pruned (dppo.py refills to B);
    --lookahead has no counterpart;
  * the kept prompts are shared out evenly: when their number is not a multiple of the processes,
    the last processes roll out copies of a kept prompt, scored (TRL's logged reward counts them)
    but never trained;
  * no window packer (--window): TRL pads, without packing;
  * the history lives in the trainer (`history`), not in the checkpoint: a resumed run starts with
    an empty table, which prunes fewer prompts and biases nothing (docs/dppo.md#eq-prompt-keep);
  * the history needs each prompt's dataset row: the trainer adds a column `dppo_row` (0, 1, ...)
    to train_dataset; reward functions receive it as a keyword, as any column.
"""
import numpy as np
from accelerate.utils import gather_object

from scale_out.trl_grpo import GRPOPlugin
from common import group_advantages
from dppo import (candidate_window, completion_keep_probs, importance_coefficients,
                  systematic_sample, update_history)

ROW = "dppo_row"  # the dataset row of a prompt: the history's key


class DPPOTrainer(GRPOPlugin):
    """GRPOTrainer for DPPO: `prune_prompts` (r_q), `prune_completions` (r_o) and `keep_floor` as
    dppo.py's flags."""

    def __init__(self, *args, train_dataset=None, prune_prompts=0.5, prune_completions=0.5,
                 keep_floor=0.1, **kwargs):
        if not (0 <= prune_prompts < 1 and 0 <= prune_completions < 1 and 0 < keep_floor <= 1):
            raise ValueError("prune_prompts and prune_completions must be in [0, 1), keep_floor in "
                             f"(0, 1] (got {prune_prompts}, {prune_completions}, {keep_floor})")
        if train_dataset is not None and ROW not in train_dataset.column_names:
            train_dataset = train_dataset.add_column(ROW, list(range(len(train_dataset))))
        super().__init__(*args, train_dataset=train_dataset, **kwargs)
        self.prune_prompts = prune_prompts
        self.prune_completions = prune_completions
        self.keep_floor = keep_floor
        self.history = {}  # dataset row -> did its last group tie? docs/dppo.md#eq-prompt-keep
        self.draw = None  # this step's prompt draw, read by `select`

    def _generate_and_score_completions(self, inputs):
        if not self.model.training:  # evaluation: TRL's own batch and loss
            return super()._generate_and_score_completions(inputs)
        G = self.num_generations
        window = gather_object(inputs)[::G]  # S: every process's prompts, in the sampler's order
        rows = [x[ROW] for x in window]
        _, prompt_pi = candidate_window(rows, self.history, len(rows), self.prune_prompts,
                                        self.keep_floor, len(rows))  # no refill: S is the window
        rng = np.random.default_rng([self.args.seed, self.state.global_step])
        kept = systematic_sample(prompt_pi, rng.random())  # docs/dppo.md#eq-draw
        self.draw = {"rng": rng, "examined": len(rows), "rows": [rows[k] for k in kept],
                     "prompt_pi": [prompt_pi[k] for k in kept]}
        processes = self.accelerator.num_processes
        share = max(1, -(-len(kept) // processes))  # kept prompts per process, rounded up
        slots = kept + [kept[0] if kept else 0] * (share * processes - len(kept))  # copies last
        mine = slots[self.accelerator.process_index * share:][:share]
        self._metrics["train"]["prompt_keep_frac"].append(len(kept) / len(rows))
        return super()._generate_and_score_completions([window[k] for k in mine for _ in range(G)])

    def select(self, rewards, samples):
        """Full-group advantages of the kept prompts, the completion draw, c_i = w_i / the
        examined batch's normaliser."""
        G = self.num_generations
        n = len(self.draw["rows"])  # the kept prompts' groups come first, the copies after
        advantages = group_advantages(rewards[:n], self.std_mode, self.adv_eps)  # [n, G]
        update_history(self.history, self.draw["rows"], rewards[:n])
        completion_pi = completion_keep_probs(advantages, self.prune_completions,
                                              self.keep_floor).tolist()
        kept = systematic_sample(completion_pi, self.draw["rng"].random())
        lengths = [len(s.completion_ids) for s in samples[:n * G]]
        coefs, weights = importance_coefficients(lengths, self.draw["prompt_pi"], completion_pi,
                                                 kept, self.draw["examined"], self.loss_agg,
                                                 self.max_completion_length)
        self._metrics["train"]["weight_mean"].append(sum(weights) / max(1, len(weights)))
        return {"advantages": advantages, "kept": kept, "coefs": coefs, "weights": weights,
                "prompt_pi": self.draw["prompt_pi"], "completion_pi": completion_pi,
                "examined": self.draw["examined"]}
