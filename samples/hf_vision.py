"""Tiny Hugging Face vision encoders (ViT, a CLIP vision tower) and a planted bug.

Built from config objects with trained-looking random weights; they take ``pixel_values``,
which the CLI makes up from the config's image size (``--batch --seed``) or reads with
``--inputs FILE``.

    blockdiff diff samples/hf_vision.py:build_vit --cand-dtype bfloat16
    blockdiff diff samples/hf_vision.py:build_vit samples/hf_vision.py:vit_gelu_for_relu
"""

from __future__ import annotations

import torch
from torch import nn

from blockdiff.weights import trained_looking_

SIZES = dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, intermediate_size=128, image_size=32, patch_size=8)


def build_vit(*, seed: int = 0) -> nn.Module:
    import transformers

    torch.manual_seed(seed)
    return trained_looking_(transformers.ViTModel(transformers.ViTConfig(**SIZES)), seed=seed).eval()


def build_clip_vision(*, seed: int = 0) -> nn.Module:
    import transformers

    torch.manual_seed(seed)
    return trained_looking_(transformers.CLIPVisionModel(transformers.CLIPVisionConfig(**SIZES)), seed=seed).eval()


def vit_gelu_for_relu(*, block: int = 1) -> nn.Module:
    """ViT whose block ``block`` uses ReLU where the model uses GELU."""
    model = build_vit()
    model.layers[block].mlp.activation_fn = nn.ReLU()
    return model
