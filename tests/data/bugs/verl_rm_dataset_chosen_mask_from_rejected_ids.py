"""verl RMDataset: the chosen row's attention_mask is the rejected row's input_ids (verl-project/verl#1411).

Citation: verl-project/verl PR #1411 "Fix for RM Data Attention Mask Bug" (mentioned earlier in issue #1341),
merged as commit a43ead6f8. Read in the upstream git history: verl/utils/dataset/rm_dataset.py before and after
a43ead6f8 (a one-line fix). Issue #1341 itself was not read.

Bug: `RMDataset.__getitem__` builds the chosen and rejected sequences (prompt + response + eos), pads each to
`max_length` with zeros, then stacks
`attention_mask = torch.stack((rejected_input_ids, rejected_attention_mask), dim=0)`: row 0 (chosen) gets the
*token ids* of the rejected sequence as its mask. Where the rejected sequence is padded, the chosen row's real
tokens are masked out; where it is not, the mask holds token ids instead of 1.

Fix: `attention_mask = torch.stack((chosen_attention_mask, rejected_attention_mask), dim=0)`.

This program: the pre-fix `RMDataset` (fed from in-memory lists instead of parquet files, and a character-level
tokenizer instead of an HF one, so nothing is downloaded), a default collate, and a small Llama-style reward model
whose decoder turns the 2-D `attention_mask` into a 4-D additive mask the way transformers 4.4x's
`_prepare_4d_causal_attention_mask` did (`1 - mask`, every nonzero entry filled with the dtype minimum, plus the
causal part), then eager softmax attention. The chosen response is longer than the rejected one, so the buggy
mask hides the chosen row's tail. Prints the Bradley-Terry loss.
"""

import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

FIXED = "--fixed" in sys.argv


class CharTokenizer:
    """Stand-in for the HF tokenizer verl loads: ids 3.. for characters, 0 pad, 2 eos."""

    pad_token_id = 0
    eos_token_id = 2

    def __call__(self, text, return_tensors="pt"):
        return {"input_ids": torch.tensor([[3 + (ord(c) % 60) for c in text]])}


class RMDataset(Dataset):
    def __init__(self, records, tokenizer, prompt_key="prompt", chosen_key="chosen", rejected_key="rejected",
                 max_length=1024, add_eos=True):
        self.tokenizer = tokenizer
        self.prompt_key = prompt_key
        self.chosen_key = chosen_key
        self.rejected_key = rejected_key
        self.add_eos = add_eos
        self.max_length = max_length
        self.prompts = [r[prompt_key] for r in records]
        self.chosen_responses = [r[chosen_key] for r in records]
        self.rejected_responses = [r[rejected_key] for r in records]

    def __len__(self):
        return len(self.prompts)

    def _pad_to_length(self, input_ids, attention_mask):
        curr_length = input_ids.shape[-1]
        if curr_length < self.max_length:
            input_ids = torch.cat((input_ids, torch.zeros(size=(self.max_length - curr_length,), dtype=input_ids.dtype)), dim=-1)
            attention_mask = torch.cat(
                (attention_mask, torch.zeros(size=(self.max_length - curr_length,), dtype=attention_mask.dtype)), dim=-1
            )
        elif curr_length > self.max_length:
            input_ids = input_ids[: self.max_length]
            attention_mask = attention_mask[: self.max_length]
        return input_ids, attention_mask

    def __getitem__(self, item):
        prompt = self.prompts[item]
        chosen_response = self.chosen_responses[item]
        rejected_response = self.rejected_responses[item]

        prompt_ids = self.tokenizer(prompt, return_tensors="pt")["input_ids"][0]
        chosen_response_ids = self.tokenizer(chosen_response, return_tensors="pt")["input_ids"][0]
        rejected_response_ids = self.tokenizer(rejected_response, return_tensors="pt")["input_ids"][0]

        if self.add_eos:
            chosen_response_ids = torch.cat((chosen_response_ids, torch.tensor([self.tokenizer.eos_token_id])), dim=-1)
            rejected_response_ids = torch.cat((rejected_response_ids, torch.tensor([self.tokenizer.eos_token_id])), dim=-1)

        chosen_input_ids = torch.cat((prompt_ids, chosen_response_ids), dim=-1)
        chosen_attention_mask = torch.ones_like(chosen_input_ids)

        rejected_input_ids = torch.cat((prompt_ids, rejected_response_ids), dim=-1)
        rejected_attention_mask = torch.ones_like(rejected_input_ids)

        chosen_input_ids, chosen_attention_mask = self._pad_to_length(chosen_input_ids, chosen_attention_mask)
        rejected_input_ids, rejected_attention_mask = self._pad_to_length(rejected_input_ids, rejected_attention_mask)

        input_ids = torch.stack((chosen_input_ids, rejected_input_ids), dim=0)
        if FIXED:
            attention_mask = torch.stack((chosen_attention_mask, rejected_attention_mask), dim=0)
        else:
            attention_mask = torch.stack((rejected_input_ids, rejected_attention_mask), dim=0)

        return {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
        }


def _prepare_4d_causal_attention_mask(attention_mask, input_shape, dtype):
    """transformers 4.4x AttentionMaskConverter: causal part plus the inverted, expanded 2-D padding mask."""
    bsz, tgt_len = input_shape
    min_value = torch.finfo(dtype).min
    causal = torch.full((tgt_len, tgt_len), min_value, dtype=dtype).triu(1)[None, None]
    expanded_mask = attention_mask[:, None, None, :].expand(bsz, 1, tgt_len, tgt_len).to(dtype)
    inverted_mask = 1.0 - expanded_mask
    padding = inverted_mask.masked_fill(inverted_mask.to(torch.bool), min_value)
    return (causal + padding).clamp(min=min_value)


class DecoderLayer(nn.Module):
    def __init__(self, hidden_size, num_heads):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, hidden_size // num_heads
        self.input_layernorm = nn.RMSNorm(hidden_size)
        self.post_attention_layernorm = nn.RMSNorm(hidden_size)
        self.qkv_proj = nn.Linear(hidden_size, 3 * hidden_size, bias=False)
        self.o_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.mlp = nn.Sequential(nn.Linear(hidden_size, 2 * hidden_size), nn.SiLU(), nn.Linear(2 * hidden_size, hidden_size))

    def forward(self, hidden_states, attention_mask):
        b, n, _ = hidden_states.shape
        q, k, v = self.qkv_proj(self.input_layernorm(hidden_states)).view(b, n, 3, self.num_heads, self.head_dim).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        attn_weights = q @ k.transpose(2, 3) / self.head_dim**0.5 + attention_mask
        attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.float32)
        out = (attn_weights @ v).transpose(1, 2).reshape(b, n, -1)
        hidden_states = hidden_states + self.o_proj(out)
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class RewardModel(nn.Module):
    """Token-classification reward model (num_labels=1); the reward is read at the last non-pad token."""

    def __init__(self, vocab_size=64, hidden_size=32, num_heads=4, num_layers=2, max_position=64):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab_size, hidden_size)
        self.embed_positions = nn.Embedding(max_position, hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(hidden_size, num_heads) for _ in range(num_layers))
        self.norm = nn.RMSNorm(hidden_size)
        self.score = nn.Linear(hidden_size, 1, bias=False)

    def forward(self, input_ids, attention_mask):
        positions = torch.arange(input_ids.shape[1])[None]
        hidden_states = self.embed_tokens(input_ids) + self.embed_positions(positions)
        causal_mask = _prepare_4d_causal_attention_mask(attention_mask, input_ids.shape, hidden_states.dtype)
        for layer in self.layers:
            hidden_states = layer(hidden_states, causal_mask)
        return self.score(self.norm(hidden_states)).squeeze(-1)


def main():
    torch.manual_seed(0)
    records = [
        {"prompt": "2+3=", "chosen": "5, since 2+3 is 5", "rejected": "6"},
        {"prompt": "capital of France?", "chosen": "Paris", "rejected": "Lyon, I think"},
    ]
    dataset = RMDataset(records, CharTokenizer(), max_length=24)
    batch = next(iter(DataLoader(dataset, batch_size=2)))
    input_ids = batch["input_ids"].view(-1, dataset.max_length)  # (2 * batch, L): chosen, rejected, chosen, ...
    attention_mask = batch["attention_mask"].view(-1, dataset.max_length)
    model = RewardModel()
    with torch.no_grad():
        token_rewards = model(input_ids, attention_mask)
    last = (input_ids != CharTokenizer.pad_token_id).sum(-1) - 1
    rewards = token_rewards.gather(1, last[:, None]).squeeze(1).view(-1, 2)
    loss = -F.logsigmoid(rewards[:, 0] - rewards[:, 1]).mean()
    print(f"rewards {rewards.flatten().tolist()}\nBradley-Terry loss: {loss.item():.6f}")


if __name__ == "__main__":
    main()
