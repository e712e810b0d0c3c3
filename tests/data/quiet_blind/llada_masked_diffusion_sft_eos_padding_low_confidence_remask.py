"""LLaDA masked-diffusion LM: bidirectional attention, SFT with |EOS| padding that is attended, block remasking.

Follows ML-GSAI/LLaDA (https://github.com/ML-GSAI/LLaDA: generate.py ``generate`` /
``get_num_transfer_tokens`` / ``add_gumbel_noise`` and GUIDELINES.md's pre-training / SFT recipe) and its
modeling_llada.py, where the LLaMA-style blocks call scaled_dot_product_attention with ``is_causal=False`` and no mask.

Mask meant: every position attends to every position of its row, in both directions (mask-predictor, not an
autoregressive LM). In SFT the answers are padded with |EOS| tokens up to the batch length; these are *real*
targets (the model learns to emit EOS to stop), so they stay visible and are not masked out of attention; only the
prompt is kept clean and excluded from the loss. Generation fills a block of [MASK] tokens with semi-autoregressive
blocks, but attention inside each forward is still full over prompt + all blocks.
"""
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class ModelConfig:
    vocab_size: int = 64
    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 2
    mlp_hidden_size: int = 128
    max_sequence_length: int = 128
    mask_token_id: int = 63  # 126336 in the released tokenizer
    eos_token_id: int = 2
    rope_theta: float = 10000.0


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    def __init__(self, config):
        super().__init__()
        dim = config.d_model // config.n_heads
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2).float() / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, q, k):
        seq_len = q.shape[-2]
        t = torch.arange(seq_len, dtype=torch.float32)
        freqs = torch.outer(t, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos()[None, None], emb.sin()[None, None]
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


class LLaDALlamaBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.attn_norm = nn.RMSNorm(config.d_model)
        self.ff_norm = nn.RMSNorm(config.d_model)
        self.q_proj = nn.Linear(config.d_model, config.d_model, bias=False)
        self.k_proj = nn.Linear(config.d_model, config.d_model, bias=False)
        self.v_proj = nn.Linear(config.d_model, config.d_model, bias=False)
        self.attn_out = nn.Linear(config.d_model, config.d_model, bias=False)
        self.ff_proj = nn.Linear(config.d_model, config.mlp_hidden_size, bias=False)
        self.up_proj = nn.Linear(config.d_model, config.mlp_hidden_size, bias=False)
        self.ff_out = nn.Linear(config.mlp_hidden_size, config.d_model, bias=False)
        self.rotary_emb = RotaryEmbedding(config)

    def attention(self, q, k, v):
        B, T, C = q.shape
        h = self.config.n_heads
        q = q.view(B, T, h, C // h).transpose(1, 2)
        k = k.view(B, T, h, C // h).transpose(1, 2)
        v = v.view(B, T, h, C // h).transpose(1, 2)
        q, k = self.rotary_emb(q, k)
        # Mask predictor: no causal mask on purpose (LLaDA's _scaled_dot_product_attention(is_causal=False)).
        att = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False)
        return self.attn_out(att.transpose(1, 2).reshape(B, T, C))

    def forward(self, x):
        h = self.attn_norm(x)
        x = x + self.attention(self.q_proj(h), self.k_proj(h), self.v_proj(h))
        h = self.ff_norm(x)
        return x + self.ff_out(F.silu(self.ff_proj(h)) * self.up_proj(h))


class LLaDAModelLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.d_model)
        self.blocks = nn.ModuleList(LLaDALlamaBlock(config) for _ in range(config.n_layers))
        self.ln_f = nn.RMSNorm(config.d_model)
        self.ff_out = nn.Linear(config.d_model, config.vocab_size, bias=False)

    def forward(self, input_ids):
        x = self.wte(input_ids)
        for block in self.blocks:
            x = block(x)
        return self.ff_out(self.ln_f(x))


def forward_process(input_ids, mask_id, eps=1e-3):
    b, l = input_ids.shape
    t = torch.rand(b)
    p_mask = (1 - eps) * t + eps
    p_mask = p_mask[:, None].repeat(1, l)
    masked_indices = torch.rand((b, l)) < p_mask
    noisy_batch = torch.where(masked_indices, mask_id, input_ids)
    return noisy_batch, masked_indices, p_mask


def sft_loss(model, input_ids, prompt_lengths):
    """GUIDELINES.md SFT step: the prompt is never noised; padded |EOS| answers are noised and predicted."""
    config = model.config
    noisy_batch, _, p_mask = forward_process(input_ids, config.mask_token_id)
    token_positions = torch.arange(noisy_batch.shape[1]).expand(noisy_batch.size(0), noisy_batch.size(1))
    prompt_mask = token_positions < prompt_lengths.unsqueeze(1)
    noisy_batch[prompt_mask] = input_ids[prompt_mask]
    answer_lengths = (1 - prompt_mask.long()).sum(dim=-1, keepdim=True).repeat(1, noisy_batch.shape[1])
    masked_indices = noisy_batch == config.mask_token_id
    logits = model(input_ids=noisy_batch)
    token_loss = F.cross_entropy(logits[masked_indices], input_ids[masked_indices], reduction="none")
    token_loss = token_loss / p_mask[masked_indices]
    return torch.sum(token_loss / answer_lengths[masked_indices]) / input_ids.shape[0]


def add_gumbel_noise(logits, temperature):
    if temperature == 0:
        return logits
    logits = logits.to(torch.float64)
    noise = torch.rand_like(logits, dtype=torch.float64)
    gumbel_noise = (-torch.log(noise)) ** temperature
    return logits.exp() / gumbel_noise


def get_num_transfer_tokens(mask_index, steps):
    mask_num = mask_index.sum(dim=1, keepdim=True)
    base = mask_num // steps
    remainder = mask_num % steps
    num_transfer_tokens = torch.zeros(mask_num.size(0), steps, dtype=torch.int64) + base
    for i in range(mask_num.size(0)):
        num_transfer_tokens[i, : remainder[i]] += 1
    return num_transfer_tokens


@torch.no_grad()
def generate(model, prompt, steps=8, gen_length=16, block_length=8, temperature=0.0, mask_id=63):
    x = torch.full((prompt.shape[0], prompt.shape[1] + gen_length), mask_id, dtype=torch.long)
    x[:, : prompt.shape[1]] = prompt.clone()
    assert gen_length % block_length == 0
    num_blocks = gen_length // block_length
    steps = steps // num_blocks
    for num_block in range(num_blocks):
        start = prompt.shape[1] + num_block * block_length
        block_mask_index = x[:, start : start + block_length] == mask_id
        num_transfer_tokens = get_num_transfer_tokens(block_mask_index, steps)
        for i in range(steps):
            mask_index = x == mask_id
            logits = model(x)
            x0 = torch.argmax(add_gumbel_noise(logits, temperature), dim=-1)
            p = F.softmax(logits, dim=-1)
            x0_p = torch.gather(p, dim=-1, index=x0.unsqueeze(-1)).squeeze(-1)
            x0_p[:, start + block_length :] = -math.inf  # low_confidence remasking, later blocks wait
            x0 = torch.where(mask_index, x0, x)
            confidence = torch.where(mask_index, x0_p, torch.tensor(-math.inf))
            transfer_index = torch.zeros_like(x0, dtype=torch.bool)
            for j in range(confidence.shape[0]):
                _, select_index = torch.topk(confidence[j], k=int(num_transfer_tokens[j, i]))
                transfer_index[j, select_index] = True
            x[transfer_index] = x0[transfer_index]
    return x


def main():
    torch.manual_seed(0)
    config = ModelConfig()
    model = LLaDAModelLM(config).eval()

    # SFT batch: prompt + answer, answers padded with |EOS| (eos_token_id) to the longest row.
    eos = config.eos_token_id
    rows = [([5, 6, 7, 8], [9, 10, 11, eos]), ([12, 13], [14, 15, 16, 17, 18, 19, eos])]
    total = max(len(p) + len(a) for p, a in rows)
    input_ids = torch.full((len(rows), total), eos, dtype=torch.long)
    for i, (p, a) in enumerate(rows):
        input_ids[i, : len(p) + len(a)] = torch.tensor(p + a)
    prompt_lengths = torch.tensor([len(p) for p, _ in rows])
    loss = sft_loss(model, input_ids, prompt_lengths)
    assert torch.isfinite(loss)

    # Reference: one block's attention equals an explicit softmax over all keys (no mask at all).
    block = model.blocks[0]
    h = block.attn_norm(model.wte(input_ids))
    q, k, v = block.q_proj(h), block.k_proj(h), block.v_proj(h)
    B, T, C = q.shape
    nh = config.n_heads
    qh, kh = block.rotary_emb(q.view(B, T, nh, -1).transpose(1, 2), k.view(B, T, nh, -1).transpose(1, 2))
    vh = v.view(B, T, nh, -1).transpose(1, 2)
    ref = torch.softmax(qh @ kh.transpose(-1, -2) / math.sqrt(C // nh), dim=-1) @ vh
    ref = block.attn_out(ref.transpose(1, 2).reshape(B, T, C))
    assert torch.allclose(block.attention(q, k, v), ref, atol=1e-5)

    prompt = torch.tensor([[5, 6, 7, 8], [12, 13, 20, 21]])
    out = generate(model, prompt, steps=8, gen_length=16, block_length=8, mask_id=config.mask_token_id)
    assert not (out == config.mask_token_id).any()
    assert torch.equal(out[:, :4], prompt)
    print(f"sft loss {loss.item():.3f}; generated {tuple(out.shape)}")


if __name__ == "__main__":
    main()
