"""IDEFICS processor: with padding="longest" the attention mask marks the tokenizer's left pads as real.

Citation: huggingface/transformers#28591 "Idefics - AttentionMasks wrongly set with padding='longest'",
fixed by huggingface/transformers#29449 "[ProcessingIdefics] Attention mask bug with padding" (merged).
Bug: ``IdeficsProcessor.__call__`` tokenized all prompts with the caller's ``padding`` (the tokenizer
pads on the left), then padded them *again* by hand: ``unpadded_seq_len = len(text)``,
``start = max_seq_len - unpadded_seq_len``, ``attention_mask[start:] = 1``. After the tokenizer has
padded, every ``text`` already has length ``max_seq_len``, so ``start`` is 0 and the mask is all
ones: the shorter prompt's pad tokens are attended to by every later token.
Fix: drop the hand padding and keep the tokenizer's padded ``input_ids`` and ``attention_mask``.
Reproduction: the processor loop as it was (a small whitespace tokenizer with left padding stands in
for the LLaMA tokenizer), followed by an IDEFICS-style decoder whose attention layers combine the
padding mask with the causal mask into a 4D additive mask for F.scaled_dot_product_attention
(as IdeficsAttention does). Batch of two prompts, the second 4 tokens shorter. I read the issue and
the PR description; the pre-fix loop is the processing_idefics.py code the PR removed.
"""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


class LeftPaddingTokenizer:
    pad_token_id = 0
    padding_side = "left"

    def __init__(self):
        self.vocab = {"<pad>": 0, "<s>": 1, "<image>": 32001, "<fake_token_around_image>": 32000}

    def _id(self, word):
        return self.vocab.setdefault(word, 2 + len(self.vocab))

    def __call__(self, text, add_special_tokens=False, padding=False, truncation=None, max_length=None):
        ids = [[self._id(w) for w in t.split()] for t in text]
        masks = [[1] * len(x) for x in ids]
        if padding in (True, "longest"):
            longest = max(len(x) for x in ids)
            masks = [[0] * (longest - len(x)) + m for x, m in zip(ids, masks)]
            ids = [[self.pad_token_id] * (longest - len(x)) + x for x in ids]
        return {"input_ids": ids, "attention_mask": masks}


class IdeficsProcessor:
    def __init__(self, tokenizer, image_token_id=32001):
        self.tokenizer = tokenizer
        self.image_token_id = image_token_id

    def __call__(self, prompts, padding="longest", truncation=None, max_length=None):
        text_encoding = self.tokenizer(text=prompts, add_special_tokens=False, padding=padding,
                                       truncation=truncation, max_length=max_length)
        all_texts = text_encoding["input_ids"]
        all_attention_masks = text_encoding["attention_mask"]
        max_seq_len = max(len(x) for x in all_texts)
        output_input_ids = []
        output_attention_masks = []
        if FIXED:
            for text, attention_mask in zip(all_texts, all_attention_masks):
                output_input_ids.append(torch.tensor(text))
                output_attention_masks.append(torch.tensor(attention_mask))
        else:
            for text in all_texts:
                padded_input_ids = [self.tokenizer.pad_token_id] * max_seq_len
                unpadded_seq_len = len(text)
                start = max_seq_len - unpadded_seq_len
                padded_input_ids[start:] = text[:max_seq_len]

                attention_mask = torch.zeros((max_seq_len,), dtype=torch.long)
                attention_mask[start:] = 1
                output_input_ids.append(torch.tensor(padded_input_ids))
                output_attention_masks.append(attention_mask)
        return {"input_ids": torch.stack(output_input_ids), "attention_mask": torch.stack(output_attention_masks)}


def _prepare_4d_causal_attention_mask(attention_mask, input_shape, dtype):
    bsz, tgt_len = input_shape
    min_value = torch.finfo(dtype).min
    causal = torch.full((tgt_len, tgt_len), min_value, dtype=dtype).triu(1)
    expanded = attention_mask[:, None, None, :].to(dtype)
    inverted = (1.0 - expanded).masked_fill((1.0 - expanded).bool(), min_value)
    return (causal[None, None] + inverted).clamp(min=min_value)


class IdeficsAttention(nn.Module):
    def __init__(self, hidden_size, num_heads):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = hidden_size // num_heads
        self.q_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.k_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.v_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.o_proj = nn.Linear(hidden_size, hidden_size, bias=False)

    def forward(self, hidden_states, attention_mask):
        bsz, q_len, _ = hidden_states.size()
        q = self.q_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        attn_output = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, dropout_p=0.0)
        return self.o_proj(attn_output.transpose(1, 2).reshape(bsz, q_len, -1))


class IdeficsModel(nn.Module):
    def __init__(self, vocab_size=32002, hidden_size=32, num_heads=4, num_layers=2):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab_size, hidden_size, padding_idx=0)
        self.layers = nn.ModuleList([IdeficsAttention(hidden_size, num_heads) for _ in range(num_layers)])
        self.norm = nn.LayerNorm(hidden_size)

    def forward(self, input_ids, attention_mask):
        hidden_states = self.embed_tokens(input_ids)
        mask = _prepare_4d_causal_attention_mask(attention_mask, input_ids.shape, hidden_states.dtype)
        for layer in self.layers:
            hidden_states = hidden_states + layer(self.norm(hidden_states), mask)
        return hidden_states


def main():
    torch.manual_seed(0)
    processor = IdeficsProcessor(LeftPaddingTokenizer())
    prompts = [
        "<s> User: What is in this image? <fake_token_around_image> <image> <fake_token_around_image> Assistant:",
        "<s> User: Describe <fake_token_around_image> <image> <fake_token_around_image> Assistant:",
    ]
    inputs = processor(prompts, padding="longest")
    model = IdeficsModel().eval()
    with torch.no_grad():
        out = model(**inputs)
    print("fixed" if FIXED else "buggy", inputs["attention_mask"].sum(-1).tolist(), f"{out[1, -1].abs().mean().item():.6f}")


if __name__ == "__main__":
    main()
