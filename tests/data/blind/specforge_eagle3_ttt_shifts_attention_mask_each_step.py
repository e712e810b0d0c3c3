"""SpecForge EAGLE-3 training-time test (TTT): the causal mask was "shifted" after every step.

Citation: sgl-project/SpecForge#244 ("fix: remove attention mask shift & add pe shift", merged);
the same line was questioned in SafeAILab/EAGLE#247 and removed in Tencent/AngelSlim#161
("fix: remove the wrong attention mask updating", merged) and proposed in SafeAILab/EAGLE#299.
Read: the PR/issue descriptions and the `OnlineEagle3Model.forward` TTT loop (specforge/core/eagle3.py);
the diff of #244 itself was not available to me, so the draft attention below is written after
SpecForge's llama3_eagle `LlamaAttention` cache_hidden path as I read it in the repository.

Bug: after each TTT step the loop did
    ind0 = ind[idx:]; ind1 = ind[: seq_length - idx]
    attention_mask[:, :, ind0, ind1] = torch.finfo(attention_mask.dtype).min
so that at step k query i no longer sees the step-0 keys i, i-1, ..., i-k+1 — ever more of its
own past is hidden (DeclK's printout in EAGLE#247), although in TTT step k only the *newest*
positions are supplied through the per-step diagonal cache entries; the step-0 keys up to i
must stay visible (Figure 6 of the EAGLE-3 paper).
Fix (#244): drop the mask update (keep the causal + padding mask for every step) and shift the
rotary positions by the number of cached steps (`position_ids + lck`).

Reproduction: a one-layer EAGLE-3 draft (fc over 3 target hidden states, midlayer attention on
[embeds, hidden] with the cache_hidden list, lm_head), batch 1, 8 tokens with 2 right-pad, 3 TTT
steps; the 4-D additive mask is built from `attention_mask` like `_prepare_decoder_attention_mask`.
"""
import math
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv


def padding(tensor, left=True):
    zeropadding = torch.zeros_like(tensor[:, -1:])
    if left:
        tensor = torch.cat((zeropadding, tensor[:, :-1]), dim=1)
    else:
        tensor = torch.cat((tensor[:, 1:], zeropadding), dim=1)
    return tensor


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, position_ids, dim, base=10000.0):
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))
    freqs = position_ids[..., None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos()[:, None], emb.sin()[:, None]
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


class LlamaAttention(nn.Module):
    def __init__(self, hidden_size, num_heads):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = hidden_size // num_heads
        self.q_proj = nn.Linear(hidden_size * 2, hidden_size, bias=False)
        self.k_proj = nn.Linear(hidden_size * 2, hidden_size, bias=False)
        self.v_proj = nn.Linear(hidden_size * 2, hidden_size, bias=False)
        self.o_proj = nn.Linear(hidden_size, hidden_size, bias=False)

    def forward(self, hidden_states, cache_hidden, attention_mask, position_ids):
        bsz, q_len, _ = hidden_states.size()
        query_states = self.q_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)

        lck = len(cache_hidden[0])
        rope_positions = position_ids + lck if FIXED else position_ids
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, rope_positions, self.head_dim)

        cache_hidden[0] = cache_hidden[0] + [key_states]
        cache_hidden[1] = cache_hidden[1] + [value_states]
        cache_k, cache_v = cache_hidden
        k0, v0 = cache_k[0], cache_v[0]

        attn_weights = torch.matmul(query_states, k0.transpose(2, 3)) / math.sqrt(self.head_dim)
        lck = len(cache_k)
        attn_weights = attn_weights + attention_mask
        for i in range(1, lck):
            # step i's key for the same row: the token predicted i steps ahead
            attn_weightsi = (query_states * cache_k[i]).sum(-1) / math.sqrt(self.head_dim)
            attn_weights = torch.cat((attn_weights, attn_weightsi[..., None]), dim=-1)

        attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query_states.dtype)
        attn_output = torch.matmul(attn_weights[..., :q_len], v0)
        for i in range(1, lck):
            attn_output = attn_output + attn_weights[..., q_len + i - 1][..., None] * cache_v[i]
        attn_output = attn_output.transpose(1, 2).reshape(bsz, q_len, -1)
        return self.o_proj(attn_output)


class LlamaForCausalLMEagle3(nn.Module):
    def __init__(self, vocab_size=32, hidden_size=16, num_heads=2):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab_size, hidden_size)
        self.fc = nn.Linear(hidden_size * 3, hidden_size, bias=False)
        self.input_layernorm = nn.LayerNorm(hidden_size)
        self.hidden_norm = nn.LayerNorm(hidden_size)
        self.self_attn = LlamaAttention(hidden_size, num_heads)
        self.norm = nn.LayerNorm(hidden_size)
        self.lm_head = nn.Linear(hidden_size, vocab_size, bias=False)

    def backbone(self, input_embeds, hidden_states, cache_hidden, attention_mask, position_ids):
        residual = hidden_states
        x = torch.cat((self.input_layernorm(input_embeds), self.hidden_norm(hidden_states)), dim=-1)
        return residual + self.self_attn(x, cache_hidden, attention_mask, position_ids)


def _prepare_decoder_attention_mask(attention_mask, seq_length, dtype):
    causal = torch.full((seq_length, seq_length), torch.finfo(dtype).min).triu(1)
    pad = (1.0 - attention_mask[:, None, None, :].to(dtype)) * torch.finfo(dtype).min
    return (causal[None, None] + pad).clamp(min=torch.finfo(dtype).min)


class OnlineEagle3Model(nn.Module):
    def __init__(self, draft_model, length: int = 3):
        super().__init__()
        self.draft_model = draft_model
        self.length = length

    def forward(self, input_ids, attention_mask, loss_mask, hidden_states, target):
        batch_size, seq_length = input_ids.shape
        position_ids = torch.arange(seq_length).unsqueeze(0)
        hidden_states = self.draft_model.fc(hidden_states)
        attention_mask = _prepare_decoder_attention_mask(attention_mask, seq_length, hidden_states.dtype)
        cache_hidden = [[], []]
        plosses = []
        for idx in range(self.length):
            is_last = idx == self.length - 1
            inputs_embeds = self.draft_model.embed_tokens(input_ids)
            hidden_states_out = self.draft_model.backbone(
                input_embeds=inputs_embeds, hidden_states=hidden_states, cache_hidden=cache_hidden,
                attention_mask=attention_mask, position_ids=position_ids)
            hidden_states = hidden_states_out
            logits = self.draft_model.lm_head(self.draft_model.norm(hidden_states_out))
            target_p = nn.Softmax(dim=2)(target)
            plogp = target_p * nn.LogSoftmax(dim=2)(logits)
            plosses.append(-torch.sum(loss_mask * plogp, 2).mean())
            if not is_last:
                input_ids = padding(input_ids, left=False)
                target = padding(target, left=False)
                loss_mask = padding(loss_mask, left=False)
                if not FIXED:
                    ind = torch.arange(seq_length, device=attention_mask.device)
                    ind0 = ind[idx:]
                    ind1 = ind[: seq_length - idx]
                    attention_mask[:, :, ind0, ind1] = torch.finfo(attention_mask.dtype).min
        return plosses


def main():
    torch.manual_seed(0)
    draft = LlamaForCausalLMEagle3()
    model = OnlineEagle3Model(draft, length=3)
    seq = 8
    input_ids = torch.randint(1, 32, (1, seq))
    attention_mask = torch.ones(1, seq, dtype=torch.long)
    attention_mask[:, 6:] = 0
    loss_mask = attention_mask[..., None].float()
    hidden_states = torch.randn(1, seq, 16 * 3)  # aux hidden states from 3 target layers
    target = torch.randn(1, seq, 32)  # target model logits
    with torch.no_grad():
        plosses = model(input_ids, attention_mask, loss_mask, hidden_states, target)
    print("ttt losses", [round(p.item(), 4) for p in plosses])


if __name__ == "__main__":
    main()
