# EvolvingLMMs-Lab/lmms-eval#889 (commit 9a180ec6, "fix qwen to handle bsz>1"), lmms_eval/models/simple/qwen2_5_vl.py.
# Qwen2_5_VL.generate_until batches several image+question requests, calls the processor with padding=True and
# hands the result to model.generate. The Qwen2.5-VL tokenizer pads on the right, so with batch_size > 1 the
# shorter prompts end in pad tokens (attention_mask 0) and generation continues after them.
# Fix: processor(..., padding=True, padding_side="left" if self.batch_size > 1 else "right").
# Tiny Qwen2.5-VL built from its config classes; a word-level tokenizer and the PIL image processor stand in
# for the hub processor (same placeholder expansion as Qwen2_5_VLProcessor.__call__).
import sys

import numpy as np
import torch
from PIL import Image
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    PreTrainedTokenizerFast,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2VLImageProcessorPil,
)

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
np.random.seed(0)

WORDS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
         "<|video_pad|>", "system", "user", "assistant", "You", "are", "a", "helpful", "assistant.", "What", "is",
         "in", "the", "image?", "Describe", "this", "picture", "using", "one", "short", "word.", "\n"]
WORDS += [f"w{i}" for i in range(64 - len(WORDS))]


def build_tokenizer():
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<|endoftext|>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # tokenizer_config of Qwen2.5-VL: pad = <|endoftext|>, eos = <|im_end|>, no padding_side -> "right"
    return PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<|endoftext|>", eos_token="<|im_end|>")


class Qwen2_5_VLProcessorLite:
    image_token = "<|image_pad|>"

    def __init__(self, image_processor, tokenizer):
        self.image_processor, self.tokenizer = image_processor, tokenizer

    def apply_chat_template(self, conversations, tokenize=False, add_generation_prompt=True):
        texts = []
        for messages in conversations:
            s = ""
            for m in messages:
                body = m["content"] if isinstance(m["content"], str) else " ".join(
                    "<|vision_start|> <|image_pad|> <|vision_end|>" if c["type"] == "image" else c["text"]
                    for c in m["content"])
                s += f"<|im_start|> {m['role']} \n {body} <|im_end|> \n "
            texts.append(s + ("<|im_start|> assistant \n" if add_generation_prompt else ""))
        return texts

    def __call__(self, text, images=None, videos=None, padding=True, padding_side=None, return_tensors="pt"):
        image_inputs = self.image_processor(images=images, return_tensors="pt")
        merge_length = self.image_processor.merge_size ** 2
        text, index = list(text), 0
        for i in range(len(text)):
            while self.image_token in text[i]:
                n = int(image_inputs["image_grid_thw"][index].prod()) // merge_length
                text[i] = text[i].replace(self.image_token, " ".join(["<|placeholder|>"] * n), 1)
                index += 1
            text[i] = text[i].replace("<|placeholder|>", self.image_token)
        kw = {} if padding_side is None else {"padding_side": padding_side}
        text_inputs = self.tokenizer(text, padding=padding, return_tensors=return_tensors, **kw)
        return {**text_inputs, **image_inputs}

    def batch_decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False):
        return self.tokenizer.batch_decode(ids, skip_special_tokens=skip_special_tokens)


tokenizer = build_tokenizer()
config = Qwen2_5_VLConfig(
    text_config=dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=256,
                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]}),
    vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=32, patch_size=14,
                       spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1]),
    image_token_id=WORDS.index("<|image_pad|>"), video_token_id=WORDS.index("<|video_pad|>"),
    vision_start_token_id=WORDS.index("<|vision_start|>"), vision_end_token_id=WORDS.index("<|vision_end|>"),
)
model = Qwen2_5_VLForConditionalGeneration(config).eval()
processor = Qwen2_5_VLProcessorLite(Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=56 * 56), tokenizer)
batch_size = 2
system_prompt = "You are a helpful assistant."

# Qwen2_5_VL.generate_until, one batch of two requests
contexts = ["What is in the image?", "Describe this picture using one short word."]
visuals = [Image.fromarray((np.random.rand(56, 56, 3) * 255).astype("uint8")) for _ in contexts]
batched_messages = []
for context, visual in zip(contexts, visuals):
    message = [{"role": "system", "content": system_prompt}]
    message.append({"role": "user", "content": [{"type": "image", "image": visual}, {"type": "text", "text": context}]})
    batched_messages.append(message)
texts = processor.apply_chat_template(batched_messages, tokenize=False, add_generation_prompt=True)
image_inputs = visuals  # process_vision_info(batched_messages)
if FIXED:
    padding_side = "left" if batch_size > 1 else "right"
    inputs = processor(text=texts, images=image_inputs, videos=None, padding=True, padding_side=padding_side,
                       return_tensors="pt")
else:
    inputs = processor(text=texts, images=image_inputs, videos=None, padding=True, return_tensors="pt")

with torch.no_grad():
    cont = model.generate(**inputs, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                          do_sample=False, num_beams=1, max_new_tokens=4, use_cache=True)
generated_ids_trimmed = [out_ids[len(in_ids):] for in_ids, out_ids in zip(inputs["input_ids"], cont)]
print("padding mask rows:", inputs["attention_mask"].sum(-1).tolist(), "of", inputs["attention_mask"].shape[-1])
print("generated:", [g.tolist() for g in generated_ids_trimmed])
