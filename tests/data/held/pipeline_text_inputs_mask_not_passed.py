# The bug of black-forest-labs/flux#507 (blind-ea's flux_hfembedder_t5_padding_mask_not_passed) written another way: a
# diffusers-style pipeline's `encode_prompt` tokenizes a batch of prompts padded on the right to max_length into a
# BatchEncoding (`text_inputs`, a UserDict read by attribute), then hands its text encoder (a bidirectional BERT) only
# `text_inputs.input_ids`: the prompts' real tokens attend to the padding. The fix passes `text_inputs.attention_mask`.
import sys
from collections import UserDict

import torch
from transformers import BertConfig, BertModel

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class BatchEncoding(UserDict):
    """transformers' BatchEncoding, as a tokenizer returns it: a UserDict whose entries read as attributes."""

    def __getattr__(self, name):
        try:
            return self.data[name]
        except KeyError as error:
            raise AttributeError(name) from error


class WordTokenizer:
    """A stand-in tokenizer: word ids, [CLS]=2 first and [SEP]=3 last, padded on the right with 0 to max_length."""
    pad_token_id, padding_side = 0, "right"

    def __init__(self, vocab_size):
        self.vocab_size = vocab_size

    def __call__(self, prompts, padding="max_length", max_length=16, truncation=True, return_tensors="pt"):
        ids, masks = [], []
        for text in prompts:
            row = [2] + [4 + sum(map(ord, w)) % (self.vocab_size - 4) for w in text.split()][: max_length - 2] + [3]
            ids.append(row + [0] * (max_length - len(row)))
            masks.append([1] * len(row) + [0] * (max_length - len(row)))
        return BatchEncoding({"input_ids": torch.tensor(ids), "attention_mask": torch.tensor(masks)})


class TextToImagePipeline:
    def __init__(self):
        config = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                            intermediate_size=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                            pad_token_id=0)
        self.text_encoder = BertModel(config, add_pooling_layer=False).eval()
        self.tokenizer = WordTokenizer(config.vocab_size)

    @torch.no_grad()
    def encode_prompt(self, prompts, max_length=16):
        text_inputs = self.tokenizer(prompts, padding="max_length", max_length=max_length, truncation=True,
                                     return_tensors="pt")
        text_input_ids = text_inputs.input_ids
        if FIXED:
            prompt_embeds = self.text_encoder(text_input_ids, attention_mask=text_inputs.attention_mask)[0]
        else:
            prompt_embeds = self.text_encoder(text_input_ids)[0]
        return prompt_embeds, text_inputs.attention_mask


pipe = TextToImagePipeline()
prompts = ["a red fox", "an oil painting of a lighthouse in a storm", "snow"]
embeds, keep = pipe.encode_prompt(prompts)
with torch.no_grad():
    err = 0.0
    for i in range(len(prompts)):
        real = keep[i].bool()
        alone = pipe.text_encoder(pipe.tokenizer([prompts[i]]).input_ids[:, :int(real.sum())])[0][0]
        err = max(err, (embeds[i][real] - alone).abs().max().item())
print(f"max |padded prompt embeds - each prompt alone| = {err:.6f}")
