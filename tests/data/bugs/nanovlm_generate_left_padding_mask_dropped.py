# nanoVLM, models/vision_language_model.py VisionLanguageModel.generate (huggingface/nanoVLM commits 8c87101 + 1e1e95c).
# generate() called the decoder with attention_mask=None in prefill and in every decode step, so the left-padding
# tokens of a batched MMStar prompt (sitting between the image tokens and the text) were attended to.
import sys
import math
from dataclasses import dataclass
import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


@dataclass
class VLMConfig:
    lm_hidden_dim: int = 48
    lm_inter_dim: int = 96
    lm_rms_eps: float = 1e-5
    lm_re_base: int = 100000
    lm_max_position_embeddings: int = 8192
    lm_vocab_size: int = 64
    lm_n_heads: int = 4
    lm_n_kv_heads: int = 2
    lm_dropout: float = 0.0
    lm_n_blocks: int = 2
    lm_attn_scaling: float = 1.0
    IMAGE_TOKEN_LENGTH: int = 4
    lm_use_tokens: bool = False
    lm_tie_weights: bool = True


class RMSNorm(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(cfg.lm_hidden_dim))
        self.eps = cfg.lm_rms_eps

    def forward(self, x):
        irms = torch.rsqrt(torch.mean(x ** 2, dim=-1, keepdim=True) + self.eps)
        return x * irms * self.weight


class RotaryEmbedding(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.dim = cfg.lm_hidden_dim // cfg.lm_n_heads
        self.base = cfg.lm_re_base
        inv_freq = 1.0 / (self.base ** (torch.arange(0, self.dim, 2).float() / self.dim))
        self.register_buffer("inv_freq", inv_freq)
        self.attention_scaling = cfg.lm_attn_scaling

    @torch.no_grad()
    def forward(self, position_ids):
        batch_size, seq_len = position_ids.shape
        freqs = position_ids.reshape(-1).float().unsqueeze(-1) * self.inv_freq.unsqueeze(0)
        freqs = freqs.reshape(batch_size, seq_len, -1)
        emb = torch.cat([freqs, freqs], dim=-1)
        return torch.cos(emb) * self.attention_scaling, torch.sin(emb) * self.attention_scaling


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_embd(q, k, cos, sin, unsqueeze_dim=1):
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


class LanguageModelGroupedQueryAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.n_heads, self.n_kv_heads = cfg.lm_n_heads, cfg.lm_n_kv_heads
        self.embd_dim = cfg.lm_hidden_dim
        self.dropout = cfg.lm_dropout
        self.head_dim = self.embd_dim // self.n_heads
        self.n_kv_groups = self.n_heads // self.n_kv_heads
        self.q_proj = nn.Linear(self.embd_dim, self.embd_dim, bias=False)
        self.k_proj = nn.Linear(self.embd_dim, self.head_dim * self.n_kv_heads, bias=False)
        self.v_proj = nn.Linear(self.embd_dim, self.head_dim * self.n_kv_heads, bias=False)
        self.out_proj = nn.Linear(self.embd_dim, self.embd_dim, bias=False)
        self.attn_dropout = nn.Dropout(self.dropout)
        self.resid_dropout = nn.Dropout(self.dropout)
        # nanoVLM's manual attention path (taken on mps); it combines the causal and padding masks explicitly
        self.sdpa = False

    def forward(self, x, cos, sin, attention_mask=None, block_kv_cache=None):
        is_prefill = block_kv_cache is None
        B, T_curr, C = x.size()
        q_curr = self.q_proj(x).view(B, T_curr, self.n_heads, self.head_dim).transpose(1, 2)
        k_curr = self.k_proj(x).view(B, T_curr, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v_curr = self.v_proj(x).view(B, T_curr, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k_rotated = apply_rotary_pos_embd(q_curr, k_curr, cos, sin)
        if not is_prefill and block_kv_cache['key'] is not None:
            k = torch.cat([block_kv_cache['key'], k_rotated], dim=2)
            v = torch.cat([block_kv_cache['value'], v_curr], dim=2)
            block_kv_cache['key'], block_kv_cache['value'] = k, v
        else:
            k, v = k_rotated, v_curr
            block_kv_cache = {'key': k, 'value': v}
        k_exp = k.repeat_interleave(self.n_kv_groups, dim=1)
        v_exp = v.repeat_interleave(self.n_kv_groups, dim=1)
        T_kv = k_exp.size(2)

        # attention_mask is (B, T_kv_total_length), 1 for attend, 0 for pad
        additive_attn_mask = None
        if attention_mask is not None:
            mask_for_keys = attention_mask[:, :T_kv]
            additive_attn_mask = (1.0 - mask_for_keys.unsqueeze(1).unsqueeze(2).float()) * torch.finfo(q.dtype).min

        if self.sdpa and x.device.type != 'mps':
            is_causal = (T_curr == T_kv and T_curr > 1)
            y = F.scaled_dot_product_attention(q, k_exp, v_exp, attn_mask=additive_attn_mask,
                                               dropout_p=self.dropout if self.training else 0.0, is_causal=is_causal)
        else:
            attn = torch.matmul(q, k_exp.transpose(2, 3)) / math.sqrt(self.head_dim)
            if T_curr == T_kv and T_curr > 1:
                causal_mask_val = torch.tril(torch.ones(T_curr, T_curr, dtype=torch.bool)).view(1, 1, T_curr, T_curr)
                attn = attn.masked_fill(~causal_mask_val, float('-inf'))
            if additive_attn_mask is not None:
                attn = attn + additive_attn_mask
            attn = F.softmax(attn, dim=-1)
            attn = self.attn_dropout(attn)
            y = attn @ v_exp
        y = y.transpose(1, 2).contiguous().view(B, T_curr, C)
        return self.resid_dropout(self.out_proj(y)), block_kv_cache


class LanguageModelMLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.lm_hidden_dim, cfg.lm_inter_dim, bias=False)
        self.up_proj = nn.Linear(cfg.lm_hidden_dim, cfg.lm_inter_dim, bias=False)
        self.down_proj = nn.Linear(cfg.lm_inter_dim, cfg.lm_hidden_dim, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LanguageModelBlock(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.mlp = LanguageModelMLP(cfg)
        self.attn = LanguageModelGroupedQueryAttention(cfg)
        self.norm1, self.norm2 = RMSNorm(cfg), RMSNorm(cfg)

    def forward(self, x, cos, sin, attention_mask=None, block_kv_cache=None):
        h, block_kv_cache = self.attn(self.norm1(x), cos, sin, attention_mask, block_kv_cache)
        x = x + h
        return x + self.mlp(self.norm2(x)), block_kv_cache


class LanguageModel(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.lm_use_tokens = cfg.lm_use_tokens
        self.token_embedding = nn.Embedding(cfg.lm_vocab_size, cfg.lm_hidden_dim)
        self.rotary_embd = RotaryEmbedding(cfg)
        self.blocks = nn.ModuleList([LanguageModelBlock(cfg) for _ in range(cfg.lm_n_blocks)])
        self.norm = RMSNorm(cfg)
        self.head = nn.Linear(cfg.lm_hidden_dim, cfg.lm_vocab_size, bias=False)
        self.head.weight = self.token_embedding.weight

    def forward(self, x, attention_mask=None, kv_cache=None, start_pos=0):
        B, T_curr, _ = x.size()
        current_position_ids = torch.arange(start_pos, start_pos + T_curr).unsqueeze(0).expand(B, -1)
        cos, sin = self.rotary_embd(current_position_ids)
        if kv_cache is None:
            kv_cache = [None] * len(self.blocks)
        for i, block in enumerate(self.blocks):
            x, kv_cache[i] = block(x, cos, sin, attention_mask, kv_cache[i])
        return self.norm(x), kv_cache


class VisionLanguageModel(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        # stand-in for ViT + ModalityProjector: patch features -> IMAGE_TOKEN_LENGTH LM embeddings
        self.vision_encoder = nn.Linear(12, cfg.lm_hidden_dim)
        self.MP = nn.Linear(cfg.lm_hidden_dim, cfg.lm_hidden_dim)
        self.decoder = LanguageModel(cfg)
        self.step_logits = []

    @torch.inference_mode()
    def generate(self, input_ids, image, attention_mask=None, max_new_tokens=5, greedy=True, use_kv_cache=True):
        self.step_logits = []
        image_embd = self.MP(self.vision_encoder(image))
        prompt_token_embeds = self.decoder.token_embedding(input_ids)
        initial_combined_embeds = torch.cat((image_embd, prompt_token_embeds), dim=1)
        current_total_seq_len = initial_combined_embeds.size(1)

        batch_size = image_embd.size(0)
        if FIXED and attention_mask is not None:
            img_seq_len = image_embd.size(1)
            image_attention_mask = torch.ones((batch_size, img_seq_len), dtype=attention_mask.dtype)
            attention_mask = torch.cat((image_attention_mask, attention_mask), dim=1)
        elif not FIXED:
            attention_mask = None

        prefill_output, kv_cache_list = self.decoder(initial_combined_embeds, attention_mask=attention_mask,
                                                     kv_cache=None, start_pos=0)
        current_logits = self.decoder.head(prefill_output[:, -1, :])
        newly_generated_ids_list = []
        for _ in range(max_new_tokens):
            self.step_logits.append(current_logits)
            next_token_id = torch.argmax(current_logits, dim=-1, keepdim=True)
            newly_generated_ids_list.append(next_token_id)
            next_token_embed = self.decoder.token_embedding(next_token_id)
            current_token_start_pos = current_total_seq_len
            current_total_seq_len += 1
            if attention_mask is not None:
                attention_mask = torch.cat((attention_mask, torch.ones((batch_size, 1), dtype=attention_mask.dtype)), dim=1)
            if use_kv_cache:
                decode_step_output, kv_cache_list = self.decoder(next_token_embed, attention_mask=attention_mask,
                                                                 kv_cache=kv_cache_list, start_pos=current_token_start_pos)
            else:
                generated_token_embeds = torch.cat([self.decoder.token_embedding(t) for t in newly_generated_ids_list], dim=1)
                full_sequence_embeds = torch.cat([initial_combined_embeds, generated_token_embeds], dim=1)
                decode_step_output, _ = self.decoder(full_sequence_embeds, attention_mask=attention_mask,
                                                     kv_cache=None, start_pos=0)
            current_logits = self.decoder.head(decode_step_output[:, -1, :])
        return torch.cat(newly_generated_ids_list, dim=1)


cfg = VLMConfig()
model = VisionLanguageModel(cfg).eval()
prompts = [[5, 9, 11, 3, 17, 21, 8, 30], [12, 4, 40]]
T = max(len(p) for p in prompts)
image = torch.randn(2, cfg.IMAGE_TOKEN_LENGTH, 12)


def left_padded(pad_token_id):
    # MMStar collator: tokenizer(..., padding="max_length", padding_side="left")
    ids = torch.full((2, T), pad_token_id)
    mask = torch.zeros(2, T, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, T - len(p):] = torch.tensor(p)
        mask[i, T - len(p):] = 1
    return ids, mask


worst = 0.0
for use_kv_cache in (True, False):
    outs = []
    for pad_id in (0, 33):          # masked pads must not matter, whatever their token id
        ids, mask = left_padded(pad_id)
        gen = model.generate(ids, image, mask, max_new_tokens=4, use_kv_cache=use_kv_cache)
        outs.append((gen, torch.stack(model.step_logits)))
    d = (outs[0][1] - outs[1][1]).abs().max().item()
    worst = max(worst, d)
    print(f"use_kv_cache={use_kv_cache}: generated {outs[0][0].tolist()} vs {outs[1][0].tolist()}, logit diff {d:.3e}")
print(f"max |logits(pad id 0) - logits(pad id 33)| over all decode steps = {worst:.3e}")
