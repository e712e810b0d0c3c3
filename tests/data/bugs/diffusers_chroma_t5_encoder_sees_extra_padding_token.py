"""Chroma pipeline: the T5 prompt encoder runs under the transformer's "one padding token" mask.

Citation: huggingface/diffusers#12508 ("Fix Chroma attention padding order ...", merged 2025-10-19),
mirrored into SimpleTuner by bghira/SimpleTuner#1844 (commit 7fde1ccdb, "import change from Diffusers
upstream for Chroma masking fixes"). I read the PR description and the SimpleTuner commit's diff, which
carries the same change to ``ChromaPipeline._get_t5_prompt_embeds``.

Bug: Chroma keeps exactly one padding token visible to its MMDiT transformer. The pipeline built that
extended mask (``mask_indices <= seq_lengths``: the real tokens plus the first ``<pad>``) *before* the T5
forward and passed it to the text encoder too, so T5 self-attention also attended to the first pad.
Fix: run T5 with the tokenizer's own ``attention_mask``; build the one-extra-pad mask only afterwards,
for the transformer.

This program writes ``_get_t5_prompt_embeds`` as the pipeline does, with a small ``T5EncoderModel`` built
from a ``T5Config`` (random weights) and a stand-in tokenizer that pads to ``max_length`` the way the T5
tokenizer does (``</s>`` appended, ``<pad>`` = 0). A batch of two prompts of different lengths is encoded
with ``max_sequence_length=12``.
"""
import sys

import torch
from transformers import T5Config, T5EncoderModel

FIXED = "--fixed" in sys.argv


class TokenizerOutput(dict):
    __getattr__ = dict.__getitem__


class T5StandInTokenizer:
    """Word-level stand-in for T5TokenizerFast: ids from a fixed vocab, ``</s>`` = 1, ``<pad>`` = 0."""

    pad_token_id = 0
    eos_token_id = 1

    def __call__(self, prompt, padding="max_length", max_length=512, truncation=True,
                 return_length=False, return_overflowing_tokens=False, return_tensors="pt"):
        rows = []
        for text in prompt:
            ids = [3 + (sum(ord(c) for c in w) % 90) for w in text.split()][: max_length - 1]
            rows.append(ids + [self.eos_token_id])
        input_ids = torch.full((len(rows), max_length), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), max_length), dtype=torch.long)
        for i, ids in enumerate(rows):
            input_ids[i, : len(ids)] = torch.tensor(ids)
            attention_mask[i, : len(ids)] = 1
        return TokenizerOutput(input_ids=input_ids, attention_mask=attention_mask)


class ChromaPipelineT5Part:
    def __init__(self, text_encoder, tokenizer):
        self.text_encoder = text_encoder
        self.tokenizer = tokenizer

    def _get_t5_prompt_embeds(self, prompt, num_images_per_prompt=1, max_sequence_length=512,
                              device=None, dtype=None):
        device = device or torch.device("cpu")
        prompt = [prompt] if isinstance(prompt, str) else prompt
        batch_size = len(prompt)

        text_inputs = self.tokenizer(
            prompt,
            padding="max_length",
            max_length=max_sequence_length,
            truncation=True,
            return_length=False,
            return_overflowing_tokens=False,
            return_tensors="pt",
        )
        text_input_ids = text_inputs.input_ids
        if FIXED:
            tokenizer_mask = text_inputs.attention_mask
            tokenizer_mask_device = tokenizer_mask.to(device)

            # unlike Flux, Chroma uses the tokenizer's attention mask when generating the T5 embeddings
            prompt_embeds = self.text_encoder(
                text_input_ids.to(device),
                output_hidden_states=False,
                attention_mask=tokenizer_mask_device,
            )[0]

            dtype = self.text_encoder.dtype
            prompt_embeds = prompt_embeds.to(dtype=dtype, device=device)

            # for the text tokens, Chroma requires that all except the first padding token are masked out
            seq_lengths = tokenizer_mask_device.sum(dim=1)
            mask_indices = torch.arange(tokenizer_mask_device.size(1), device=device).unsqueeze(0).expand(batch_size, -1)
            attention_mask = (mask_indices <= seq_lengths.unsqueeze(1)).to(dtype=dtype, device=device)
        else:
            attention_mask = text_inputs.attention_mask.clone()

            seq_lengths = attention_mask.sum(dim=1)
            mask_indices = torch.arange(attention_mask.size(1)).unsqueeze(0).expand(batch_size, -1)
            attention_mask = (mask_indices <= seq_lengths.unsqueeze(1)).bool()

            prompt_embeds = self.text_encoder(
                text_input_ids.to(device), output_hidden_states=False, attention_mask=attention_mask.to(device)
            )[0]

            dtype = self.text_encoder.dtype
            prompt_embeds = prompt_embeds.to(dtype=dtype, device=device)
            attention_mask = attention_mask.to(device=device)

        _, seq_len, _ = prompt_embeds.shape

        # duplicate text embeddings and attention mask for each generation per prompt
        prompt_embeds = prompt_embeds.repeat(1, num_images_per_prompt, 1)
        prompt_embeds = prompt_embeds.view(batch_size * num_images_per_prompt, seq_len, -1)

        attention_mask = attention_mask.repeat(1, num_images_per_prompt)
        attention_mask = attention_mask.view(batch_size * num_images_per_prompt, seq_len)

        return prompt_embeds, attention_mask


def main():
    torch.manual_seed(0)
    config = T5Config(vocab_size=96, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                      relative_attention_num_buckets=8, feed_forward_proj="gated-gelu",
                      is_encoder_decoder=False, use_cache=False)
    pipe = ChromaPipelineT5Part(T5EncoderModel(config).eval(), T5StandInTokenizer())
    with torch.no_grad():
        prompt_embeds, attention_mask = pipe._get_t5_prompt_embeds(
            ["a cat sat on a mat", "a red fox jumps over the lazy dog"], max_sequence_length=12)
    print("prompt_embeds", tuple(prompt_embeds.shape), "transformer mask keeps",
          attention_mask.sum(1).tolist(), "tokens;", "embed[0,0,:3]",
          [round(v, 4) for v in prompt_embeds[0, 0, :3].tolist()])


if __name__ == "__main__":
    main()
