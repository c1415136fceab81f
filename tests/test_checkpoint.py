"""Checkpoints: out/checkpoint-<step>/ (model/ and then state.pt), the two newest kept, a save cut
short ignored, state.pt read weights_only (also when a GPU run wrote it), and a metrics line cut
short by a kill dropped on resume."""
import json
import os
import shutil

import pytest
import torch

from conftest import snapshot

from common import (checkpoints, load_optimizer_state, make_optimizer, open_metrics,
                    read_checkpoint, save_checkpoint)


def listing(out):
    return sorted(os.listdir(out), key=lambda name: int(name.rsplit("-", 1)[1]))


def test_the_two_newest_checkpoints_are_kept_in_step_order(tiny, tmp_path):
    model, tokenizer = tiny
    out = str(tmp_path)
    optimizer, scheduler = make_optimizer(model, 1e-3, 0.0, 0, 10, "constant")
    for step in (4, 9, 10):  # 10 after 9: the steps are compared as numbers, not as text
        save_checkpoint(out, model, tokenizer, optimizer, scheduler, step=step, cursor=8 * step,
                        extra={"kept": [step]})
    assert listing(out) == ["checkpoint-9", "checkpoint-10"]
    assert checkpoints(out) == [os.path.join(out, "checkpoint-9"),
                                os.path.join(out, "checkpoint-10")]
    newest = checkpoints(out)[-1]
    assert sorted(os.listdir(newest)) == ["model", "state.pt"]
    assert os.path.exists(os.path.join(newest, "model", "model.safetensors"))
    assert os.path.exists(os.path.join(newest, "model", "tokenizer_config.json"))
    state = read_checkpoint(newest)
    assert (state["step"], state["cursor"], state["kept"]) == (10, 80, [10])
    assert set(state) == {"step", "cursor", "optimizer", "scheduler", "kept"}  # no RNG states


def test_a_save_cut_short_is_ignored_and_then_removed(tiny, tmp_path):
    """A kill while model/ is written leaves a checkpoint folder without state.pt: checkpoints()
    does not list it (a resume takes the newest complete one), and the next save removes it (or
    redoes it, for the same step)."""
    model, tokenizer = tiny
    out = str(tmp_path)
    optimizer, scheduler = make_optimizer(model, 1e-3, 0.0, 0, 10, "constant")
    save_checkpoint(out, model, tokenizer, optimizer, scheduler, step=2, cursor=16)
    for step in (4, 9):  # a save of step 4 cut short, and a stray one of a later step
        os.makedirs(os.path.join(out, f"checkpoint-{step}", "model"))
        open(os.path.join(out, f"checkpoint-{step}", "model", "model.safetensors"),
             "wb").write(b"half")
    assert checkpoints(out) == [os.path.join(out, "checkpoint-2")]
    assert checkpoints(str(tmp_path / "nothing")) == []
    save_checkpoint(out, model, tokenizer, optimizer, scheduler, step=4, cursor=32)
    assert listing(out) == ["checkpoint-2", "checkpoint-4"]
    assert read_checkpoint(os.path.join(out, "checkpoint-4"))["cursor"] == 32


@pytest.mark.parametrize("damage", ["truncated", "a pickle payload"])
def test_a_damaged_state_file_is_one_line_and_runs_nothing(tiny, tmp_path, capsys, damage):
    """read_checkpoint loads state.pt with weights_only: a damaged one, or one whose pickle would
    run code, is one line and exit 2 (the payload never runs). Damaged weights are setup()'s to
    refuse (tests/test_cli.py)."""
    model, tokenizer = tiny
    out = str(tmp_path / "run")
    optimizer, scheduler = make_optimizer(model, 1e-3, 0.0, 0, 10, "constant")
    save_checkpoint(out, model, tokenizer, optimizer, scheduler, step=1, cursor=8)
    folder = checkpoints(out)[-1]
    state_path = os.path.join(folder, "state.pt")
    if damage == "truncated":
        data = open(state_path, "rb").read()
        open(state_path, "wb").write(data[:len(data) // 2])
    else:
        class Payload:
            def __reduce__(self):
                return (os.system, (f"touch {tmp_path / 'pwned'}",))
        torch.save({**read_checkpoint(folder), "extra": Payload()}, state_path)
    capsys.readouterr()  # what the save printed (transformers' progress bar)
    with pytest.raises(SystemExit) as e:
        read_checkpoint(folder)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1, err
    assert err[0].startswith(f"error: --resume: {folder} is damaged or is not a checkpoint "
                             "this code wrote"), err
    assert not (tmp_path / "pwned").exists()


@pytest.mark.parametrize("missing", ["step", "cursor", "optimizer", "scheduler"])
def test_a_state_file_without_a_key_is_one_line(tiny, tmp_path, capsys, missing):
    """A state.pt that loads but lacks a key every run needs: one line naming it, exit 2 (not a
    KeyError traceback later in setup)."""
    model, tokenizer = tiny
    out = str(tmp_path / "run")
    optimizer, scheduler = make_optimizer(model, 1e-3, 0.0, 0, 10, "constant")
    save_checkpoint(out, model, tokenizer, optimizer, scheduler, step=1, cursor=8)
    folder = checkpoints(out)[-1]
    state = read_checkpoint(folder)
    del state[missing]
    torch.save(state, os.path.join(folder, "state.pt"))
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        read_checkpoint(folder)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1, err
    assert err[0] == (f"error: --resume: {folder}/state.pt lacks {missing}: not a checkpoint this "
                      "code wrote"), err


def test_resume_drops_rows_after_the_checkpoint_and_a_cut_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s}) + "\n" for s in range(6))
                    + '{"step": 6, "loss"')
    f = open_metrics(str(tmp_path), resume_step=4)
    f.write(json.dumps({"step": 5}) + "\n")
    f.close()
    assert [json.loads(line)["step"] for line in open(path)] == [0, 1, 2, 3, 4, 5]
    f = open_metrics(str(tmp_path))  # a fresh run starts the file over
    f.close()
    assert path.read_text() == ""


def test_a_checkpoint_written_on_a_gpu_resumes_on_this_device(tiny, tmp_path, monkeypatch):
    """--resume of a GPU run on a CPU-only machine: state.pt's tensors say 'cuda:0' (written here by
    making torch.save tag every storage so, as a GPU run's are), and must load onto the model's
    device with the optimiser state on it (read_checkpoint, then optimizer.load_state_dict, as
    setup() does)."""
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
    folder = checkpoints(str(tmp_path))[-1]
    if not torch.cuda.is_available():  # the file really claims a GPU: a plain load fails here
        with pytest.raises(RuntimeError, match="CUDA"):
            torch.load(os.path.join(folder, "state.pt"), weights_only=True)
    optimizer, scheduler = make_optimizer(model, 1e-3, 0.0, 0, 10, "constant")
    state = read_checkpoint(folder)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    assert (state["step"], state["cursor"]) == (2, 16)
    got = optimizer.state[next(model.parameters())]
    device = next(model.parameters()).device
    assert got.keys() == want.keys() and all(got[k].device == device
                                             for k in ("exp_avg", "exp_avg_sq"))
    assert all(torch.equal(got[k].cpu(), want[k].cpu()) for k in want)


def test_a_users_own_checkpoint_folder_is_never_read_as_one_nor_pruned(tiny, tmp_path):
    """checkpoint-final/ and checkpoint-best/ (a user's copies of step 2, state.pt and all) in a run
    folder: checkpoints() lists only checkpoint-<step>/ (no int('final') traceback), and the
    pruning of old checkpoints, which keeps the two newest of the run's own, leaves them byte for
    byte."""
    model, tokenizer = tiny
    out = str(tmp_path / "run")
    optimizer, scheduler = make_optimizer(model, 1e-3, 0.0, 0, 10, "constant")
    save_checkpoint(out, model, tokenizer, optimizer, scheduler, step=2, cursor=16)
    for copy in ("checkpoint-final", "checkpoint-best", "checkpoint-02"):
        shutil.copytree(os.path.join(out, "checkpoint-2"), os.path.join(out, copy))
    theirs = {copy: snapshot(os.path.join(out, copy)) for copy in ("checkpoint-final",
                                                               "checkpoint-best",
                                                               "checkpoint-02")}
    assert checkpoints(out) == [os.path.join(out, "checkpoint-2")]
    for step in (3, 4, 5):
        save_checkpoint(out, model, tokenizer, optimizer, scheduler, step=step, cursor=8 * step)
    assert checkpoints(out) == [os.path.join(out, "checkpoint-4"),
                                os.path.join(out, "checkpoint-5")]
    assert {copy: snapshot(os.path.join(out, copy)) for copy in theirs} == theirs


@pytest.mark.parametrize("field,value,want", [
    ("step", "3", "an int in [1, 2^20)"), ("step", 0, "an int in [1, 2^20)"),
    ("step", True, "an int in [1, 2^20)"), ("cursor", -8, "an int >= 0"),
    ("cursor", 8.0, "an int >= 0"), ("train_s", float("nan"), "a finite number >= 0"),
    ("train_s", -1.0, "a finite number >= 0"), ("train_s", 2, "a finite number >= 0"),
    ("history", {"3": True}, "{row: tied} of ints and bools"),
    ("history", {3: 1}, "{row: tied} of ints and bools"),
])
def test_every_field_of_a_state_file_is_checked(tiny, tmp_path, capsys, field, value, want):
    """A state.pt whose field has the wrong type or range: one line naming the field, exit 2, at
    read_checkpoint (setup's first act, before anything in the run folder is written)."""
    model, tokenizer = tiny
    out = str(tmp_path / "run")
    optimizer, scheduler = make_optimizer(model, 1e-3, 0.0, 0, 10, "constant")
    save_checkpoint(out, model, tokenizer, optimizer, scheduler, step=1, cursor=8,
                    extra={"train_s": 1.5, "history": {0: True}})
    folder = checkpoints(out)[-1]
    read_checkpoint(folder)  # as written: fine
    torch.save({**read_checkpoint(folder), field: value}, os.path.join(folder, "state.pt"))
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        read_checkpoint(folder)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1, err
    assert err[0].startswith(f"error: --resume: {folder}/state.pt's {field} must be {want}"), err


def test_an_optimizer_state_of_another_model_is_one_line(tiny, tmp_path, capsys):
    """The optimiser's groups and each parameter's moments must match the model's: torch's
    load_state_dict checks the counts (a traceback) and not the shapes (a crash at the first
    step); both are one line here, as an optimiser or scheduler state that is no state_dict. The
    run's own loads."""
    model, tokenizer = tiny
    optimizer, scheduler = make_optimizer(model, 1e-3, 0.0, 0, 10, "constant")
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    optimizer.zero_grad()
    save_checkpoint(str(tmp_path), model, tokenizer, optimizer, scheduler, step=1, cursor=8)
    folder = checkpoints(str(tmp_path))[-1]
    state = read_checkpoint(folder)
    load_optimizer_state(optimizer, scheduler, state, folder)
    fewer = {**state["optimizer"], "param_groups": [{**state["optimizer"]["param_groups"][0],
                                                     "params": [0, 1]}]}
    reshaped = {**state["optimizer"], "state": {**state["optimizer"]["state"]}}
    first = reshaped["state"][0]
    reshaped["state"][0] = {k: v if v.dim() == 0 else v[:1] for k, v in first.items()}
    for saved in (fewer, reshaped, [], {"state": {}}, {**state, "scheduler": 3}):
        if isinstance(saved, dict) and "scheduler" in saved:  # a scheduler's state that is none
            damaged = saved
        else:
            damaged = {**state, "optimizer": saved}
        with pytest.raises(SystemExit) as e:
            load_optimizer_state(optimizer, scheduler, damaged, folder)
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1, err
        assert err[0].startswith(f"error: --resume: {folder}/state.pt's optimizer does not match "
                                 "the model"), err
