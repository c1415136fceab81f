"""docs/one_step.md is what `python docs/one_step.py` writes now: one GRPO step of the toy on CPU,
regenerated and compared byte for byte with the committed page; and its rounding is coarse enough
that another CPU writes the same page. About 10 s on CPU (two runs of the step)."""
import os
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "docs"))
import one_step  # noqa: E402


def committed():
    with open(one_step.PAGE, encoding="utf-8") as f:
        return f.read()


def test_the_page_is_what_its_command_writes(tmp_path):
    out = tmp_path / "one_step.md"
    one_step.main(["--out", str(out)])
    assert out.read_text(encoding="utf-8") == committed(), (
        "docs/one_step.md is not what the code computes now: run python docs/one_step.py, read the "
        "diff, and commit the page")


def test_a_nudge_to_every_weight_leaves_the_page_as_it_is(monkeypatch):
    """Every weight times (1 + 1e-6 N(0, 1)): its numbers move several times more than between
    torch's AVX-512, AVX2 and default CPU kernels (measured with ATEN_CPU_CAPABILITY), so a page
    with a number this close to a rounding edge, which another CPU could print otherwise, fails."""
    load_model = one_step.load_model

    def nudged(*args, **kwargs):
        model = load_model(*args, **kwargs)
        noise = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1 + 1e-6 * torch.randn(p.shape, generator=noise))
        return model

    monkeypatch.setattr(one_step, "load_model", nudged)
    page = one_step.page(one_step.step())
    changed = [(a, b) for a, b in zip(committed().splitlines(), page.splitlines()) if a != b]
    assert page == committed(), f"numbers on a rounding edge (committed, nudged): {changed}"
