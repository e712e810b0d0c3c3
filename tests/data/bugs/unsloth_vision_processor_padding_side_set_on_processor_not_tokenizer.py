"""Unsloth's vision models: "force left padding for inference" set the side on the processor object.

Citation: unslothai/unsloth#1384 ("Fix vision model tokenizer padding side.", commit 9343e413a1,
merged as 9bc260938c), unsloth/models/vision.py (FastBaseVisionModel.from_pretrained,
for_inference, for_training).

The bug: FastBaseVisionModel.from_pretrained loads an AutoProcessor (padding_side="right" for
training), then, "for inference purposes", sets ``tokenizer.padding_side = "left"``, and
for_inference / for_training flip ``_saved_temp_tokenizer.padding_side`` between "left" and
"right". ``tokenizer`` here is the processor (image processor + text tokenizer): the attribute
lands on the processor object and its text tokenizer keeps padding on the right. A batch of
prompts of different lengths given to model.generate is right-padded, so the shorter prompt's
first new token is read from a pad slot's logits and every new token follows its pad tokens.

The fix: set the side on the text tokenizer too, ``tokenizer.tokenizer.padding_side = "right"``
after loading and ``... .tokenizer.padding_side = "left"`` / ``"right"`` where the processor's
side was set.

Ported at toy sizes with random weights: a LLaVA model (LlavaForConditionalGeneration built from
LlavaConfig with a tiny CLIP vision tower and Llama text model) stands in for the downloaded
checkpoint, and a LlavaProcessor over a word-level PreTrainedTokenizerFast and a 16x16
CLIPImageProcessor for AutoProcessor.from_pretrained (loading, quantisation, PEFT patching and the
generate wrapper are left out). The user's code is Unsloth's vision notebook's inference cell on
a batch of two images and prompts.
"""

import sys
import warnings

import numpy as np
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    CLIPImageProcessor,
    CLIPVisionConfig,
    LlamaConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
    LlavaProcessor,
    PreTrainedTokenizerFast,
)
from transformers.utils import logging as hf_logging

FIXED = "--fixed" in sys.argv
hf_logging.set_verbosity_error()
warnings.filterwarnings("ignore")

WORDS = [
    "<pad>", "<s>", "</s>", "<unk>", "<image>", "USER:", "ASSISTANT:", "describe", "the",
    "picture", "what", "color", "is", "this", "a", "cat", "dog", "or", "please", "tell", "me",
    "about", "it", "red", "blue",
]


def _hub_checkpoint():
    """What from_pretrained would download: the model and its processor's parts."""
    vocab = {w: i for i, w in enumerate(WORDS)}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    text_tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tk, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
        unk_token="<unk>",
    )
    text_tokenizer.add_tokens(["<image>"], special_tokens=True)
    image_processor = CLIPImageProcessor(
        size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16}
    )
    config = LlavaConfig(
        vision_config=CLIPVisionConfig(
            image_size=16, patch_size=8, hidden_size=32, intermediate_size=64,
            num_hidden_layers=1, num_attention_heads=2, projection_dim=32,
        ),
        text_config=LlamaConfig(
            vocab_size=len(WORDS), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, bos_token_id=1,
            eos_token_id=2, initializer_range=0.2,
        ),
        image_token_index=4,
        vision_feature_select_strategy="default",
        vision_feature_layer=-1,
    )
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(config).eval()
    return model, text_tokenizer, image_processor


class FastBaseVisionModel:
    @staticmethod
    def from_pretrained(model_name="unsloth/llava-tiny"):
        model, text_tokenizer, image_processor = _hub_checkpoint()

        # Counteract saved tokenizers
        # (AutoProcessor.from_pretrained(tokenizer_name, padding_side = "right", token = token))
        text_tokenizer.padding_side = "right"
        tokenizer = LlavaProcessor(
            image_processor=image_processor,
            tokenizer=text_tokenizer,
            patch_size=8,
            vision_feature_select_strategy="default",
            num_additional_image_tokens=1,
            image_token="<image>",
        )
        if FIXED:
            # Add padding side as well
            tokenizer.tokenizer.padding_side = "right"

        # Save tokenizer for inference purposes
        tokenizer.padding_side = "left"  # Force inference
        if FIXED:
            tokenizer.tokenizer.padding_side = "left"  # Force inference
        internal_model = model
        while hasattr(internal_model, "model"):
            internal_model._saved_temp_tokenizer = tokenizer
            internal_model = internal_model.model
        internal_model._saved_temp_tokenizer = tokenizer

        return model, tokenizer

    @staticmethod
    def _set_saved_padding_side(model, side):
        internal_model = model
        while hasattr(internal_model, "model"):
            if hasattr(internal_model, "_saved_temp_tokenizer"):
                if FIXED:
                    internal_model._saved_temp_tokenizer.tokenizer.padding_side = side
                else:
                    internal_model._saved_temp_tokenizer.padding_side = side
            internal_model = internal_model.model
        if hasattr(internal_model, "_saved_temp_tokenizer"):
            if FIXED:
                internal_model._saved_temp_tokenizer.tokenizer.padding_side = side
            else:
                internal_model._saved_temp_tokenizer.padding_side = side

    @staticmethod
    def for_inference(model):
        model.gradient_checkpointing = False
        model.training = False
        for name, module in model.named_modules():
            if hasattr(module, "gradient_checkpointing"):
                module.gradient_checkpointing = False
            if hasattr(module, "training"):
                module.training = False
        # Patch tokenizer to pad to the left
        FastBaseVisionModel._set_saved_padding_side(model, "left")
        return model

    @staticmethod
    def for_training(model, use_gradient_checkpointing=True):
        model.train()
        # Patch tokenizer to pad to the right
        FastBaseVisionModel._set_saved_padding_side(model, "right")
        return model


FastVisionModel = FastBaseVisionModel


def main():
    model, tokenizer = FastVisionModel.from_pretrained("unsloth/llava-tiny")
    # ... fine-tuning would run here under FastVisionModel.for_training(model) ...
    FastVisionModel.for_training(model)
    FastVisionModel.for_inference(model)  # Enable for inference!

    rng = np.random.RandomState(0)
    images = [rng.randint(0, 255, (16, 16, 3)).astype(np.uint8) for _ in range(2)]
    texts = [
        "USER: <image> describe the picture ASSISTANT:",
        "USER: <image> what color is this a cat or a dog please tell me about it ASSISTANT:",
    ]
    inputs = tokenizer(
        images=images, text=texts, add_special_tokens=False, padding=True, return_tensors="pt"
    )
    print("input_ids:", inputs["input_ids"].tolist())
    with torch.no_grad():
        out = model.generate(
            **inputs, max_new_tokens=6, do_sample=False, use_cache=True, pad_token_id=0
        )
    new_tokens = out[:, inputs["input_ids"].shape[1]:]
    for i, row in enumerate(new_tokens.tolist()):
        print(f"row {i}:", " ".join(WORDS[t] for t in row))


if __name__ == "__main__":
    main()
