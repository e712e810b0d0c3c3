# sgl-project/SpecForge#427: OnlineDFlashModel._create_parallel_attention_mask built the noise half of the [L, 2L]
# training mask as same_block & causal with causal[i, j] = (j >= i), so each block position saw only itself and later
# positions (not the real anchor token); DFlash drafts a block bidirectionally (spec_generate: no mask), fix: same_block.
import sys
import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

HIDDEN, HEADS, HEAD_DIM, VOCAB, BLOCK = 32, 4, 8, 40, 4
MASK_TOKEN_ID = VOCAB - 1


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotary(position_ids):
    inv_freq = 1.0 / (10000 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))
    freqs = position_ids[..., None].float() * inv_freq
    emb = torch.cat((freqs, freqs), -1)
    return emb.cos(), emb.sin()


class Qwen3DFlashAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(HIDDEN, HEADS * HEAD_DIM, bias=False)
        self.k_proj = nn.Linear(HIDDEN, HEADS * HEAD_DIM, bias=False)
        self.v_proj = nn.Linear(HIDDEN, HEADS * HEAD_DIM, bias=False)
        self.o_proj = nn.Linear(HEADS * HEAD_DIM, HIDDEN, bias=False)
        self.scaling = HEAD_DIM ** -0.5

    def forward(self, hidden_states, target_hidden, position_embeddings, attention_mask):
        bsz, q_len = hidden_states.shape[:-1]
        ctx_len = target_hidden.shape[1]
        q = self.q_proj(hidden_states).view(bsz, q_len, -1, HEAD_DIM).transpose(1, 2)
        k = torch.cat([self.k_proj(target_hidden), self.k_proj(hidden_states)], 1).view(bsz, ctx_len + q_len, -1, HEAD_DIM)
        v = torch.cat([self.v_proj(target_hidden), self.v_proj(hidden_states)], 1).view(bsz, ctx_len + q_len, -1, HEAD_DIM)
        k, v = k.transpose(1, 2), v.transpose(1, 2)
        cos, sin = position_embeddings
        cos, sin = cos[:, None], sin[:, None]
        q = q * cos[:, :, -q_len:] + rotate_half(q) * sin[:, :, -q_len:]
        k = k * cos + rotate_half(k) * sin
        # transformers sdpa_attention_forward: is_causal is False for DFlash (non-causal draft attention)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, scale=self.scaling, is_causal=False)
        return self.o_proj(out.transpose(1, 2).reshape(bsz, q_len, -1))


class DFlashDraftModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(2 * HIDDEN, HIDDEN, bias=False)
        self.hidden_norm = nn.LayerNorm(HIDDEN)
        self.self_attn = Qwen3DFlashAttention()
        self.norm = nn.LayerNorm(HIDDEN)

    def forward(self, position_ids, attention_mask=None, noise_embedding=None, target_hidden=None):
        hidden_states = noise_embedding
        target_hidden = self.hidden_norm(self.fc(target_hidden))
        position_embeddings = rotary(position_ids)
        hidden_states = hidden_states + self.self_attn(hidden_states, target_hidden, position_embeddings, attention_mask)
        return self.norm(hidden_states)


class OnlineDFlashModel(nn.Module):
    def __init__(self, draft_model, embed_tokens, block_size=BLOCK, mask_token_id=MASK_TOKEN_ID):
        super().__init__()
        self.draft_model = draft_model
        self.embed_tokens = embed_tokens
        self.block_size = block_size
        self.mask_token_id = mask_token_id

    def prepare_noise_input(self, input_ids):
        seq_len = input_ids.shape[1]
        positions = torch.arange(seq_len)
        is_block_start = (positions % self.block_size) == 0
        noise_input_ids = torch.full_like(input_ids, self.mask_token_id)
        noise_input_ids[:, is_block_start] = input_ids[:, is_block_start]
        return noise_input_ids

    def forward(self, input_ids, hidden_states):
        bsz, seq_len = input_ids.shape
        n_blocks = seq_len // self.block_size
        effective_len = n_blocks * self.block_size
        input_ids = input_ids[:, :effective_len]
        hidden_states = hidden_states[:, :effective_len, :]
        noise_embedding = self.embed_tokens(self.prepare_noise_input(input_ids))
        pos_seq = torch.arange(effective_len)
        position_ids = torch.cat([pos_seq, pos_seq], dim=0).unsqueeze(0).expand(bsz, -1)
        dflash_attn_mask = self._create_parallel_attention_mask(effective_len)
        dflash_attn_mask = dflash_attn_mask.unsqueeze(0).unsqueeze(0).expand(bsz, -1, -1, -1)
        return self.draft_model(position_ids=position_ids, noise_embedding=noise_embedding,
                                target_hidden=hidden_states, attention_mask=dflash_attn_mask)

    def _create_parallel_attention_mask(self, seq_len):
        indices = torch.arange(seq_len)
        block_ids = indices // self.block_size
        q_block_ids = block_ids.unsqueeze(1)
        k_block_ids = block_ids.unsqueeze(0)
        ctx_mask = k_block_ids < q_block_ids
        same_block = q_block_ids == k_block_ids
        if FIXED:
            noise_mask = same_block
        else:
            causal = indices.unsqueeze(0) >= indices.unsqueeze(1)  # j <= i
            noise_mask = same_block & causal
        full_mask_bool = torch.cat([ctx_mask, noise_mask], dim=1)
        full_mask = torch.zeros_like(full_mask_bool, dtype=torch.float32)
        full_mask.masked_fill_(~full_mask_bool, torch.finfo(torch.float32).min)
        return full_mask


embed = nn.Embedding(VOCAB, HIDDEN)
draft = DFlashDraftModel().eval()
model = OnlineDFlashModel(draft, embed)
L = 4 * BLOCK
input_ids = torch.randint(0, VOCAB - 1, (2, L))
target_hidden = torch.randn(2, L, 2 * HIDDEN)
with torch.no_grad():
    train_hidden = model(input_ids, target_hidden)
    # reference: what spec_generate does per block: context = target hidden before the block, the block's noise
    # (first token real, rest MASK) attended with no mask
    noise_ids = model.prepare_noise_input(input_ids)
    diffs = []
    for b in range(1, L // BLOCK):
        s = b * BLOCK
        pos = torch.arange(s + BLOCK).unsqueeze(0).expand(2, -1)
        ref = draft(position_ids=pos, attention_mask=None, noise_embedding=embed(noise_ids[:, s:s + BLOCK]),
                    target_hidden=target_hidden[:, :s])
        diffs.append((train_hidden[:, s:s + BLOCK] - ref).abs().max())
print(f"max |parallel training draft hidden - per-block spec_generate hidden| = {max(diffs).item():.6f}")
