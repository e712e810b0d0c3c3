# verl-project/verl-SpeCo#30 (commit d35bd99): the Domino (DFlash-style block) drafter built its flex block mask only
# when device.type == "cuda"; elsewhere it passed no mask, so SDPA ran unmasked and draft blocks saw their targets.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
VOCAB, HIDDEN, HEADS, TARGET_HIDDEN, MASK_TOKEN = 64, 32, 4, 48, 63


def _create_dflash_mask_mod(anchor_positions, block_keep_mask, ctx_len, block_size):
    """A query block sees context tokens before its anchor and draft tokens of its own block."""

    def dflash_mask_mod(b, h, q_idx, kv_idx):
        q_block_id = q_idx // block_size
        anchor_pos = anchor_positions[b, q_block_id]
        mask_context = (kv_idx < ctx_len) & (kv_idx < anchor_pos)
        mask_draft = (kv_idx >= ctx_len) & (q_block_id == (kv_idx - ctx_len) // block_size)
        return (mask_context | mask_draft) & block_keep_mask[b, q_block_id]

    return dflash_mask_mod


def _create_dflash_dense_attention_mask(anchor_positions, block_keep_mask, ctx_len, block_size):
    bsz, num_blocks = anchor_positions.shape
    draft_len = num_blocks * block_size
    query_indices = torch.arange(draft_len)
    query_block_ids = query_indices // block_size
    query_anchors = anchor_positions.index_select(1, query_block_ids)
    query_valid = block_keep_mask.index_select(1, query_block_ids)
    context_allowed = torch.arange(ctx_len).view(1, 1, ctx_len) < query_anchors.unsqueeze(-1)
    draft_block_ids = torch.arange(draft_len) // block_size
    draft_allowed = (query_block_ids.view(1, draft_len, 1) == draft_block_ids.view(1, 1, draft_len)).expand(bsz, -1, -1)
    allowed = torch.cat([context_allowed, draft_allowed], dim=-1)
    total_len = ctx_len + draft_len
    safe_self = torch.arange(total_len).view(1, 1, total_len) == (ctx_len + query_indices).view(1, draft_len, 1)
    allowed = torch.where(query_valid.unsqueeze(-1), allowed, safe_self)
    return allowed.unsqueeze(1)


class DFlashAttention(nn.Module):
    """Dual-source KV attention: keys/values are target-context features followed by draft hidden states."""

    def __init__(self):
        super().__init__()
        self.num_heads, self.head_dim = HEADS, HIDDEN // HEADS
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(HIDDEN, HIDDEN, bias=False) for _ in range(4))

    def forward(self, draft_hidden, context_hidden, block_mask=None, dense_attention_mask=None):
        bsz, draft_len, _ = draft_hidden.shape
        total_len = context_hidden.shape[1] + draft_len
        q = self.q_proj(draft_hidden).view(bsz, draft_len, self.num_heads, self.head_dim).transpose(1, 2)
        kv_in = torch.cat([context_hidden, draft_hidden], dim=1)
        k = self.k_proj(kv_in).view(bsz, total_len, self.num_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(kv_in).view(bsz, total_len, self.num_heads, self.head_dim).transpose(1, 2)
        if block_mask is not None:
            from torch.nn.attention.flex_attention import flex_attention
            out = flex_attention(q, k, v, block_mask=block_mask)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=dense_attention_mask, is_causal=False, dropout_p=0.0)
        return self.o_proj(out.transpose(1, 2).reshape(bsz, draft_len, HIDDEN))


class DominoDraftModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, HIDDEN)
        self.fc = nn.Linear(2 * TARGET_HIDDEN, HIDDEN)  # fuses the selected target layers
        self.pos = nn.Embedding(64, HIDDEN)
        self.layers = nn.ModuleList([DFlashAttention() for _ in range(2)])

    def extract_context_feature(self, hidden_states_list):
        return self.fc(torch.cat(hidden_states_list, dim=-1))

    def forward(self, context_feature, noise_embedding, draft_position_ids, context_position_ids,
                block_mask=None, dense_attention_mask=None):
        h = noise_embedding + self.pos(draft_position_ids)
        ctx = context_feature + self.pos(context_position_ids)
        for layer in self.layers:
            h = h + layer(h, ctx, block_mask=block_mask, dense_attention_mask=dense_attention_mask)
        return h


class DominoTrainingModel(nn.Module):
    def __init__(self, draft_model, block_size=4, num_anchors=2):
        super().__init__()
        self.draft_model, self.block_size, self.num_anchors = draft_model, block_size, num_anchors

    def forward(self, input_ids, hidden_states_list, anchor_positions, block_keep_mask):
        bsz, seq_len = input_ids.shape
        device = input_ids.device
        context_feature = self.draft_model.extract_context_feature(hidden_states_list)
        # each block: the anchor token followed by mask tokens, to be denoised into the next block_size tokens
        block_ids = torch.full((bsz, self.num_anchors, self.block_size), MASK_TOKEN)
        block_ids[:, :, 0] = torch.gather(input_ids, 1, anchor_positions)
        noise_embedding = self.draft_model.embed_tokens(block_ids).view(bsz, -1, HIDDEN)
        offsets = torch.arange(self.block_size).view(1, 1, -1)
        draft_position_ids = (anchor_positions.unsqueeze(-1) + offsets).view(bsz, -1)
        context_position_ids = torch.arange(seq_len).unsqueeze(0).expand(bsz, -1)
        draft_len = self.num_anchors * self.block_size

        block_mask = None
        dense_attention_mask = None
        if device.type == "cuda":
            from torch.nn.attention.flex_attention import create_block_mask
            block_mask = create_block_mask(
                _create_dflash_mask_mod(anchor_positions, block_keep_mask, seq_len, self.block_size),
                B=bsz, H=None, Q_LEN=draft_len, KV_LEN=seq_len + draft_len, device=device)
        elif FIXED:
            dense_attention_mask = _create_dflash_dense_attention_mask(
                anchor_positions, block_keep_mask, seq_len, self.block_size)
        return self.draft_model(context_feature, noise_embedding, draft_position_ids, context_position_ids,
                                block_mask=block_mask, dense_attention_mask=dense_attention_mask)


bsz, seq_len = 2, 16
model = DominoTrainingModel(DominoDraftModel()).eval()
input_ids = torch.randint(0, 60, (bsz, seq_len))
hidden_states_list = [torch.randn(bsz, seq_len, TARGET_HIDDEN) for _ in range(2)]  # from the target model
anchor_positions = torch.tensor([[3, 9], [5, 11]])
block_keep_mask = torch.ones(bsz, 2, dtype=torch.bool)

with torch.no_grad():
    draft_hidden = model(input_ids, hidden_states_list, anchor_positions, block_keep_mask)
    # reference: only context before each anchor may be read; perturbing later context must not matter
    leaked = [h.clone() for h in hidden_states_list]
    for h in leaked:
        h[:, 12:] += 5.0
    draft_hidden_perturbed = model(input_ids, leaked, anchor_positions, block_keep_mask)
diff = (draft_hidden[:, :4] - draft_hidden_perturbed[:, :4]).abs().max().item()
print(f"fixed={FIXED} first draft block vs context after its anchor perturbed, max |diff| = {diff:.4f}")
