"""Cross-implementation: tinylm (plain torch) against Hugging Face Llama with the same
weights, copied through safetensors by samples/port.py. With identical weights the two
compute the same function, so nothing is blamed in float32; a bug planted on either side
is found at its block and sub-path."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from blockdiff import diff  # noqa: E402
from blockdiff.cli import main  # noqa: E402
from samples import port, tinylm  # noqa: E402
from tests.conftest import blamed  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
HOOKS = dict(reference_hooks=port.REFERENCE_HOOKS, candidate_hooks=port.PORT_HOOKS)


def test_port_copies_every_parameter_and_computes_the_same_logits(ids):
    reference = port.reference()
    ported = port.port_llama(reference)
    copied = {name: tensor for name, tensor in ported.state_dict().items()}
    for name, tensor in reference.state_dict().items():
        if name != "lm_head.weight":
            assert torch.equal(copied.pop(port.tinylm_name(name)), tensor), name
    assert set(copied) == {"lm_head.weight"}  # tied to the embedding on both sides
    assert ported.lm_head.weight is ported.embed.weight
    with torch.inference_mode():
        expected = reference(ids, use_cache=False).logits
        got = ported(ids)
    assert float((got - expected).norm() / expected.norm()) < 1e-5


def test_configs_must_match():
    import transformers

    with pytest.raises(ValueError, match="hidden_act='gelu'"):
        port.tinylm_config(transformers.LlamaConfig(hidden_act="gelu", tie_word_embeddings=True))
    with pytest.raises(ValueError, match="an untied head"):
        port.tinylm_config(transformers.LlamaConfig(tie_word_embeddings=False))
    with pytest.raises(ValueError, match="does not match"):
        port.port_llama(port.reference(), into=tinylm.build(blocks=3))
    assert port.tinylm_config(port.llama_config()) == tinylm.Config()


def test_port_blames_nothing_in_float32(ids):
    report = diff(port.reference(), port.port(), ids, **HOOKS)
    assert report.tolerance["policy"] == "fixed"
    assert report.first_divergence is None
    assert len(report.blocks) == 4
    # Every sub-path was compared across the two codebases, not skipped.
    for block in report.blocks:
        checked = {name for name, result in block.subpaths.items() if result.checks}
        assert checked == {"attention", "ffn", "norm", "residual"}


def test_port_in_bfloat16_against_the_float32_reference_blames_nothing(ids):
    report = diff(port.reference(), port.port().to(torch.bfloat16), ids, **HOOKS)
    assert report.tolerance["policy"] == "calibrated"
    assert report.first_divergence is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "make,where",
    [
        (lambda: (port.reference(), port.port_gelu_for_silu(block=2)), (2, "ffn")),
        (lambda: (port.reference(), port.port_rope_sign_flipped(block=0)), (0, "attention")),
        (lambda: (port.reference_attention_scale(block=3), port.port()), (3, "attention")),
    ],
    ids=["port-gelu", "port-rope-sign", "reference-attention-scale"],
)
def test_bug_on_either_side_is_found(make, where, dtype, ids):
    reference, candidate = make()
    report = diff(reference, candidate.to(dtype), ids, **HOOKS)
    assert blamed(report) == ("block", *where)
    assert len(report.divergences) == 1


def test_hugging_face_as_the_candidate_of_the_port(ids):
    """The roles swapped: the port is the reference, HF Llama the candidate."""
    report = diff(port.port(), port.reference_attention_scale(block=1), ids,
                  reference_hooks=port.PORT_HOOKS, candidate_hooks=port.REFERENCE_HOOKS)
    assert blamed(report) == ("block", 1, "attention")


def test_port_with_the_bundled_maps_compares_rotary_tables(ids):
    report = diff(port.reference(), port.port(), ids)
    assert report.first_divergence is None


def test_cli_diffs_the_port(tmp_path, capsys):
    os.chdir(ROOT)
    ref_hooks, port_hooks = port.write_hooks(tmp_path)
    hooks = ["--ref-hooks", str(ref_hooks), "--cand-hooks", str(port_hooks), "-q"]
    with pytest.raises(SystemExit) as exited:
        main(["diff", "samples/port.py:reference", "samples/port.py:port", *hooks])
    assert (exited.value.code, capsys.readouterr().out.strip()) == (0, "no divergence")
    with pytest.raises(SystemExit) as exited:
        main(["diff", "samples/port.py:reference", "samples/port.py:port_gelu_for_silu", *hooks])
    assert exited.value.code == 1
    assert capsys.readouterr().out.startswith("first divergence: block 1 ffn (blocks.1.ffn)")


def test_a_stage_only_one_side_has_by_nature_is_left_out_with_a_note(ids):
    """A port computing its rotary angles inside the attention has no context stage; the
    reference's rotary module is left out of the pairing, and the report says so."""
    from samples import cached_lm

    report = diff(port.reference(), cached_lm.port(), ids)
    assert report.first_divergence is None
    assert [s.stage for s in report.stages] == ["embed", "final_norm", "head"]
    note = next(n for n in report.notes if n.startswith("context:"))
    assert "only the reference has this stage (model.rotary_emb)" in note and "left out of the pairing" in note


def test_a_stage_missing_on_one_side_names_the_side_the_module_and_the_map_key(ids):
    from dataclasses import replace

    from blockdiff import PairingError

    without_norm = replace(port.PORT_HOOKS, outside={k: v for k, v in port.PORT_HOOKS.outside.items() if k != "final_norm"})
    with pytest.raises(PairingError) as raised:
        diff(port.reference(), port.port(), ids, reference_hooks=port.REFERENCE_HOOKS, candidate_hooks=without_norm)
    message = str(raised.value)
    assert "recorded on one side only, by the reference's `model.norm` (hook map 'llama-no-context', key [outside] final_norm)" in message
    assert "missing in the candidate" in message and "drop that key from the reference's map" in message
