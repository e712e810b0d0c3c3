"""A multimodal model's media encoders, called inside the same model call as its language model.

A call under one (Qwen2-Audio's `model.audio_tower.layers.0.self_attn`, Qwen2-VL's `model.visual.blocks.0.attn`)
attends frames or patches, whatever their count: the model call's text `attention_mask` and input ids say nothing of
its keys (checks/arguments.py), nor do its token types place images among them (checks/spans.py).
"""

from __future__ import annotations

TOWERS = ("vision_tower", "audio_tower", "vision_model", "audio_model", "visual", "vision_encoder", "audio_encoder",
          "speech_encoder", "image_encoder")


def in_tower(call) -> bool:
    """The call is a media encoder's: its module path passes through one of TOWERS."""
    return any(word in (call.where or "").split(".") for word in TOWERS)
