"""OpenRLHF packed reward / critic forward: attention_mask holds sample indices 1..n, not 0/1.

Follows OpenRLHF openrlhf/models/model.py (_get_reward_model / _get_critic_model with packing_samples=True)
and openrlhf/models/utils.py (reset_position_ids).  Several prompt+response samples are packed into ONE row
with no padding; attention_mask[0, t] = k for a token of the k-th sample.  OpenRLHF hands that mask to a
flash-attn varlen patch; here the same meaning is spelled for SDPA: a query sees keys of its own sample at
or before it (block-diagonal causal).  position_ids restart at 0 for every sample.  The reward model reads the
value head at each sample's last token (packed_seq_lens.cumsum() - 1); the critic keeps the values of the
action (response) tokens.  Checked against each sample run alone, unpacked, with is_causal=True.
"""
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class LlamaConfig:
    vocab_size: int = 64
    hidden_size: int = 32
    num_attention_heads: int = 4
    num_hidden_layers: int = 2
    rope_theta: float = 10000.0


def reset_position_ids(attention_mask):
    """Positions restart at 0 for every packed sample (OpenRLHF utils.reset_position_ids)."""
    position_ids = torch.zeros_like(attention_mask, dtype=torch.long)
    for i in range(attention_mask.size(0)):
        mask = attention_mask[i]
        seq_num = mask.max().item()
        for index in range(1, seq_num + 1):
            sample_mask = mask == index
            sample_length = sample_mask.sum().item()
            position_ids[i, sample_mask] = torch.arange(sample_length, device=mask.device)
    return position_ids


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class LlamaAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.n_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // self.n_heads
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=False)
        self.o_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x, position_ids, attn_mask, is_causal):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        freqs = position_ids[:, None, :, None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class LlamaModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaAttention(config) for _ in range(config.num_hidden_layers))
        self.norms = nn.ModuleList(nn.RMSNorm(config.hidden_size) for _ in range(config.num_hidden_layers))
        self.norm = nn.RMSNorm(config.hidden_size)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        if attention_mask is not None and attention_mask.max() > 1:
            # packed samples: the mask value names the sample; same sample and not in the future
            same = attention_mask[:, :, None] == attention_mask[:, None, :]
            t = input_ids.size(1)
            causal = torch.ones(t, t, dtype=torch.bool).tril()
            attn_mask, is_causal = (same & causal)[:, None], False
        else:
            attn_mask, is_causal = None, True
        h = self.embed_tokens(input_ids)
        for attn, norm in zip(self.layers, self.norms):
            h = h + attn(norm(h), position_ids, attn_mask, is_causal)
        return {"last_hidden_state": self.norm(h)}


class RewardModel(nn.Module):
    def __init__(self, config, packing_samples):
        super().__init__()
        self.model = LlamaModel(config)
        self.value_head = nn.Linear(config.hidden_size, 1, bias=False)
        self.packing_samples = packing_samples

    def forward(self, input_ids, attention_mask, packed_seq_lens=None):
        if not self.packing_samples:
            position_ids = attention_mask.long().cumsum(-1) - 1
        else:
            position_ids = reset_position_ids(attention_mask)
        position_ids.masked_fill_(attention_mask == 0, 1)
        outputs = self.model(input_ids, attention_mask=attention_mask, position_ids=position_ids)
        values = self.value_head(outputs["last_hidden_state"]).squeeze(-1)
        if self.packing_samples:
            packed_seq_lens = torch.tensor(packed_seq_lens)
            eos_indices = packed_seq_lens.cumsum(dim=0) - 1
            reward = values.squeeze(0).gather(dim=0, index=eos_indices)
        else:
            eos_indices = attention_mask.size(1) - 1 - attention_mask.long().fliplr().argmax(dim=1, keepdim=True)
            reward = values.gather(dim=1, index=eos_indices).squeeze(1)
        return reward, values


def critic_action_values(values, num_actions, packed_seq_lens):
    """Values predicting each action token: position t's value is for the token at t+1 (drop the last)."""
    values = values[:, :-1]
    action_values, offset = [], 0
    for num_action, seq_len in zip(num_actions, packed_seq_lens):
        start, end = max(0, offset + seq_len - num_action - 1), offset + seq_len - 1
        action_values.append(values[:, start:end])
        offset += seq_len
    return torch.cat(action_values, dim=1)


def main():
    torch.manual_seed(0)
    config = LlamaConfig()
    packed = RewardModel(config, packing_samples=True).eval()
    single = RewardModel(config, packing_samples=False).eval()
    single.load_state_dict(packed.state_dict())

    prompt_lens, num_actions = [3, 5, 2], [4, 2, 3]
    samples = [torch.randint(3, config.vocab_size, (p + a,)) for p, a in zip(prompt_lens, num_actions)]
    packed_seq_lens = [len(s) for s in samples]
    input_ids = torch.cat(samples)[None]
    attention_mask = torch.cat([torch.full((n,), i + 1) for i, n in enumerate(packed_seq_lens)])[None]

    with torch.no_grad():
        reward, values = packed(input_ids, attention_mask, packed_seq_lens)
        action_values = critic_action_values(values, num_actions, packed_seq_lens)
        ref_reward, ref_actions = [], []
        for s, a in zip(samples, num_actions):
            r, v = single(s[None], torch.ones(1, len(s), dtype=torch.long))
            ref_reward.append(r)
            ref_actions.append(v[:, :-1][:, -a:])
    torch.testing.assert_close(reward, torch.cat(ref_reward), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(action_values, torch.cat(ref_actions, dim=1), rtol=1e-5, atol=1e-5)
    print("rewards", [round(x, 4) for x in reward.tolist()], "action values", tuple(action_values.shape))


if __name__ == "__main__":
    main()
