"""Inputs beyond token ids: named inputs from a file, encoder-decoders and vision encoders
from random inputs."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

import blockdiff
from blockdiff import InputError
from blockdiff.inputs import complete_inputs, load_inputs
from samples import hf_families, hf_llama
from tests.conftest import blamed, run_cli

pytest.importorskip("transformers")


def test_an_encoder_decoder_runs_from_random_ids_through_the_cli(capsys, tmp_path):
    code, out, err = run_cli(["diff", "samples/hf_families.py:build_t5", "--json", str(tmp_path / "r.json")], capsys)
    assert code == 0, err
    notes = json.loads((tmp_path / "r.json").read_text())["notes"]
    assert notes[0] == (
        "inputs: decoder_input_ids derived from the input ids shifted right after decoder_start_token_id 0, "
        "as the model does from labels"
    )
    code, out, err = run_cli(["diff", "samples/hf_families.py:build_t5", "--cand-dtype", "bfloat16", "-q"], capsys)
    assert (code, out.strip()) == (0, "no divergence"), err


def test_derived_decoder_ids_localize_an_encoder_decoder_bug():
    report = blockdiff.run(hf_families.build_t5, lambda: hf_families.ffn_bug(family="t5", block=1))
    assert blamed(report) == ("block", 1, "ffn")
    assert [(d.block, d.subpath) for d in report.divergences] == [(1, "ffn")]


def test_complete_inputs_shifts_right_after_the_start_token():
    ids = torch.tensor([[5, 6, 7]])
    done, note = complete_inputs(hf_families.build_t5(), ids)
    assert torch.equal(done["decoder_input_ids"], torch.tensor([[0, 5, 6]])) and note is not None
    assert complete_inputs(hf_llama.build(), ids) == (ids, None)  # a decoder-only model takes the ids


def test_a_vision_encoder_runs_from_random_pixels_through_the_cli(capsys, tmp_path):
    code, out, err = run_cli(["diff", "samples/hf_vision.py:build_vit", "--cand-dtype", "bfloat16", "--json", str(tmp_path / "r.json")], capsys)
    assert code == 0, err
    assert json.loads((tmp_path / "r.json").read_text())["notes"][0] == "inputs: random pixel_values of shape [2, 3, 32, 32] (seed 0)"
    code, out, _ = run_cli(["diff", "samples/hf_vision.py:build_vit", "samples/hf_vision.py:vit_gelu_for_relu", "-q"], capsys)
    assert code == 1 and out.startswith("first divergence: block 1 ffn (layers.1.mlp)")
    code, out, err = run_cli(["diff", "samples/hf_vision.py:build_clip_vision", "--cand-dtype", "bfloat16", "-q"], capsys)
    assert (code, out.strip()) == (0, "no divergence"), err


def test_named_inputs_with_padding_through_the_cli(capsys, tmp_path):
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # the first row is left-padded
    path = tmp_path / "batch.json"
    path.write_text(json.dumps({"input_ids": ids.tolist(), "attention_mask": mask.tolist()}))
    code, out, err = run_cli(["diff", "samples/hf_llama.py:build", "--cand-dtype", "bfloat16", "--inputs", str(path), "-q"], capsys)
    assert (code, out.strip()) == (0, "no divergence"), err
    save_file({"input_ids": ids, "attention_mask": mask}, str(tmp_path / "batch.safetensors"))
    args = ["diff", "samples/hf_llama.py:build", "samples/hf_llama.py:gelu_for_silu", "--inputs", str(tmp_path / "batch.safetensors")]
    code, out, _ = run_cli([*args, "--json", str(tmp_path / "r.json")], capsys)
    assert code == 1 and "First divergence: block 1 ffn" in out
    assert json.loads((tmp_path / "r.json").read_text())["inputs"]["kind"] == "kwargs"
    # The mask is the model's: padding changes what attention sees.
    padded = blockdiff.diff(hf_llama.build(), hf_llama.build(), load_inputs(path))
    unpadded = blockdiff.diff(hf_llama.build(), hf_llama.build(), {"input_ids": ids})
    assert padded.inputs["digest"] != unpadded.inputs["digest"]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("[[1, 2]]", "expected an object of named arrays"),
        ('{"input_ids": [[1, 2], [3]]}', "'input_ids' is not a rectangular array of numbers"),
        ('{"input_ids": []}', "holds no inputs"),
    ],
)
def test_bad_inputs_files(tmp_path, content, message):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(InputError, match=message):
        load_inputs(path)


def test_tokens_and_inputs_are_exclusive(capsys, tmp_path):
    code, _, err = run_cli(["diff", "samples/tinylm.py:build", "--tokens", "a.json", "--inputs", "b.json"], capsys)
    assert code == 2 and "give --tokens or --inputs, not both" in err


def test_an_encoder_decoder_dump_replays_with_the_same_token_file(capsys, tmp_path):
    ids = torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(4))
    (tmp_path / "ids.json").write_text(json.dumps(ids.tolist()))
    code, _, err = run_cli(["capture", "samples/hf_families.py:build_t5", "--out", str(tmp_path / "t5.h5"), "--tokens", str(tmp_path / "ids.json")], capsys)
    assert code == 0 and "inputs: decoder_input_ids derived" in err
    args = ["diff", str(tmp_path / "t5.h5"), "samples/hf_families.py:build_t5", "--tokens", str(tmp_path / "ids.json"), "-q"]
    code, out, err = run_cli(args, capsys)
    assert (code, out.strip()) == (0, "no divergence"), err


def test_bart_runs_from_random_ids_with_both_stacks_mapped(capsys):
    layout = blockdiff.resolve(hf_families.build_bart())
    assert [b.path for b in layout.blocks] == [
        "model.encoder.layers.0", "model.encoder.layers.1", "model.decoder.layers.0", "model.decoder.layers.1",
    ]
    code, out, err = run_cli(["diff", "samples/hf_families.py:build_bart", "--cand-dtype", "bfloat16", "-q"], capsys)
    assert (code, out.strip()) == (0, "no divergence"), err

    def decoder_bug():
        model = hf_families.build_bart()
        model.model.decoder.layers[1].activation_fn = torch.nn.ReLU()
        return model

    report = blockdiff.run(hf_families.build_bart, decoder_bug)
    assert report.first_divergence.block == 3  # the decoder's second layer, nothing before it
