# sgl-project/SpecForge commit 41e252e (DFlash random-anchor training): _create_parallel_attention_mask let a block see
# the context of every lower block id (k_ids < q_ids), but sampled anchor blocks overlap, so a block attended target
# hidden states at positions >= its own anchor (future leak); the fix compares original positions (kv_orig < q_anchor).
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
    def __init__(self, draft_model, embed_tokens, mask_token_id=MASK_TOKEN_ID, block_size=BLOCK,
                 attention_backend="sdpa", random_anchor=True, num_anchors=6):
        super().__init__()
        self.draft_model = draft_model
        self.embed_tokens = embed_tokens
        self.block_size = block_size
        self.mask_token_id = mask_token_id
        self.attention_backend = attention_backend
        self.random_anchor = random_anchor
        self.num_anchors = num_anchors

    def _sample_anchor_positions(self, seq_len, loss_mask, device):
        bs = self.block_size
        bsz = loss_mask.shape[0]
        max_anchor = max(seq_len - bs, 0)
        valid = loss_mask[:, : max_anchor + 1] > 0.5
        valid_counts = valid.sum(dim=1)
        max_n = min(self.num_anchors, int(valid_counts.max().item()))
        anchor_list, keep_list = [], []
        for i in range(bsz):
            valid_indices = valid[i].nonzero(as_tuple=False).squeeze(-1)
            n_i = min(self.num_anchors, valid_indices.numel())
            perm = torch.randperm(valid_indices.numel(), device=device)[:n_i]
            anchors_i = valid_indices[perm].sort().values
            if n_i < max_n:
                anchors_i = torch.cat([anchors_i, anchors_i[-1:].expand(max_n - n_i)], dim=0)
            keep_i = torch.zeros(max_n, dtype=torch.bool, device=device)
            keep_i[:n_i] = True
            anchor_list.append(anchors_i)
            keep_list.append(keep_i)
        return torch.stack(anchor_list, dim=0), torch.stack(keep_list, dim=0)

    def _build_blocks_from_anchors(self, input_ids, hidden_states, loss_mask, anchor_positions, block_keep_mask):
        bs = self.block_size
        device = input_ids.device
        bsz = input_ids.shape[0]
        n = anchor_positions.shape[1]
        offsets = torch.arange(bs, device=device).unsqueeze(0)
        gather_idx = (anchor_positions.unsqueeze(-1) + offsets).reshape(bsz, -1)
        block_input_ids = torch.gather(input_ids, 1, gather_idx)
        block_hidden = torch.gather(hidden_states, 1, gather_idx.unsqueeze(-1).expand(-1, -1, hidden_states.size(-1)))
        block_loss_mask = torch.gather(loss_mask, 1, gather_idx)
        token_keep = block_keep_mask.repeat_interleave(bs, dim=1)
        block_loss_mask = block_loss_mask * token_keep.to(block_loss_mask.dtype)
        block_ids = torch.arange(n, device=device).repeat_interleave(bs)
        pad_token_mask = (~block_keep_mask).repeat_interleave(bs, dim=1)
        block_ids = block_ids.unsqueeze(0).expand(bsz, -1).clone()
        block_ids[pad_token_mask] = -1
        return block_input_ids, block_hidden, block_loss_mask, block_ids, gather_idx

    def prepare_noise_input(self, input_ids, block_ids=None):
        bsz, seq_len = input_ids.shape
        is_block_start = torch.ones(bsz, seq_len, dtype=torch.bool)
        is_block_start[:, 1:] = block_ids[:, 1:] != block_ids[:, :-1]
        noise_input_ids = torch.full_like(input_ids, self.mask_token_id)
        noise_input_ids[is_block_start] = input_ids[is_block_start]
        return noise_input_ids

    def _create_parallel_attention_mask(self, bsz, seq_len, device, block_ids=None, orig_positions=None,
                                        token_anchor_pos=None):
        q_ids = block_ids.unsqueeze(2)
        k_ids = block_ids.unsqueeze(1)
        q_valid = q_ids >= 0
        k_valid = k_ids >= 0
        if FIXED:
            q_anchor = token_anchor_pos.unsqueeze(2)
            k_orig = orig_positions.unsqueeze(1)
            ctx_mask = q_valid & k_valid & (k_orig < q_anchor)
        else:
            ctx_mask = q_valid & k_valid & (k_ids < q_ids)
        noise_mask = q_valid & k_valid & (k_ids == q_ids)
        full_mask_bool = torch.cat([ctx_mask, noise_mask], dim=2)
        full_mask = torch.zeros_like(full_mask_bool, dtype=torch.float32)
        full_mask.masked_fill_(~full_mask_bool, torch.finfo(torch.float32).min)
        return full_mask

    def forward(self, input_ids, attention_mask, hidden_states, loss_mask):
        bsz, seq_len = input_ids.shape
        device = input_ids.device
        anchor_positions, block_keep_mask = self._sample_anchor_positions(seq_len, loss_mask, device)
        (input_ids, hidden_states, loss_mask, block_ids, block_positions) = self._build_blocks_from_anchors(
            input_ids, hidden_states, loss_mask, anchor_positions, block_keep_mask)
        effective_len = input_ids.shape[1]
        base_positions = block_positions
        orig_positions = block_positions
        token_anchor_pos = anchor_positions.repeat_interleave(self.block_size, dim=1)
        noise_embedding = self.embed_tokens(self.prepare_noise_input(input_ids, block_ids))
        position_ids = torch.cat([base_positions, base_positions], dim=1)
        dflash_attn_mask = self._create_parallel_attention_mask(bsz, effective_len, device, block_ids,
                                                                orig_positions, token_anchor_pos)
        dflash_attn_mask = dflash_attn_mask.to(dtype=hidden_states.dtype).unsqueeze(1)
        hidden = self.draft_model(position_ids=position_ids, noise_embedding=noise_embedding,
                                  target_hidden=hidden_states, attention_mask=dflash_attn_mask)
        return hidden, token_anchor_pos


embed = nn.Embedding(VOCAB, HIDDEN)
draft = DFlashDraftModel()
model = OnlineDFlashModel(draft, embed).train()
L = 24
input_ids = torch.randint(0, VOCAB - 1, (2, L))
target_hidden = torch.randn(2, L, 2 * HIDDEN)
loss_mask = torch.ones(2, L)
attention_mask = torch.ones(2, L, dtype=torch.long)
with torch.no_grad():
    torch.manual_seed(1)
    hidden, token_anchor = model(input_ids, attention_mask, target_hidden, loss_mask)
    # a block drafted from anchor a may only use target hidden states before a (as in spec_generate): per block,
    # re-run with the target hidden states at positions >= that block's anchor replaced, same anchors
    worst = 0.0
    for b in range(2):
        for tok in range(0, hidden.shape[1], BLOCK):
            a = int(token_anchor[b, tok])
            perturbed = target_hidden.clone()
            perturbed[b, a:] = torch.randn_like(perturbed[b, a:])
            torch.manual_seed(1)  # same anchors
            h2, _ = model(input_ids, attention_mask, perturbed, loss_mask)
            worst = max(worst, (h2[b, tok:tok + BLOCK] - hidden[b, tok:tok + BLOCK]).abs().max().item())
print(f"max change of a draft block when target hidden states at/after its anchor change = {worst:.6f}")
