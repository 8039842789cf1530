"""Models as loaders hand them over: accelerate-dispatched (CPU and disk offload), a model
whose ``.to`` takes no keywords; and what an internal error looks like."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.conftest import run_cli

pytest.importorskip("accelerate")

FACTORY = '''
import torch
from torch import nn
import transformers

SAVED = {saved!r}
DEVICE_MAP = {{
    "model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers.0": "cpu",
    "model.layers.1": "disk", "model.layers.2": "disk", "model.layers.3": "cpu",
    "model.norm": "cpu", "lm_head": "cpu",
}}


def offloaded(dtype=torch.float32):
    return transformers.AutoModelForCausalLM.from_pretrained(
        SAVED, device_map=DEVICE_MAP, offload_folder=SAVED + "-offload", dtype=dtype
    )


def gelu_in_disk_block():
    model = offloaded()
    model.model.layers[2].mlp.act_fn = nn.GELU()  # block 2's weights live on disk
    return model
'''


@pytest.fixture(scope="module")
def offload_factory(tmp_path_factory) -> str:
    from samples import hf_llama

    folder = tmp_path_factory.mktemp("offload")
    hf_llama.build().save_pretrained(folder / "llama")
    path = folder / "offload_factory.py"
    path.write_text(FACTORY.format(saved=str(folder / "llama")))
    return str(path)


def test_a_disk_offloaded_candidate_is_used_as_it_comes(offload_factory, capsys):
    code, out, err = run_cli(["diff", "samples/hf_llama.py:build", f"{offload_factory}:offloaded", "-q"], capsys)
    assert (code, out.strip()) == (0, "no divergence"), err


def test_a_bug_in_a_disk_offloaded_block_is_blamed_there(offload_factory, capsys):
    code, out, err = run_cli(["diff", "samples/hf_llama.py:build", f"{offload_factory}:gelu_in_disk_block", "-q"], capsys)
    assert code == 1, err
    assert out.startswith("first divergence: block 2 ffn (model.layers.2.mlp)")


def test_a_dispatched_model_in_another_dtype_than_asked_is_one_line(offload_factory, capsys):
    code, _, err = run_cli(["diff", "samples/hf_llama.py:build", f"{offload_factory}:offloaded", "--cand-dtype", "bfloat16"], capsys)
    assert code == 2
    lines = [line for line in err.splitlines() if line.startswith("Error:")]
    assert len(lines) == 1 and "placed by its loader" in lines[0] and "torch_dtype" in lines[0]
    assert "Traceback" not in err


class PositionalTo(nn.Module):
    """Stands for TransformerLens's HookedTransformer: ``.to`` takes one positional argument."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.inner = model

    def forward(self, ids):
        return self.inner(ids)

    def to(self, device_or_dtype, print_details=True):  # no keywords, like HookedTransformer.to
        return super().to(device_or_dtype)


def test_a_model_whose_to_takes_no_keywords_is_placed(tmp_path, capsys):
    factory = tmp_path / "positional.py"
    factory.write_text(
        textwrap.dedent(
            f"""
            import sys
            sys.path.insert(0, {str(Path(__file__).resolve().parent.parent)!r})
            from samples import tinylm
            from tests.test_models_as_they_come import PositionalTo

            def build():
                return PositionalTo(tinylm.build())
            """
        )
    )
    code, out, err = run_cli(["diff", f"{factory}:build", "--cand-dtype", "bfloat16", "-q"], capsys)
    assert (code, out.strip()) == (0, "no divergence"), err


def test_place_moves_and_casts_only_what_is_not_already_there():
    from blockdiff.loading import place

    calls = []

    class Counting(nn.Linear):
        def to(self, *args, **kwargs):
            calls.append((args, kwargs))
            return super().to(*args, **kwargs)

    model = Counting(2, 2)
    assert place(model, device=torch.device("cpu"), dtype=torch.float32) is model and calls == []
    place(model, device=torch.device("cpu"), dtype=torch.bfloat16)
    assert calls == [((torch.bfloat16,), {})] and model.weight.dtype == torch.bfloat16


def test_an_internal_error_has_its_own_exit_code_and_saves_the_traceback(monkeypatch, capsys):
    import blockdiff.engine

    def broken(*args, **kwargs):
        raise RuntimeError("an invariant broke")

    monkeypatch.setattr(blockdiff.engine, "run", broken)
    code, _, err = run_cli(["diff", "samples/tinylm.py:build"], capsys)
    assert code == 3
    (line,) = err.strip().splitlines()
    assert line.startswith("Internal error: RuntimeError: an invariant broke (a bug in blockdiff")
    saved = Path(line.split("the traceback is in ")[1].split(";")[0])
    assert "an invariant broke" in saved.read_text() and "Traceback" in saved.read_text()
    saved.unlink()
