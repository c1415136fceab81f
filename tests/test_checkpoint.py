"""Checkpoints survive a kill at any point of the save, and a metrics line cut short by a kill is dropped on resume."""
import json
import os

import pytest
import torch

from common import make_optimizer
from common import load_checkpoint, open_metrics, recover_checkpoint, save_checkpoint


def test_save_load_and_recover_after_a_kill_between_renames(tiny, tmp_path):
    model, tokenizer = tiny
    out = str(tmp_path)
    optimizer, scheduler = make_optimizer(model, 1e-3, 0.0, 0, 10, "constant")
    save_checkpoint(out, model, tokenizer, optimizer, scheduler, step=3, cursor=24)
    save_checkpoint(out, model, tokenizer, optimizer, scheduler, step=4, cursor=32)
    assert sorted(os.listdir(out)) == ["checkpoint"]
    # a kill after "checkpoint -> checkpoint.old" and before "checkpoint.tmp -> checkpoint": both copies complete
    os.rename(os.path.join(out, "checkpoint"), os.path.join(out, "checkpoint.tmp"))
    recover_checkpoint(out)
    state = load_checkpoint(out, optimizer, scheduler)
    assert (state["step"], state["cursor"]) == (4, 32)
    # a kill while writing checkpoint.tmp (no state.pt yet): the old one is used
    os.rename(os.path.join(out, "checkpoint"), os.path.join(out, "checkpoint.old"))
    os.makedirs(os.path.join(out, "checkpoint.tmp", "model"))
    recover_checkpoint(out)
    assert load_checkpoint(out, optimizer, scheduler)["step"] == 4
    assert torch.get_rng_state().equal(torch.load(os.path.join(out, "checkpoint", "state.pt"),
                                                  weights_only=True)["rng"]["torch"])


def test_rng_states_round_trip_through_the_weights_only_loader(tiny, tmp_path):
    """Python's, numpy's and torch's generators continue exactly where the checkpoint left them."""
    import random
    import numpy as np
    model, tokenizer = tiny
    optimizer, scheduler = make_optimizer(model, 1e-3, 0.0, 0, 10, "constant")
    random.seed(5)
    np.random.seed(6)
    torch.manual_seed(7)
    save_checkpoint(str(tmp_path), model, tokenizer, optimizer, scheduler, step=1, cursor=8)
    want = (random.random(), np.random.rand(), torch.rand(1).item())
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    load_checkpoint(str(tmp_path), optimizer, scheduler)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == want


def test_resume_drops_rows_after_the_checkpoint_and_a_cut_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s}) + "\n" for s in range(6)) + '{"step": 6, "loss"')
    f = open_metrics(str(tmp_path), resume_step=4)
    f.write(json.dumps({"step": 5}) + "\n")
    f.close()
    assert [json.loads(line)["step"] for line in open(path)] == [0, 1, 2, 3, 4, 5]


def test_a_checkpoint_written_on_a_gpu_resumes_on_this_device(tiny, tmp_path, monkeypatch):
    """--resume of a GPU run on a CPU-only machine: state.pt's tensors say 'cuda:0' (written here by making torch.save
    tag every storage so, as a GPU run's are), and must load onto the model's device with the optimiser state on it."""
    model, tokenizer = tiny
    optimizer, scheduler = make_optimizer(model, 1e-3, 0.0, 0, 10, "constant")
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()  # AdamW state: exp_avg, exp_avg_sq per parameter
    optimizer.zero_grad()
    want = {k: v.clone() for k, v in optimizer.state[next(model.parameters())].items()}
    with monkeypatch.context() as m:
        m.setattr(torch.serialization, "location_tag", lambda storage: "cuda:0")
        save_checkpoint(str(tmp_path), model, tokenizer, optimizer, scheduler, step=2, cursor=16)
    if not torch.cuda.is_available():  # the file really claims a GPU: a plain load fails here
        with pytest.raises(RuntimeError, match="CUDA"):
            torch.load(tmp_path / "checkpoint" / "state.pt", weights_only=True)
    optimizer, scheduler = make_optimizer(model, 1e-3, 0.0, 0, 10, "constant")
    state = load_checkpoint(str(tmp_path), optimizer, scheduler)
    assert (state["step"], state["cursor"]) == (2, 16)
    got = optimizer.state[next(model.parameters())]
    device = next(model.parameters()).device
    assert got.keys() == want.keys() and all(got[k].device == device for k in ("exp_avg", "exp_avg_sq"))
    assert all(torch.equal(got[k].cpu(), want[k].cpu()) for k in want)
