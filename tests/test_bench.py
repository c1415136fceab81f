"""bench.py compares equal work (its padded update has the packed update's gradient) and runs end to end."""
import os
import subprocess
import sys

import torch

from bench import make_samples, padded_update
from common import policy_update, token_coefficients
from conftest import assert_grads_close
from test_packing import RecordingOptimizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_padded_update_has_the_packed_gradient(tiny):
    model, tokenizer = tiny
    samples = make_samples(12, "toy", len(tokenizer), seed=1)
    coefs = token_coefficients([len(s.completion_ids) for s in samples], "seq_mean")
    kw = dict(temperature=1.0, vocab_size=len(tokenizer), eps_low=0.2, eps_high=0.2, beta=0.0, grad_clip=1e9)
    grads = []
    for fn, budget in ((policy_update, 128), (padded_update, 100)):
        opt = RecordingOptimizer(model)
        fn(model, opt, samples, coefs, token_budget=budget, **kw)
        grads.append(opt.grads)
    assert_grads_close(grads[1], grads[0])


def test_bench_runs_on_the_toy_shape():
    result = subprocess.run([sys.executable, os.path.join(REPO, "bench.py"), "--shape", "toy", "--sequences", "16",
                             "--budgets", "128", "--repeats", "1"], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert result.returncode == 0, result.stderr[-2000:]
    table = [line for line in result.stdout.splitlines() if line.startswith("| packed") or line.startswith("| padded")]
    assert len(table) == 2 and "x |" in table[1]
