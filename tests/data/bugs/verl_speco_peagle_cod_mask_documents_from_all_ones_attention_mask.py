# verl-project/verl-SpeCo#18 (fix commit 0acc2a0): PEagleTrainerBackend.compute_loss took the COD mask's document
# lengths from attention_mask.sum() of the flat packed batch (all ones), so create_peagle_mask_mod saw one document and
# depth-0 positions attended across documents; the fix passes per-chunk seq_lengths from base_trainer.
import sys
import warnings
import torch
import torch.nn as nn
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

warnings.filterwarnings("ignore")
FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

HIDDEN, HEADS, KV_HEADS, VOCAB = 32, 4, 2, 50


def generate_cod_sample_indices(seq_length, loss_mask, num_depths=3, down_sample_ratio=0.7,
                                down_sample_ratio_min=0.2, filter_position_zero=True):
    loss_mask = loss_mask.flatten()
    device = loss_mask.device
    all_valid_indices = torch.where(loss_mask == 1)[0]
    sample_indices = [torch.arange(seq_length, device=device)]
    n_per_depth = [seq_length]
    prev_indices = all_valid_indices
    if filter_position_zero:
        prev_indices = prev_indices[prev_indices != 0]
    for d in range(1, num_depths):
        valid_length = max(0, all_valid_indices.shape[0] - d)
        ratio = max(down_sample_ratio ** d, down_sample_ratio_min)
        sample_size = int(valid_length * ratio)
        if sample_size <= 0:
            break
        if prev_indices.shape[0] >= sample_size:
            random_selection = torch.randperm(prev_indices.shape[0], device=device)[:sample_size]
            sampled_idx = torch.sort(prev_indices[random_selection])[0]
        else:
            sampled_idx = prev_indices
        next_candidates = (sampled_idx + 1) % seq_length
        if filter_position_zero:
            next_candidates = next_candidates[next_candidates != 0]
        prev_indices = next_candidates[torch.isin(next_candidates, all_valid_indices)]
        sample_indices.append(sampled_idx - d)
        n_per_depth.append(sampled_idx.shape[0])
    anchor_pos = torch.cat(sample_indices)
    depth = torch.cat([torch.full((n,), i, device=device, dtype=torch.long) for i, n in enumerate(n_per_depth)])
    return anchor_pos, depth


def create_peagle_mask_mod(anchor_pos, depth, lengths, total_seq_len):
    document_ids = torch.repeat_interleave(torch.arange(lengths.shape[0], dtype=torch.long), lengths)
    document_ids = torch.cat([document_ids, torch.full((total_seq_len - document_ids.shape[0],), -1,
                                                       dtype=torch.long)]).contiguous()

    def peagle_mask_mod(_b, _h, q_idx, kv_idx):
        q_anchor_pos = anchor_pos[q_idx]
        kv_anchor_pos = anchor_pos[kv_idx]
        q_depth = depth[q_idx]
        kv_depth = depth[kv_idx]
        same_document = document_ids[q_anchor_pos] == document_ids[kv_anchor_pos]
        is_not_padding = document_ids[q_anchor_pos] != -1
        same_rollout = q_anchor_pos == kv_anchor_pos
        kv_depth0 = kv_depth == 0
        in_depth_order = q_depth >= kv_depth
        is_anchor_causal = q_anchor_pos >= kv_anchor_pos
        return is_not_padding & same_document & ((kv_depth0 & is_anchor_causal) | (same_rollout & in_depth_order))

    return peagle_mask_mod


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class PeagleAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.head_dim = HIDDEN // HEADS
        self.num_key_value_groups = HEADS // KV_HEADS
        self.scaling = self.head_dim ** -0.5
        self.q_proj = nn.Linear(2 * HIDDEN, HEADS * self.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * HIDDEN, KV_HEADS * self.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * HIDDEN, KV_HEADS * self.head_dim, bias=False)
        self.o_proj = nn.Linear(HEADS * self.head_dim, HIDDEN, bias=False)
        self.inv_freq = 1.0 / (10000 ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim))

    def forward_peagle(self, combined_states, position_ids, block_mask):
        bsz, n, _ = combined_states.shape
        q = self.q_proj(combined_states).view(bsz, n, HEADS, self.head_dim).transpose(1, 2)
        k = self.k_proj(combined_states).view(bsz, n, KV_HEADS, self.head_dim).transpose(1, 2)
        v = self.v_proj(combined_states).view(bsz, n, KV_HEADS, self.head_dim).transpose(1, 2)
        freqs = position_ids[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), -1)
        cos, sin = emb.cos()[:, None], emb.sin()[:, None]
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        k = k.repeat_interleave(self.num_key_value_groups, dim=1)
        v = v.repeat_interleave(self.num_key_value_groups, dim=1)
        out = flex_attention(q, k, v, block_mask=block_mask, scale=self.scaling)
        return self.o_proj(out.transpose(1, 2).reshape(bsz, n, -1))


class LlamaForCausalLMPeagle(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, HIDDEN)
        self.fc = nn.Linear(3 * HIDDEN, HIDDEN, bias=False)
        self.mask_hidden = nn.Parameter(torch.randn(3 * HIDDEN))
        self.self_attn = PeagleAttention()

    def project_hidden_states(self, h):
        return self.fc(h)

    def masked_projected_hidden(self):
        return self.project_hidden_states(self.mask_hidden.view(1, -1))

    def build_peagle_block_mask(self, anchor_pos, depth, lengths, total_seq_len):
        mask_mod = create_peagle_mask_mod(anchor_pos=anchor_pos, depth=depth, lengths=lengths, total_seq_len=total_seq_len)
        return create_block_mask(mask_mod, B=None, H=None, Q_LEN=anchor_pos.shape[0], KV_LEN=anchor_pos.shape[0],
                                 device="cpu")

    def forward_peagle(self, sampled_input_ids, sampled_projected_hidden, position_ids, block_mask):
        emb = self.embed_tokens(sampled_input_ids)
        combined = torch.cat([emb, sampled_projected_hidden], -1)
        return sampled_projected_hidden + self.self_attn.forward_peagle(combined, position_ids, block_mask)


MASK_TOKEN = VOCAB - 1


def compute_loss_hidden(draft, batch, num_depths):
    # the mask-relevant part of PEagleTrainerBackend.compute_loss for row b = 0; returns draft hidden + COD indices
    input_ids, aux_hidden = batch["input_ids"], batch["hidden_states"]
    attention_mask, loss_mask = batch["attention_mask"], batch["loss_mask"]
    seq_lengths = batch.get("seq_lengths", None) if FIXED else None
    _, seq_len = input_ids.shape
    b = 0
    row_loss_mask = loss_mask[b:b + 1].long()
    anchor_pos, depth = generate_cod_sample_indices(seq_len, row_loss_mask, num_depths=num_depths)
    orig_positions = anchor_pos + depth
    if seq_lengths is not None:
        row_length = seq_lengths
    else:
        row_length = attention_mask[b].sum().clamp_min(1).reshape(1)
    is_depth0 = depth == 0
    flat_ids = torch.where(is_depth0, input_ids[b][orig_positions],
                           torch.full_like(orig_positions, MASK_TOKEN)).unsqueeze(0)
    real_proj = draft.project_hidden_states(aux_hidden[b:b + 1][:, orig_positions])[0]
    flat_hidden = torch.where(is_depth0.unsqueeze(-1), real_proj,
                              draft.masked_projected_hidden().expand(orig_positions.shape[0], -1)).unsqueeze(0)
    block_mask = draft.build_peagle_block_mask(anchor_pos=anchor_pos, depth=depth, lengths=row_length,
                                               total_seq_len=seq_len)
    hidden = draft.forward_peagle(flat_ids, flat_hidden, orig_positions.unsqueeze(0), block_mask)
    return hidden[0], anchor_pos, depth


draft = LlamaForCausalLMPeagle().eval()
# base_trainer's flat batch: documents concatenated into one batch-1 row with an all-ones attention_mask
chunks_ids = [torch.randint(0, VOCAB - 1, (10,)), torch.randint(0, VOCAB - 1, (14,))]
chunks_hid = [torch.randn(10, 3 * HIDDEN), torch.randn(14, 3 * HIDDEN)]
flat = {
    "input_ids": torch.cat(chunks_ids)[None],
    "hidden_states": torch.cat(chunks_hid)[None],
    "attention_mask": torch.ones(1, 24, dtype=torch.long),
    "loss_mask": torch.ones(1, 24, dtype=torch.long),
    "seq_lengths": torch.tensor([c.size(0) for c in chunks_ids], dtype=torch.long),
}
with torch.no_grad():
    hidden, anchor_pos, depth = compute_loss_hidden(draft, flat, num_depths=3)
    # reference: the second document alone (depth-0 elements depend only on depth-0 context of their own document)
    alone = {"input_ids": chunks_ids[1][None], "hidden_states": chunks_hid[1][None],
             "attention_mask": torch.ones(1, 14, dtype=torch.long), "loss_mask": torch.ones(1, 14, dtype=torch.long),
             "seq_lengths": torch.tensor([14])}
    ref_hidden, _, ref_depth = compute_loss_hidden(draft, alone, num_depths=1)
doc2_depth0 = hidden[(depth == 0) & (anchor_pos >= 10)]
print(f"max |doc-2 depth-0 draft hidden (packed) - doc-2 alone| = {(doc2_depth0 - ref_hidden).abs().max().item():.6f}")
