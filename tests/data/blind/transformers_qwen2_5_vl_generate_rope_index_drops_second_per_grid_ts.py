# huggingface/transformers#41153 (fixes #41152): Qwen2.5-VL's prepare_inputs_for_generation
# called self.model.get_rope_index(input_ids, image_grid_thw, video_grid_thw, attention_mask)
# without second_per_grid_ts, so at generation the video's temporal M-RoPE positions fell back
# to second_per_grid_t = 1.0 (t_index = t * 1.0 * tokens_per_second) while training / forward
# used the real seconds per temporal grid. The text after the video, and the rope_deltas kept
# for every decode step, shift too. Fix: pass second_per_grid_ts=second_per_grid_ts.
# Ported (trimmed, plain torch) from transformers 4.56 modeling_qwen2_5_vl.py: get_rope_index
# (video branch), prepare_inputs_for_generation's position logic, M-RoPE attention, a greedy
# decode loop with a KV cache. Tiny random weights, CPU.
import sys
import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class VisionConfig:
    spatial_merge_size = 2
    tokens_per_second = 2


class Config:
    vocab_size = 64
    hidden_size = 48
    num_attention_heads = 2
    head_dim = 24
    rope_theta = 10000.0
    mrope_section = [4, 4, 4]  # sums to head_dim // 2
    image_token_id = 60
    video_token_id = 61
    vision_start_token_id = 62
    vision_config = VisionConfig()


class Qwen2_5_VLModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.rope_deltas = None
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.q_proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.k_proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.v_proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.o_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        inv = 1.0 / (config.rope_theta ** (torch.arange(0, config.head_dim, 2).float() / config.head_dim))
        self.register_buffer("inv_freq", inv, persistent=False)

    def get_rope_index(self, input_ids=None, image_grid_thw=None, video_grid_thw=None,
                       second_per_grid_ts=None, attention_mask=None):
        spatial_merge_size = self.config.vision_config.spatial_merge_size
        video_token_id = self.config.video_token_id
        vision_start_token_id = self.config.vision_start_token_id
        mrope_position_deltas = []
        total_input_ids = input_ids
        if attention_mask is None:
            attention_mask = torch.ones_like(total_input_ids)
        position_ids = torch.ones(3, input_ids.shape[0], input_ids.shape[1], dtype=input_ids.dtype)
        video_index = 0
        for i, input_ids in enumerate(total_input_ids):
            input_ids = input_ids[attention_mask[i] == 1]
            vision_start_indices = torch.argwhere(input_ids == vision_start_token_id).squeeze(1)
            vision_tokens = input_ids[vision_start_indices + 1]
            video_nums = (vision_tokens == video_token_id).sum()
            input_tokens = input_ids.tolist()
            llm_pos_ids_list = []
            st = 0
            remain_videos = video_nums
            for _ in range(video_nums):
                ed = input_tokens.index(video_token_id, st) if video_token_id in input_tokens and remain_videos > 0 else len(input_tokens) + 1
                t, h, w = video_grid_thw[video_index]
                if second_per_grid_ts is not None:
                    second_per_grid_t = second_per_grid_ts[video_index]
                else:
                    second_per_grid_t = 1.0
                video_index += 1
                remain_videos -= 1
                llm_grid_t, llm_grid_h, llm_grid_w = t.item(), h.item() // spatial_merge_size, w.item() // spatial_merge_size
                text_len = ed - st
                st_idx = llm_pos_ids_list[-1].max() + 1 if len(llm_pos_ids_list) > 0 else 0
                llm_pos_ids_list.append(torch.arange(text_len).view(1, -1).expand(3, -1) + st_idx)
                range_tensor = torch.arange(llm_grid_t).view(-1, 1)
                expanded_range = range_tensor.expand(-1, llm_grid_h * llm_grid_w)
                second_per_grid_t = torch.as_tensor(second_per_grid_t, dtype=range_tensor.dtype)
                time_tensor = expanded_range * second_per_grid_t * self.config.vision_config.tokens_per_second
                t_index = time_tensor.long().flatten()
                h_index = torch.arange(llm_grid_h).view(1, -1, 1).expand(llm_grid_t, -1, llm_grid_w).flatten()
                w_index = torch.arange(llm_grid_w).view(1, 1, -1).expand(llm_grid_t, llm_grid_h, -1).flatten()
                llm_pos_ids_list.append(torch.stack([t_index, h_index, w_index]) + text_len + st_idx)
                st = ed + llm_grid_t * llm_grid_h * llm_grid_w
            if st < len(input_tokens):
                st_idx = llm_pos_ids_list[-1].max() + 1 if len(llm_pos_ids_list) > 0 else 0
                text_len = len(input_tokens) - st
                llm_pos_ids_list.append(torch.arange(text_len).view(1, -1).expand(3, -1) + st_idx)
            llm_positions = torch.cat(llm_pos_ids_list, dim=1).reshape(3, -1)
            position_ids[..., i, attention_mask[i] == 1] = llm_positions.to(position_ids.dtype)
            mrope_position_deltas.append(llm_positions.max() + 1 - len(total_input_ids[i]))
        mrope_position_deltas = torch.tensor(mrope_position_deltas).unsqueeze(1)
        return position_ids, mrope_position_deltas

    def rope(self, position_ids):
        # (3, B, L) -> cos/sin (B, L, head_dim) with mrope_section interleaving
        freqs = position_ids[..., None].float() * self.inv_freq  # 3, B, L, hd/2
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = emb.cos(), emb.sin()
        sec = self.config.mrope_section * 2
        cos = torch.cat([m[i % 3] for i, m in enumerate(cos.split(sec, dim=-1))], dim=-1)
        sin = torch.cat([m[i % 3] for i, m in enumerate(sin.split(sec, dim=-1))], dim=-1)
        return cos, sin

    def forward(self, input_ids, position_ids, past_key_values):
        cfg = self.config
        x = self.embed_tokens(input_ids)
        B, L, _ = x.shape
        nh, hd = cfg.num_attention_heads, cfg.head_dim
        q = self.q_proj(x).view(B, L, nh, hd).transpose(1, 2)
        k = self.k_proj(x).view(B, L, nh, hd).transpose(1, 2)
        v = self.v_proj(x).view(B, L, nh, hd).transpose(1, 2)
        cos, sin = self.rope(position_ids)
        cos, sin = cos[:, None], sin[:, None]

        def rot(t):
            a, b = t[..., : hd // 2], t[..., hd // 2:]
            return torch.cat([-b, a], dim=-1)

        q = q * cos + rot(q) * sin
        k = k * cos + rot(k) * sin
        if past_key_values:
            k = torch.cat([past_key_values[0], k], dim=2)
            v = torch.cat([past_key_values[1], v], dim=2)
        past_key_values[:] = [k, v]
        out = F.scaled_dot_product_attention(q, k, v, is_causal=L > 1)
        return x + self.o_proj(out.transpose(1, 2).reshape(B, L, -1))


class Qwen2_5_VLForConditionalGeneration(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.model = Qwen2_5_VLModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def prepare_inputs_for_generation(self, input_ids, cache_position, attention_mask=None,
                                      video_grid_thw=None, second_per_grid_ts=None):
        if cache_position[0] != 0:
            input_ids = input_ids[:, cache_position]
        if cache_position[0] == 0 or self.model.rope_deltas is None:
            if FIXED:
                position_ids, rope_deltas = self.model.get_rope_index(
                    input_ids, None, video_grid_thw,
                    second_per_grid_ts=second_per_grid_ts, attention_mask=attention_mask)
            else:
                position_ids, rope_deltas = self.model.get_rope_index(
                    input_ids, None, video_grid_thw, attention_mask=attention_mask)
            self.model.rope_deltas = rope_deltas
        else:
            batch_size, seq_length = input_ids.shape
            delta = cache_position[0] + self.model.rope_deltas
            position_ids = torch.arange(seq_length).view(1, -1).expand(batch_size, -1) + delta
            position_ids = position_ids.unsqueeze(0).expand(3, -1, -1)
        return {"input_ids": input_ids, "position_ids": position_ids}

    def forward(self, input_ids, position_ids, past_key_values):
        return self.lm_head(self.model(input_ids, position_ids, past_key_values))


cfg = Config()
model = Qwen2_5_VLForConditionalGeneration(cfg).eval()

# <text> <vision_start> <video x (t*h*w/4)> <text>; 3 temporal grids of 4x4 patches -> 12 video tokens
video_grid_thw = torch.tensor([[3, 4, 4]])
second_per_grid_ts = [2.0]  # processor: temporal_patch_size / fps = 2 / 1.0
n_vid = 3 * 4 * 4 // 4
input_ids = torch.tensor([[5, 6, 7, cfg.vision_start_token_id] + [cfg.video_token_id] * n_vid + [63, 8, 9, 10]])
attention_mask = torch.ones_like(input_ids)

past = []
generated = input_ids
cache_position = torch.arange(input_ids.shape[1])
step_logits = []
with torch.no_grad():
    for step in range(5):
        inputs = model.prepare_inputs_for_generation(generated, cache_position, attention_mask,
                                                     video_grid_thw, second_per_grid_ts)
        logits = model(inputs["input_ids"], inputs["position_ids"], past)[:, -1]
        step_logits.append(logits)
        nxt = logits.argmax(-1, keepdim=True)
        generated = torch.cat([generated, nxt], dim=-1)
        attention_mask = torch.cat([attention_mask, torch.ones_like(nxt)], dim=-1)
        cache_position = cache_position[-1:] + 1

print("rope_deltas:", model.model.rope_deltas.tolist())
print("generated:", generated[0, input_ids.shape[1]:].tolist())
print("last-step logits[:4]:", [round(v, 4) for v in step_logits[-1][0, :4].tolist()])
