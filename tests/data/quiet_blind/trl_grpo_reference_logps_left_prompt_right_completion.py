"""Reference-model log-probs for GRPO, as huggingface/trl GRPOTrainer computes them (trl/trainer/grpo_trainer.py).

Prompts are left-padded, completions right-padded, and the tokenizer's pad token is its eos (pad == eos), so the
completion mask is built from the FIRST eos of each completion (`is_eos.int().argmax(1)`), not from `!= pad`:
the eos that ends a completion counts, the pad copies after it do not. `attention_mask = cat(prompt_mask,
completion_mask)`; the model turns it into causal & key-padding with an additive `finfo.min` bias (HF eager style)
and position ids from `cumsum - 1`. The reference model runs under torch.inference_mode(); only the last
`logits_to_keep` positions are scored. A left-pad query row sees no real key; its output is never used.
"""
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class TinyLlamaConfig:
    vocab_size: int = 40
    hidden_size: int = 32
    num_attention_heads: int = 4
    num_hidden_layers: int = 2
    rope_theta: float = 10000.0
    eos_token_id: int = 2
    pad_token_id: int = 2  # pad == eos, as for many chat tokenizers


def rope(x, position_ids, theta):
    d = x.size(-1)
    inv = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)
    ang = position_ids[:, None, :, None].float() * inv  # [B, 1, T, d/2]
    cos, sin = ang.cos().repeat_interleave(2, -1), ang.sin().repeat_interleave(2, -1)
    x2 = torch.stack((-x[..., 1::2], x[..., ::2]), -1).flatten(-2)
    return x * cos + x2 * sin


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.h = cfg.num_attention_heads
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=False)
        self.o = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)
        self.mlp = nn.Sequential(nn.Linear(cfg.hidden_size, 64), nn.SiLU(), nn.Linear(64, cfg.hidden_size))
        self.n1, self.n2 = nn.RMSNorm(cfg.hidden_size), nn.RMSNorm(cfg.hidden_size)
        self.theta = cfg.rope_theta

    def forward(self, x, bias, position_ids):
        B, T, C = x.shape
        q, k, v = self.qkv(self.n1(x)).view(B, T, 3, self.h, C // self.h).permute(2, 0, 3, 1, 4)
        q, k = rope(q, position_ids, self.theta), rope(k, position_ids, self.theta)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        x = x + self.o(y.transpose(1, 2).reshape(B, T, C))
        return x + self.mlp(self.n2(x))


class TinyLlamaForCausalLM(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_hidden_layers))
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.cfg = cfg

    def forward(self, input_ids, attention_mask, logits_to_keep=0):
        T = input_ids.size(1)
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        allowed = causal[None] & attention_mask.bool()[:, None, :]
        bias = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)[:, None]
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x, bias, position_ids)
        x = x[:, -logits_to_keep:] if logits_to_keep else x
        return self.lm_head(x)


def selective_log_softmax(logits, index):
    return torch.gather(logits.log_softmax(-1), -1, index.unsqueeze(-1)).squeeze(-1)


def get_per_token_logps(model, input_ids, attention_mask, logits_to_keep):
    logits = model(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=logits_to_keep + 1)
    logits = logits[:, :-1, :]  # the last logit predicts past the sequence
    return selective_log_softmax(logits, input_ids[:, -logits_to_keep:])


def main():
    torch.manual_seed(0)
    cfg = TinyLlamaConfig()
    eos = cfg.eos_token_id
    ref_model = TinyLlamaForCausalLM(cfg).eval()
    prompts = [[5, 6, 7, 8, 9], [11, 12], [13, 14, 15]]
    completions = [[20, 21, eos], [22, 23, 24, 25, 26, 27], [28, eos]]
    P = max(map(len, prompts))
    N = max(map(len, completions))
    prompt_ids = torch.tensor([[cfg.pad_token_id] * (P - len(p)) + p for p in prompts])
    prompt_mask = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in prompts])
    completion_ids = torch.tensor([c + [cfg.pad_token_id] * (N - len(c)) for c in completions])
    # mask everything after the first eos (the eos itself is kept)
    is_eos = completion_ids == eos
    eos_idx = torch.full((is_eos.size(0),), is_eos.size(1), dtype=torch.long)
    eos_idx[is_eos.any(dim=1)] = is_eos.int().argmax(dim=1)[is_eos.any(dim=1)]
    sequence_indices = torch.arange(is_eos.size(1)).expand(is_eos.size(0), -1)
    completion_mask = (sequence_indices <= eos_idx.unsqueeze(1)).int()
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
    with torch.inference_mode():
        ref_logps = get_per_token_logps(ref_model, input_ids, attention_mask, N)
        # independent check: each sample alone, without any padding
        for b, (p, c) in enumerate(zip(prompts, completions)):
            ids = torch.tensor([p + c])
            alone = get_per_token_logps(ref_model, ids, torch.ones_like(ids), len(c))
            assert torch.allclose(ref_logps[b, : len(c)], alone[0], atol=1e-5), b
    assert completion_mask.tolist() == [[1, 1, 1, 0, 0, 0], [1] * 6, [1, 1, 0, 0, 0, 0]]
    per_token_logps = ref_logps + 0.01 * torch.randn_like(ref_logps)  # stand-in for the policy
    per_token_kl = torch.exp(ref_logps - per_token_logps) - (ref_logps - per_token_logps) - 1
    kl = ((per_token_kl * completion_mask).sum(1) / completion_mask.sum(1)).mean()
    print(f"mean kl {kl.item():.6f}")


if __name__ == "__main__":
    main()
