# qdrant/fastembed PR #680 (fix of last_token_pooling added in #678): Qwen3 embedding pooling.
# last_token_pooling took index attention_mask.sum()-1, which for the left-padded Qwen3 tokenizer
# lands on a pad / mid-sequence position instead of the last real token.
import sys

import numpy as np
import torch
from transformers import Qwen3Config, Qwen3Model

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def normalize(input_array, p=2, dim=1, eps=1e-12):
    norm = np.linalg.norm(input_array, ord=p, axis=dim, keepdims=True)
    norm = np.maximum(norm, eps)
    return input_array / norm


def last_token_pooling(input_array, attention_mask):
    """Take the embedding of the last non-padding token of each sequence."""
    if FIXED:
        last_token_indices = attention_mask.shape[1] - 1 - np.argmax(attention_mask[:, ::-1], axis=1)
    else:
        last_token_indices = np.maximum(attention_mask.sum(axis=1) - 1, 0)
    return input_array[np.arange(input_array.shape[0]), last_token_indices]


# stands in for the ONNX session of Qwen/Qwen3-Embedding-0.6B (random weights, tiny)
config = Qwen3Config(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, pad_token_id=0)
model = Qwen3Model(config).eval()


def tokenize_left_padded(seqs):
    # Qwen3 tokenizer pads on the left
    L = max(len(s) for s in seqs)
    ids = np.zeros((len(seqs), L), dtype=np.int64)
    mask = np.zeros((len(seqs), L), dtype=np.int64)
    for i, s in enumerate(seqs):
        ids[i, L - len(s):] = s
        mask[i, L - len(s):] = 1
    return ids, mask


def embed(seqs):
    input_ids, attention_mask = tokenize_left_padded(seqs)
    with torch.no_grad():
        out = model(input_ids=torch.from_numpy(input_ids),
                    attention_mask=torch.from_numpy(attention_mask)).last_hidden_state.numpy()
    # _post_process_onnx_output
    return normalize(last_token_pooling(out, attention_mask))


g = torch.Generator().manual_seed(1)
docs = [torch.randint(1, 100, (n,), generator=g).tolist() for n in (12, 5, 8)]
batched = embed(docs)
single = np.concatenate([embed([d]) for d in docs])
print(f"max |batched - one-by-one| embedding diff: {np.abs(batched - single).max():.6f}")
