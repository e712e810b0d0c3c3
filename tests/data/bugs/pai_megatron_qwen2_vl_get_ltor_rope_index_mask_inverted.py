# Pai-Megatron-Patch, examples/qwen2_vl/pretrain_qwen.py (alibaba/Pai-Megatron-Patch#448, fixed by #449).
# get_ltor_masks_and_position_ids passes attention_mask=(target == pad_token) to get_rope_index, so only the
# pad positions count as "real" tokens: the 3-D mrope position ids of every real text/image token are wrong.
import sys
import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

PAD, VSTART, IMG = 0, 1, 2          # Qwen2-VL: pad is <|endoftext|>
SPATIAL_MERGE = 2
D, H, L, V = 48, 4, 2, 40
HD = D // H
MROPE_SECTION = [2, 2, 2]           # sums to HD // 2


def get_rope_index(input_ids, image_grid_thw=None, video_grid_thw=None, attention_mask=None):
    spatial_merge_size = SPATIAL_MERGE
    image_token_id, video_token_id, vision_start_token_id = IMG, -1, VSTART
    mrope_position_deltas = []
    if image_grid_thw is not None or video_grid_thw is not None:
        total_input_ids = input_ids
        if attention_mask is None:
            attention_mask = torch.ones_like(total_input_ids)
        position_ids = torch.ones(3, input_ids.shape[0], input_ids.shape[1], dtype=input_ids.dtype)
        image_index, video_index = 0, 0
        for i, input_ids in enumerate(total_input_ids):
            input_ids = input_ids[attention_mask[i] == 1]
            vision_start_indices = torch.argwhere(input_ids == vision_start_token_id).squeeze(1)
            vision_tokens = input_ids[vision_start_indices + 1]
            image_nums = (vision_tokens == image_token_id).sum()
            input_tokens = input_ids.tolist()
            llm_pos_ids_list = []
            st = 0
            remain_images = image_nums
            for _ in range(image_nums):
                ed = input_tokens.index(image_token_id, st)
                t, h, w = image_grid_thw[image_index]
                image_index += 1
                remain_images -= 1
                llm_grid_t, llm_grid_h, llm_grid_w = t.item(), h.item() // spatial_merge_size, w.item() // spatial_merge_size
                text_len = ed - st
                st_idx = llm_pos_ids_list[-1].max() + 1 if len(llm_pos_ids_list) > 0 else 0
                llm_pos_ids_list.append(torch.arange(text_len).view(1, -1).expand(3, -1) + st_idx)
                t_index = torch.arange(llm_grid_t).view(-1, 1).expand(-1, llm_grid_h * llm_grid_w).flatten()
                h_index = torch.arange(llm_grid_h).view(1, -1, 1).expand(llm_grid_t, -1, llm_grid_w).flatten()
                w_index = torch.arange(llm_grid_w).view(1, 1, -1).expand(llm_grid_t, llm_grid_h, -1).flatten()
                llm_pos_ids_list.append(torch.stack([t_index, h_index, w_index]) + text_len + st_idx)
                st = ed + llm_grid_t * llm_grid_h * llm_grid_w
            if st < len(input_tokens):
                st_idx = llm_pos_ids_list[-1].max() + 1 if len(llm_pos_ids_list) > 0 else 0
                text_len = len(input_tokens) - st
                llm_pos_ids_list.append(torch.arange(text_len).view(1, -1).expand(3, -1) + st_idx)
            llm_positions = torch.cat(llm_pos_ids_list, dim=1).reshape(3, -1)
            position_ids[..., i, attention_mask[i] == 1] = llm_positions
            mrope_position_deltas.append(llm_positions.max() + 1 - len(total_input_ids[i]))
        return position_ids, torch.tensor(mrope_position_deltas).unsqueeze(1)
    raise NotImplementedError


def get_ltor_masks_and_position_ids(input_ids, image_thw_grids, video_thw_grids, target, pad_token, ignore_index=None):
    """Build masks and position id for left to right model."""
    position_ids, _ = get_rope_index(
        input_ids=input_ids,
        image_grid_thw=image_thw_grids,
        video_grid_thw=video_thw_grids,
        attention_mask=(input_ids != pad_token) if FIXED else (target == pad_token),
    )
    loss_mask = torch.ones(target.size(), dtype=torch.float)
    loss_mask[target == pad_token] = 0.0
    attention_mask = None  # Megatron: plain causal attention
    return attention_mask, loss_mask, position_ids


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def mrope_cos_sin(position_ids):
    # position_ids [3, b, s] -> cos/sin [b, s, HD] with multimodal sections (t, h, w)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, HD, 2, dtype=torch.float64) / HD))
    freqs = position_ids[..., None].double() * inv_freq          # [3, b, s, HD/2]
    emb = torch.cat([freqs, freqs], dim=-1)                      # [3, b, s, HD]
    sec = MROPE_SECTION * 2
    cos = torch.cat([m[i % 3] for i, m in enumerate(emb.cos().split(sec, dim=-1))], dim=-1)
    sin = torch.cat([m[i % 3] for i, m in enumerate(emb.sin().split(sec, dim=-1))], dim=-1)
    return cos, sin


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.mlp = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))

    def forward(self, x, cos, sin, attention_mask):
        b, s, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, H, HD).permute(2, 0, 3, 1, 4)
        cos, sin = cos[:, None], sin[:, None]
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, is_causal=attention_mask is None)
        x = x + self.proj(o.transpose(1, 2).reshape(b, s, D))
        return x + self.mlp(self.ln2(x))


class Qwen2VLModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.layers = nn.ModuleList([Block() for _ in range(L)])
        self.head = nn.Linear(D, V)

    def forward(self, input_ids, position_ids, vision_embeds, image_input_mask, attention_mask=None):
        x = self.emb(input_ids)
        x = x.masked_scatter(image_input_mask[..., None], vision_embeds)
        cos, sin = mrope_cos_sin(position_ids)
        x = x.double()
        for blk in self.layers:
            x = blk(x, cos, sin, attention_mask)
        return self.head(x)


model = Qwen2VLModel().double()
SEQ = 20
grid = torch.tensor([[1, 4, 4], [1, 4, 4]])             # 4 merged image tokens per image


def sample(n_pre, n_post):
    ids = [5 + int(t) for t in torch.randint(0, V - 5, (n_pre,))] + [VSTART] + [IMG] * 4 + \
          [5 + int(t) for t in torch.randint(0, V - 5, (n_post,))]
    return ids


seqs = [sample(3, 6), sample(5, 2)]
tokens = torch.full((2, SEQ), PAD)
target = torch.full((2, SEQ), PAD)
for i, s in enumerate(seqs):
    tokens[i, :len(s)] = torch.tensor(s)
    target[i, :len(s) - 1] = torch.tensor(s[1:])           # shifted labels, rest padded
vision_embeds = torch.randn(8, D, dtype=torch.float64)
image_input_mask = tokens == IMG

attention_mask, loss_mask, position_ids = get_ltor_masks_and_position_ids(tokens, grid, None, target, PAD)
with torch.no_grad():
    logits = model(tokens, position_ids, vision_embeds, image_input_mask, attention_mask)
    worst = 0.0
    for i, s in enumerate(seqs):
        ids = torch.tensor([s])
        pid, _ = get_rope_index(ids, grid[i:i + 1], None, torch.ones_like(ids))
        ref = model(ids, pid, vision_embeds[4 * i:4 * i + 4], ids == IMG)
        worst = max(worst, (logits[i, :len(s)] - ref[0]).abs().max().item())
print("position_ids[0, 0] =", position_ids[0, 0].tolist())
print(f"max |logits(padded batch) - logits(each sample alone)| = {worst:.3e}")
