"""VeOmni Flux `flash_attention` dropped `attn_mask` (EliGen entity masks) on the flash-attn path.

Citation: ByteDance-Seed/VeOmni PR #1051 ("[model] fix: apply attention mask in flux
flash-attention path", merged).  The PR description was read, plus the pre-fix
veomni/models/transformers/flux/modeling_flux.py (`flash_attention`, `FluxJointAttention`,
`construct_mask`, `process_entity_masks`) from stored upstream source; the fixed body below is
written from the description, not the diff.

Bug: `flash_attention(q, k, v, causal, attn_mask)` applied `attn_mask` only in the CPU
fallback (`F.scaled_dot_product_attention`).  With flash-attn 2/3 installed it called
`flash_attn_func(q, k, v, causal=causal)` and silently ignored the (b, 1, s, s) additive
0/-inf mask that `construct_mask` builds from `entity_masks` (entity prompt i only talks to
its image region; entity prompts do not see each other), so on GPU every token attended to
every prompt and image token.
Fix: when `attn_mask` is not None fall back to SDPA with the mask; since SDPA cannot take both
`attn_mask` and `is_causal`, the lower-triangular causal bias is merged into the additive mask
first, preserving the caller's `causal=True`.

Reproduction: a machine where flash-attn is importable (the one stand-in: `flash_attn_func`
is a torch reference of the kernel); one entity mask (left half of a 4x4 latent)
plus the global prompt, prompt_seq_len=2, 4 image tokens, through `FluxJointAttention`.
"""
import sys
import types

import torch
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


def _flash_attn_func(q, k, v, causal=False):
    """Reference of flash_attn.flash_attn_func on [b, s, n, d] (no mask argument exists)."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal)
    return out.transpose(1, 2)


flash_attn = types.SimpleNamespace(flash_attn_func=_flash_attn_func)
FLASH_ATTN_3_AVAILABLE = False
FLASH_ATTN_2_AVAILABLE = True


def flash_attention(q, k, v, causal=False, attn_mask=None):
    # bs, head_cont, seq, head_dim = q.shape
    if FIXED and attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            attn_mask = torch.zeros_like(attn_mask, dtype=q.dtype).masked_fill(~attn_mask, float("-inf"))
        if causal:
            s_q, s_k = q.shape[2], k.shape[2]
            causal_bias = torch.zeros(s_q, s_k, dtype=q.dtype).masked_fill(
                torch.ones(s_q, s_k, dtype=torch.bool).triu(1), float("-inf"))
            attn_mask = attn_mask + causal_bias
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
    if FLASH_ATTN_3_AVAILABLE or FLASH_ATTN_2_AVAILABLE:
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # "b n s d -> b s n d"
    if FLASH_ATTN_2_AVAILABLE:
        x = flash_attn.flash_attn_func(q, k, v, causal=causal)
    else:
        x = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        return x
    return x.transpose(1, 2)  # "b s n d -> b n s d"


def patchify(hidden_states):
    """B C (H P) (W Q) -> B (H W) (C P Q) with P = Q = 2."""
    b, c, hp, wq = hidden_states.shape
    x = hidden_states.view(b, c, hp // 2, 2, wq // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (hp // 2) * (wq // 2), c * 4)


def construct_mask(entity_masks, prompt_seq_len, image_seq_len):
    N = len(entity_masks)
    batch_size = entity_masks[0].shape[0]
    total_seq_len = N * prompt_seq_len + image_seq_len
    patched_masks = [patchify(entity_masks[i]) for i in range(N)]
    attention_mask = torch.ones((batch_size, total_seq_len, total_seq_len), dtype=torch.bool)
    image_start = N * prompt_seq_len
    image_end = N * prompt_seq_len + image_seq_len
    for i in range(N):
        prompt_start = i * prompt_seq_len
        prompt_end = (i + 1) * prompt_seq_len
        image_mask = torch.sum(patched_masks[i], dim=-1) > 0
        image_mask = image_mask.unsqueeze(1).repeat(1, prompt_seq_len, 1)
        attention_mask[:, prompt_start:prompt_end, image_start:image_end] = image_mask
        attention_mask[:, image_start:image_end, prompt_start:prompt_end] = image_mask.transpose(1, 2)
    for i in range(N):
        for j in range(N):
            if i != j:
                attention_mask[:, i * prompt_seq_len:(i + 1) * prompt_seq_len,
                               j * prompt_seq_len:(j + 1) * prompt_seq_len] = False
    attention_mask = attention_mask.float()
    attention_mask[attention_mask == 0] = float("-inf")
    attention_mask[attention_mask == 1] = 0
    return attention_mask


class FluxJointAttention(torch.nn.Module):
    def __init__(self, dim, num_heads):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.a_to_qkv = torch.nn.Linear(dim, dim * 3)
        self.b_to_qkv = torch.nn.Linear(dim, dim * 3)

    def forward(self, hidden_states_a, hidden_states_b, attn_mask=None):
        batch_size = hidden_states_a.shape[0]
        qkv_a = self.a_to_qkv(hidden_states_a).view(batch_size, -1, 3 * self.num_heads, self.head_dim).transpose(1, 2)
        q_a, k_a, v_a = qkv_a.chunk(3, dim=1)
        qkv_b = self.b_to_qkv(hidden_states_b).view(batch_size, -1, 3 * self.num_heads, self.head_dim).transpose(1, 2)
        q_b, k_b, v_b = qkv_b.chunk(3, dim=1)
        q = torch.concat([q_b, q_a], dim=2)
        k = torch.concat([k_b, k_a], dim=2)
        v = torch.concat([v_b, v_a], dim=2)
        hidden_states = flash_attention(q, k, v, causal=True, attn_mask=attn_mask)
        return hidden_states.transpose(1, 2).reshape(batch_size, -1, self.num_heads * self.head_dim)


def main():
    torch.manual_seed(0)
    dim, heads, prompt_seq_len = 16, 2, 2
    latents = torch.randn(1, 4, 4, 4)  # B C H W -> 4 image tokens after patchify
    hidden_states = torch.nn.Linear(16, dim)(patchify(latents))
    entity_mask = torch.zeros(1, 1, 4, 4)
    entity_mask[..., :2] = 1.0  # entity occupies the left half of the image
    entity_masks = [entity_mask.repeat(1, 4, 1, 1), torch.ones(1, 4, 4, 4)]  # entity + global (last)
    attention_mask = construct_mask(entity_masks, prompt_seq_len, hidden_states.shape[1]).unsqueeze(1)
    prompt_emb = torch.randn(1, len(entity_masks) * prompt_seq_len, dim)
    attn = FluxJointAttention(dim, heads)
    with torch.no_grad():
        out = attn(hidden_states, prompt_emb, attn_mask=attention_mask)
    print("image token 3 out[:3] =", [round(x, 4) for x in out[0, -1, :3].tolist()])


if __name__ == "__main__":
    main()
