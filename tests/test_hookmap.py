"""Hook maps: parsing, validation, bundled maps, and the maps found after a real install."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from blockdiff import HookMapError, hookmap, resolve
from samples import tinylm

ROOT = Path(__file__).resolve().parent.parent


def test_bundled_maps_parse_and_have_unique_names():
    maps = hookmap.bundled()
    names = [m.name for m in maps]
    assert {"tinylm", "llama"} <= set(names)
    assert len(names) == len(set(names))
    classes = [c for m in maps for c in m.match]
    assert len(classes) == len(set(classes)), "a class is matched by two maps"


def test_resolve_sample_layout():
    layout = resolve(tinylm.build())
    assert layout.hook_map.name == "tinylm"
    assert len(layout.blocks) == 4
    assert layout.blocks[1].subpaths == {
        "attention": ["blocks.1.attn"],
        "ffn": ["blocks.1.ffn"],
        "norm": ["blocks.1.attn_norm", "blocks.1.ffn_norm"],
    }
    assert layout.blocks[1].unmapped == []


@pytest.mark.parametrize(
    "text,message",
    [
        ("name = ", "not valid TOML"),
        ('[blocks]\npath = "blocks"', "missing 'name'"),
        ('name = "x"', "missing [blocks] table"),
        ('name = "x"\n[blocks]\npath = "blocks"\n[blocks.subpaths]\nmlp = "ffn"', "unknown sub-path 'mlp'"),
        ('name = "x"\n[blocks]\npath = "blocks"\n[blocks.subpaths]\nresidual = "ffn"', "unknown sub-path 'residual'"),
        ('name = "x"\n[outside]\nlogits = "lm_head"\n[blocks]\npath = "blocks"', "unknown stage 'logits'"),
        ('name = "x"\n[blocks]\npath = 3', "blocks.path must be a string or a list of strings, found int"),
    ],
)
def test_malformed_maps_are_clear_errors(text, message):
    with pytest.raises(HookMapError, match=message.replace("[", r"\[").replace("(", r"\(")):
        hookmap.parse(text, source="test.toml")


def test_missing_modules_are_named():
    bad = hookmap.parse('name = "x"\n[outside]\nembed = "tok_emb"\n[blocks]\npath = "blocks"', source="x.toml")
    with pytest.raises(HookMapError, match="embed module 'tok_emb' does not exist in TinyLM"):
        resolve(tinylm.build(), bad)
    bad = hookmap.parse('name = "x"\n[blocks]\npath = "embed"', source="x.toml")
    with pytest.raises(HookMapError, match="block list 'embed' is a Embedding, expected a ModuleList"):
        resolve(tinylm.build(), bad)


def test_unmapped_modules_are_listed():
    partial = hookmap.parse('name = "x"\n[blocks]\npath = "blocks"\n[blocks.subpaths]\nattention = "attn"', source="x.toml")
    layout = resolve(tinylm.build(), partial)
    assert "blocks.0.ffn.gate_proj" in layout.blocks[0].unmapped
    assert "blocks.0.attn_norm" in layout.blocks[0].unmapped


def test_hook_maps_are_found_after_a_non_editable_install(tmp_path):
    """`pip install .` (not editable) ships hooks/*.toml as blockdiff.hooks."""
    target = tmp_path / "site"
    build = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--target", str(target), str(ROOT)],
        capture_output=True, text=True, timeout=300,
    )
    assert build.returncode == 0, build.stderr
    assert (target / "blockdiff" / "hooks" / "llama.toml").is_file()
    probe = (
        "import blockdiff.hookmap as h, blockdiff; "
        "print(blockdiff.__file__); print(sorted(m.name for m in h.bundled()))"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(target)
    done = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    location, names = done.stdout.strip().splitlines()
    assert location.startswith(str(target))
    assert "'llama'" in names and "'tinylm'" in names


def test_shard_keys_take_a_dimension(tmp_path):
    from blockdiff.errors import HookMapError
    from blockdiff.hookmap import load

    base = (Path(__file__).resolve().parent.parent / "samples" / "tinylm_sp.toml").read_text()
    good = tmp_path / "good.toml"
    good.write_text(base)
    options = load(str(good)).modules["attn_norm"]
    assert (options.shard_input, options.shard_output) == (1, 1)
    bad = tmp_path / "bad.toml"
    bad.write_text(base.replace("shard_output = 1", 'shard_output = "last"', 1))
    with pytest.raises(HookMapError, match="shard_output must be a dimension"):
        load(str(bad))


def test_a_block_dict_keyed_by_index_numbers_its_blocks_by_key():
    """A pipeline stage's share of the blocks keeps their global indices."""
    from torch import nn

    from blockdiff.hookmap import load

    model = tinylm.build()
    model.blocks = nn.ModuleDict({"2": model.blocks[2], "3": model.blocks[3]})
    del model.embed  # held by another stage: optional in the stage's map
    layout = resolve(model, load(str(Path(__file__).resolve().parent.parent / "samples" / "tinylm_pp.toml")))
    assert [(b.index, b.path) for b in layout.blocks] == [(2, "blocks.2"), (3, "blocks.3")]
    assert [stage for stage, _ in layout.outside] == ["context", "final_norm", "head"]
