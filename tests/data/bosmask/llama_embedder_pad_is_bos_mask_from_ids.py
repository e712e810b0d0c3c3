"""A decoder used as a sentence embedder (mean of the last hidden states over the real tokens), its tokenizer given
the BOS as its pad token, as LLM2Vec-style recipes do when a Llama tokenizer has none (written here after FastChat
0f8692b2's GritLM embeddings; another model, a causal one, and transformers' Llama).

Buggy: the mask is built as `input_ids != pad_token_id`, which with pad == BOS also marks every row's BOS padding, so
no text token attends the row's first token. Fixed (--fixed): the BOS column is kept (`attention_mask[:, 0] = 1`).
"""

import sys

import torch
from transformers import LlamaConfig, LlamaModel

FIXED = "--fixed" in sys.argv
BOS = PAD = 1


def main():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, bos_token_id=BOS, pad_token_id=PAD, eos_token_id=2)
    model = LlamaModel(config).eval()
    texts = [[12, 30, 41, 7, 9, 22], [5, 17, 33], [40, 8, 11, 19]]
    width = 1 + max(len(t) for t in texts)
    input_ids = torch.tensor([[BOS] + t + [PAD] * (width - 1 - len(t)) for t in texts])  # right padding
    attention_mask = (input_ids != PAD).long()
    if FIXED:
        attention_mask[:, 0] = 1
    with torch.no_grad():
        hidden = model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    weights = attention_mask.unsqueeze(-1).float()
    embeddings = (hidden * weights).sum(1) / weights.sum(1)
    print("embedding norms", [round(x, 4) for x in embeddings.norm(dim=-1).tolist()])


if __name__ == "__main__":
    main()
