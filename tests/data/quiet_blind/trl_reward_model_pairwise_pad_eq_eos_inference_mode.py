"""Pairwise reward-model scoring under torch.inference_mode(), as TRL's RewardTrainer and HF's
*ForSequenceClassification do it.

Follows huggingface/trl trl/trainer/reward_trainer.py (compute_loss: chosen and rejected batches, loss
-logsigmoid(r_c - r_r)) and the pooling of huggingface/transformers LlamaForSequenceClassification.forward
(`non_pad_mask = input_ids != pad_token_id`, last non-pad token by `(token_indices * non_pad_mask).argmax(-1)`).
Sequences are right-padded and the tokenizer has pad == eos, so the final eos counts as padding for pooling but is
attended (attention_mask is 1 on it). The decoder uses SDPA with causal & key-padding as one boolean mask; right
padding keeps every real query row non-empty. Scoring happens in eval under inference_mode (an RL reward call).
"""
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class RewardConfig:
    vocab_size: int = 32
    n_embd: int = 32
    n_head: int = 4
    n_layer: int = 2
    n_positions: int = 16
    pad_token_id: int = 0
    eos_token_id: int = 0


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.n_head = cfg.n_head
        self.ln_1, self.ln_2 = nn.LayerNorm(cfg.n_embd), nn.LayerNorm(cfg.n_embd)
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.mlp = nn.Sequential(nn.Linear(cfg.n_embd, 4 * cfg.n_embd), nn.GELU(), nn.Linear(4 * cfg.n_embd, cfg.n_embd))

    def forward(self, x, attn_mask):
        B, T, C = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = (z.view(B, T, self.n_head, -1).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        x = x + self.c_proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.mlp(self.ln_2(x))


class GPTForSequenceClassification(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.n_positions, cfg.n_embd)
        self.h = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.score = nn.Linear(cfg.n_embd, 1, bias=False)

    def forward(self, input_ids, attention_mask):
        B, T = input_ids.shape
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        attn_mask = (causal[None] & attention_mask.bool()[:, None, :])[:, None]  # [B, 1, T, T]
        x = self.wte(input_ids) + self.wpe(torch.arange(T))
        for block in self.h:
            x = block(x, attn_mask)
        logits = self.score(self.ln_f(x)).squeeze(-1)  # [B, T]
        non_pad_mask = (input_ids != self.config.pad_token_id).int()
        token_indices = torch.arange(T)
        last_non_pad_token = (token_indices * non_pad_mask).argmax(-1)
        return logits[torch.arange(B), last_non_pad_token]


def right_pad(seqs, pad):
    T = max(map(len, seqs))
    ids = torch.tensor([s + [pad] * (T - len(s)) for s in seqs])
    mask = torch.tensor([[1] * len(s) + [0] * (T - len(s)) for s in seqs])
    return ids, mask


def main():
    torch.manual_seed(0)
    cfg = RewardConfig()
    model = GPTForSequenceClassification(cfg).eval()
    eos = cfg.eos_token_id
    chosen = [[3, 4, 5, 6, 7, eos], [8, 9, 10, eos], [11, 12, 13, 14, 15, 16, 17, eos]]
    rejected = [[3, 4, 5, 19, eos], [8, 9, 21, 22, 23, 24, eos], [11, 12, eos]]
    with torch.inference_mode():
        ids_c, mask_c = right_pad(chosen, cfg.pad_token_id)
        ids_r, mask_r = right_pad(rejected, cfg.pad_token_id)
        rewards_chosen = model(ids_c, mask_c)
        rewards_rejected = model(ids_r, mask_r)
        loss = -F.logsigmoid(rewards_chosen - rewards_rejected).mean()
        # reference: each sequence alone, no padding, pooled at the token before its eos
        for seqs, rewards in ((chosen, rewards_chosen), (rejected, rewards_rejected)):
            for b, s in enumerate(seqs):
                ids = torch.tensor([s])
                alone = model(ids, torch.ones_like(ids))
                assert torch.allclose(rewards[b], alone[0], atol=1e-5), b
    print(f"reward loss {loss.item():.4f} accuracy {(rewards_chosen > rewards_rejected).float().mean().item():.2f}")


if __name__ == "__main__":
    main()
