"""Model Optimizer PTQ calibration: the dataloader keeps input_ids only, padding attended.

Citation: NVIDIA/Model-Optimizer#1261, "Fix missing attention_mask in calibration dataloader"
(merged). In modelopt/torch/utils/dataset_utils.py, `get_dataset_dataloader` tokenizes the
calibration samples with `padding=True` (left padding is what the function recommends), but with
`include_labels=False` (the PTQ default) it built the dataset from `{"input_ids": ...}` only,
"for backward compatibility", dropping the tokenizer's attention_mask. The forward loop unpacks
each batch as `model(**batch)`, so the model saw no mask, built a plain causal mask and the
padded rows attended to their pad tokens, skewing the activation statistics collected for
quantization. The fix keeps `attention_mask` next to `input_ids`.

This program: a byte-level tokenizer that left-pads with the EOS id, the dataloader as the
project wrote it, the `_forward_loop` / `_process_batch` calibration loop, and a small
Llama-style causal LM (random weights) whose attention builds its 4-D mask from the
`attention_mask` argument (causal when None) and calls F.scaled_dot_product_attention.
Max calibrators on the attention output projections record amax per batch. Samples of
different lengths in one batch of 3 make the left padding 2-9 tokens long.
"""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

FIXED = "--fixed" in sys.argv


class ByteTokenizer:
    """Bytes + 3; the EOS token doubles as the pad token, padding on the left."""

    eos_token_id = 2
    pad_token_id = 2
    padding_side = "left"

    def __call__(self, texts, return_tensors="pt", padding=True, truncation=True, max_length=64):
        ids = [[b + 3 for b in t.encode()][:max_length] for t in texts]
        width = max(len(x) for x in ids)
        input_ids, attention_mask = [], []
        for x in ids:
            pad = width - len(x)
            input_ids.append([self.pad_token_id] * pad + x)
            attention_mask.append([0] * pad + [1] * len(x))
        return {"input_ids": torch.tensor(input_ids), "attention_mask": torch.tensor(attention_mask)}


class _CustomDataset(Dataset):
    def __init__(self, encodings):
        self.encodings = encodings

    def __getitem__(self, idx):
        return {key: torch.as_tensor(val[idx]) for key, val in self.encodings.items()}

    def __len__(self):
        return len(next(iter(self.encodings.values())))


def get_dataset_dataloader(samples, tokenizer, batch_size=3, max_sample_length=64, include_labels=False):
    batch_encoded = tokenizer(samples, return_tensors="pt", padding=True, truncation=True,
                              max_length=max_sample_length)
    if include_labels:
        labels = torch.where(batch_encoded["attention_mask"] > 0.5, batch_encoded["input_ids"], -100)
        batch_encoded["labels"] = labels
        tokenized_dataset = _CustomDataset(batch_encoded)
    elif FIXED:
        tokenized_dataset = _CustomDataset(
            {"input_ids": batch_encoded["input_ids"], "attention_mask": batch_encoded["attention_mask"]}
        )
    else:
        # For backward compatibility, if labels are not needed, we only return input_ids.
        tokenized_dataset = _CustomDataset({"input_ids": batch_encoded["input_ids"]})
    return DataLoader(tokenized_dataset, batch_size=batch_size, shuffle=False)


class LlamaAttention(nn.Module):
    def __init__(self, hidden_size, num_heads):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, hidden_size // num_heads
        self.q_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.k_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.v_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.o_proj = nn.Linear(hidden_size, hidden_size, bias=False)

    def forward(self, hidden_states, attention_mask):
        b, t, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden_states).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, hidden_size, num_heads):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(hidden_size)
        self.self_attn = LlamaAttention(hidden_size, num_heads)
        self.post_attention_layernorm = nn.RMSNorm(hidden_size)
        self.mlp = nn.Sequential(nn.Linear(hidden_size, 4 * hidden_size), nn.SiLU(), nn.Linear(4 * hidden_size, hidden_size))

    def forward(self, x, attention_mask):
        x = x + self.self_attn(self.input_layernorm(x), attention_mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    def __init__(self, vocab_size=259, hidden_size=32, num_heads=4, num_layers=2):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab_size, hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(hidden_size, num_heads) for _ in range(num_layers))
        self.norm = nn.RMSNorm(hidden_size)
        self.lm_head = nn.Linear(hidden_size, vocab_size, bias=False)

    def forward(self, input_ids, attention_mask=None, labels=None):
        b, t = input_ids.shape
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        if attention_mask is None:
            # No padding information: every key up to the query is real.
            mask = causal[None, None].expand(b, 1, t, t)
        else:
            mask = causal[None, None] & attention_mask[:, None, None, :].bool()
            # A left pad query sees no key at all; let it see itself so softmax stays finite.
            mask = mask | torch.eye(t, dtype=torch.bool)[None, None]
        h = self.embed_tokens(input_ids)
        for layer in self.layers:
            h = layer(h, mask)
        return self.lm_head(self.norm(h))


def _process_batch(batch_data, infer_method):
    return infer_method(**batch_data)


def _forward_loop(model, dataloader):
    with torch.no_grad():
        for batch in dataloader:
            _process_batch(batch, model)


def main():
    torch.manual_seed(0)
    model = LlamaForCausalLM().eval()
    amax = {}

    def max_calibrator(name):
        def hook(module, args):
            amax[name] = max(amax.get(name, 0.0), args[0].abs().max().item())
        return hook

    for i, layer in enumerate(model.layers):
        layer.self_attn.o_proj.register_forward_pre_hook(max_calibrator(f"layers.{i}.self_attn.o_proj"))

    samples = ["The cat sat.", "A much longer calibration sample", "Short", "hi",
               "Quantization needs ranges", "ok then"]
    loader = get_dataset_dataloader(samples, ByteTokenizer(), batch_size=3)
    _forward_loop(model, loader)
    print("fixed" if FIXED else "buggy", {k: round(v, 4) for k, v in amax.items()})


if __name__ == "__main__":
    main()
