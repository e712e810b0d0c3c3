# LLaMA-Factory (hiyouga/LlamaFactory#7754): MultiModalDataCollatorForSeq2Seq passed the neat_packing attention mask
# (segment ids 1,2,3..) to Qwen2-VL get_rope_index, which keeps only tokens where mask == 1; later packed segments got position 1.
import sys
import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
IMAGE_TOKEN_ID, VIDEO_TOKEN_ID, VISION_START_ID = 61, 62, 60
SPATIAL_MERGE = 2


def get_rope_index(input_ids, image_grid_thw=None, video_grid_thw=None, attention_mask=None):
    """Qwen2VLForConditionalGeneration.get_rope_index (transformers 4.51), vision branch kept."""
    mrope_position_deltas = []
    if input_ids is not None and (image_grid_thw is not None or video_grid_thw is not None):
        total_input_ids = input_ids
        if attention_mask is None:
            attention_mask = torch.ones_like(total_input_ids)
        position_ids = torch.ones(3, input_ids.shape[0], input_ids.shape[1], dtype=input_ids.dtype)
        image_index = 0
        attention_mask = attention_mask.to(total_input_ids.device)
        for i, input_ids in enumerate(total_input_ids):
            input_ids = input_ids[attention_mask[i] == 1]
            vision_start_indices = torch.argwhere(input_ids == VISION_START_ID).squeeze(1)
            vision_tokens = input_ids[vision_start_indices + 1]
            image_nums = (vision_tokens == IMAGE_TOKEN_ID).sum()
            input_tokens = input_ids.tolist()
            llm_pos_ids_list = []
            st = 0
            remain_images = image_nums
            for _ in range(image_nums):
                ed = input_tokens.index(IMAGE_TOKEN_ID, st)
                t, h, w = image_grid_thw[image_index]
                image_index += 1
                llm_grid_t, llm_grid_h, llm_grid_w = t.item(), h.item() // SPATIAL_MERGE, w.item() // SPATIAL_MERGE
                text_len = ed - st
                st_idx = llm_pos_ids_list[-1].max() + 1 if len(llm_pos_ids_list) > 0 else 0
                llm_pos_ids_list.append(torch.arange(text_len).view(1, -1).expand(3, -1) + st_idx)
                t_index = torch.arange(llm_grid_t).view(-1, 1).expand(-1, llm_grid_h * llm_grid_w).flatten()
                h_index = torch.arange(llm_grid_h).view(1, -1, 1).expand(llm_grid_t, -1, llm_grid_w).flatten()
                w_index = torch.arange(llm_grid_w).view(1, 1, -1).expand(llm_grid_t, llm_grid_h, -1).flatten()
                llm_pos_ids_list.append(torch.stack([t_index, h_index, w_index]) + text_len + st_idx)
                st = ed + llm_grid_t * llm_grid_h * llm_grid_w
                remain_images -= 1
            if st < len(input_tokens):
                st_idx = llm_pos_ids_list[-1].max() + 1 if len(llm_pos_ids_list) > 0 else 0
                text_len = len(input_tokens) - st
                llm_pos_ids_list.append(torch.arange(text_len).view(1, -1).expand(3, -1) + st_idx)
            llm_positions = torch.cat(llm_pos_ids_list, dim=1).reshape(3, -1)
            position_ids[..., i, attention_mask[i] == 1] = llm_positions.to(position_ids.device)
            mrope_position_deltas.append(llm_positions.max() + 1 - len(total_input_ids[i]))
        mrope_position_deltas = torch.tensor(mrope_position_deltas).unsqueeze(1)
        return position_ids, mrope_position_deltas
    raise NotImplementedError


def prepare_4d_attention_mask(attention_mask_with_indices, dtype):
    _, seq_len = attention_mask_with_indices.size()
    min_dtype = torch.finfo(dtype).min
    zero_tensor = torch.tensor(0, dtype=dtype)
    non_padding_mask = (attention_mask_with_indices != 0).unsqueeze(1).unsqueeze(2)
    indices = attention_mask_with_indices.unsqueeze(1).unsqueeze(2)
    indices_t = attention_mask_with_indices.unsqueeze(1).unsqueeze(3)
    tril_mask = torch.tril(torch.ones((seq_len, seq_len), dtype=torch.bool))
    attention_mask_4d = (indices == indices_t) & non_padding_mask & tril_mask
    return torch.where(attention_mask_4d, zero_tensor, min_dtype)


def collate(input_ids, attention_mask, image_grid_thw):
    """SFTDataCollatorWith4DAttentionMask(block_diag_attn=True) on a neat_packing batch, trimmed."""
    features = {"input_ids": input_ids, "attention_mask": attention_mask}
    rope_index_kwargs = {
        "input_ids": features["input_ids"],
        "image_grid_thw": image_grid_thw,
        "video_grid_thw": None,
        "attention_mask": (features["attention_mask"] >= 1).float() if FIXED else features["attention_mask"],
    }
    features["position_ids"], features["rope_deltas"] = get_rope_index(**rope_index_kwargs)
    features["attention_mask"] = prepare_4d_attention_mask(features["attention_mask"], torch.float32)
    return features


def rotate_half(x):
    return torch.cat((-x[..., x.shape[-1] // 2:], x[..., : x.shape[-1] // 2]), dim=-1)


class Qwen2VLTinyLM(nn.Module):
    def __init__(self, vocab=64, d=32, heads=4, layers=2, mrope_section=(2, 1, 1)):
        super().__init__()
        self.h, self.hd, self.mrope_section = heads, d // heads, list(mrope_section)
        self.emb = nn.Embedding(vocab, d)
        self.qkv = nn.ModuleList(nn.Linear(d, 3 * d) for _ in range(layers))
        self.o = nn.ModuleList(nn.Linear(d, d) for _ in range(layers))
        self.inv_freq = 1.0 / (10000 ** (torch.arange(0, self.hd, 2).float() / self.hd))
        self.head = nn.Linear(d, vocab)

    def rope(self, position_ids):  # position_ids: (3, B, T)
        freqs = position_ids[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        sec = self.mrope_section * 2
        cos = torch.cat([m[i % 3] for i, m in enumerate(cos.split(sec, dim=-1))], dim=-1).unsqueeze(1)
        sin = torch.cat([m[i % 3] for i, m in enumerate(sin.split(sec, dim=-1))], dim=-1).unsqueeze(1)
        return cos, sin

    def forward(self, input_ids, attention_mask, position_ids):
        x = self.emb(input_ids)
        B, T, _ = x.shape
        cos, sin = self.rope(position_ids)
        for qkv, o in zip(self.qkv, self.o):
            q, k, v = qkv(x).view(B, T, 3, self.h, self.hd).permute(2, 0, 3, 1, 4)
            q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask)
            x = x + o(a.transpose(1, 2).reshape(B, T, -1))
        return self.head(x)


lens = [[5, 4, 6], [7, 6]]
T = 16
input_ids = torch.randint(1, 59, (2, T))
attention_mask = torch.zeros(2, T, dtype=torch.long)
for b, ls in enumerate(lens):
    s = 0
    for seg, n in enumerate(ls):
        attention_mask[b, s:s + n] = seg + 1
        s += n
image_grid_thw = torch.tensor([[1, 2, 2]])  # grid of the collator's fake image (its tokens are padding)
batch = collate(input_ids, attention_mask, image_grid_thw)
model = Qwen2VLTinyLM().eval()
with torch.no_grad():
    packed = model(batch["input_ids"], batch["attention_mask"], batch["position_ids"])
    diff = 0.0
    for b, ls in enumerate(lens):
        s = 0
        for n in ls:
            ids = input_ids[b:b + 1, s:s + n]
            pos = torch.arange(n).view(1, 1, n).expand(3, 1, n)
            causal = torch.zeros(n, n).masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
            alone = model(ids, causal, pos)
            diff = max(diff, (packed[b, s:s + n] - alone[0]).abs().max().item())
            s += n
print("position_ids[0] row 0:", batch["position_ids"][0, 0].tolist())
print("max |packed logits - each sequence alone|:", f"{diff:.6f}")
