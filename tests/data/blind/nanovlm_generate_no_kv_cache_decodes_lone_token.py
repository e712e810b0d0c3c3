# huggingface/nanoVLM commit b57fca1 ("kashif's fix to make kv cache true/false produce same results",
# on the kv-cache branch merged as PR #69, merge a173568): models/vision_language_model.py
# VisionLanguageModel.generate, models/language_model.py LanguageModel / LanguageModelGroupedQueryAttention.
#
# Bug: generate(..., use_kv_cache=False) fed each decode step only the newly sampled token's embedding,
# with kv_cache=None and start_pos=0.  With no cache the attention layer treats that step as a fresh
# prefill: the new token sits at RoPE position 0 and its keys/values are the only ones it sees, so the
# image and the prompt drop out of every token after the first.
# Fix: without a cache, rebuild image + prompt + generated tokens and run the whole sequence from
# position 0 (causal prefill), reading the last row.
#
# Trimmed: the SigLIP ViT + modality projector are replaced by a linear patch projector (image tokens
# come first, as in the project); sizes are tiny; weights are random.
import math
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


@dataclass
class VLMConfig:
    vit_patch_dim: int = 12
    mp_image_token_length: int = 4
    lm_hidden_dim: int = 64
    lm_inter_dim: int = 128
    lm_rms_eps: float = 1e-5
    lm_re_base: int = 100000
    lm_max_position_embeddings: int = 128
    lm_attn_scaling: float = 1.0
    lm_vocab_size: int = 97
    lm_n_heads: int = 4
    lm_n_kv_heads: int = 2
    lm_dropout: float = 0.0
    lm_n_blocks: int = 2
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
        self.original_max_seq_len = cfg.lm_max_position_embeddings
        self.attention_scaling = cfg.lm_attn_scaling

    @torch.no_grad()
    def forward(self, position_ids):
        batch_size, seq_len = position_ids.shape
        max_seq = position_ids.max() + 1
        if max_seq > self.original_max_seq_len:
            inv_freq = self.inv_freq / (max_seq / self.original_max_seq_len)
        else:
            inv_freq = self.inv_freq
        flat_position_ids = position_ids.reshape(-1).float()
        freqs = flat_position_ids.unsqueeze(-1) * inv_freq.unsqueeze(0)
        freqs = freqs.reshape(batch_size, seq_len, -1)
        emb = torch.cat([freqs, freqs], dim=-1)
        return torch.cos(emb) * self.attention_scaling, torch.sin(emb) * self.attention_scaling


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_embd(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


class LanguageModelGroupedQueryAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.n_heads = cfg.lm_n_heads
        self.n_kv_heads = cfg.lm_n_kv_heads
        self.embd_dim = cfg.lm_hidden_dim
        self.dropout = cfg.lm_dropout
        self.n_kv_groups = self.n_heads // self.n_kv_heads
        self.head_dim = self.embd_dim // self.n_heads
        self.q_proj = nn.Linear(self.embd_dim, self.embd_dim, bias=False)
        self.k_proj = nn.Linear(self.embd_dim, self.head_dim * self.n_kv_heads, bias=False)
        self.v_proj = nn.Linear(self.embd_dim, self.head_dim * self.n_kv_heads, bias=False)
        self.out_proj = nn.Linear(self.embd_dim, self.embd_dim, bias=False)
        self.attn_dropout = nn.Dropout(self.dropout)
        self.resid_dropout = nn.Dropout(self.dropout)
        self.sdpa = hasattr(torch.nn.functional, 'scaled_dot_product_attention')

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
            block_kv_cache['key'] = k
            block_kv_cache['value'] = v
        else:
            k = k_rotated
            v = v_curr
            block_kv_cache = {'key': k, 'value': v}

        k_exp = k.repeat_interleave(self.n_kv_groups, dim=1)
        v_exp = v.repeat_interleave(self.n_kv_groups, dim=1)
        T_kv = k_exp.size(2)

        additive_attn_mask = None
        if attention_mask is not None:
            mask_for_keys = attention_mask[:, :T_kv]
            additive_attn_mask = (1.0 - mask_for_keys.unsqueeze(1).unsqueeze(2).float()) * torch.finfo(q.dtype).min

        if self.sdpa and x.device.type != 'mps':
            is_causal_sdpa = (is_prefill and T_curr > 1)
            y = torch.nn.functional.scaled_dot_product_attention(
                q, k_exp, v_exp,
                attn_mask=additive_attn_mask,
                dropout_p=self.dropout if self.training else 0.0,
                is_causal=is_causal_sdpa
            )
        else:
            attn = torch.matmul(q, k_exp.transpose(2, 3)) / math.sqrt(self.head_dim)
            if is_prefill and T_curr > 1 and T_curr == T_kv:
                causal_mask_val = torch.tril(torch.ones(T_curr, T_curr, device=x.device, dtype=torch.bool)).view(1, 1, T_curr, T_curr)
                attn = attn.masked_fill(~causal_mask_val, float('-inf'))
            if additive_attn_mask is not None:
                attn = attn + additive_attn_mask
            attn = F.softmax(attn, dim=-1)
            attn = self.attn_dropout(attn)
            y = attn @ v_exp

        y = y.transpose(1, 2).contiguous().view(B, T_curr, C)
        y = self.resid_dropout(self.out_proj(y))
        return y, block_kv_cache


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
        self.norm1 = RMSNorm(cfg)
        self.norm2 = RMSNorm(cfg)

    def forward(self, x, cos, sin, attention_mask=None, block_kv_cache=None):
        res = x
        x, block_kv_cache = self.attn(self.norm1(x), cos, sin, attention_mask, block_kv_cache)
        x = res + x
        x = x + self.mlp(self.norm2(x))
        return x, block_kv_cache


class LanguageModel(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.lm_use_tokens = cfg.lm_use_tokens
        self.token_embedding = nn.Embedding(cfg.lm_vocab_size, cfg.lm_hidden_dim)
        self.rotary_embd = RotaryEmbedding(cfg)
        self.blocks = nn.ModuleList([LanguageModelBlock(cfg) for _ in range(cfg.lm_n_blocks)])
        self.norm = RMSNorm(cfg)
        self.head = nn.Linear(cfg.lm_hidden_dim, cfg.lm_vocab_size, bias=False)
        if cfg.lm_tie_weights:
            self.head.weight = self.token_embedding.weight

    def forward(self, x, attention_mask=None, kv_cache=None, start_pos=0):
        if self.lm_use_tokens:
            x = self.token_embedding(x)
        B, T_curr, _ = x.size()
        current_position_ids = torch.arange(start_pos, start_pos + T_curr, device=x.device).unsqueeze(0).expand(B, -1)
        cos, sin = self.rotary_embd(current_position_ids)
        if kv_cache is None:
            kv_cache = [None] * len(self.blocks)
        for i, block in enumerate(self.blocks):
            x, kv_cache[i] = block(x, cos, sin, attention_mask, kv_cache[i])
        x = self.norm(x)
        if self.lm_use_tokens:
            x = self.head(x)
        return x, kv_cache


class ModalityProjector(nn.Module):
    # stand-in for ViT + pixel-shuffle projector: patch features -> LM hidden size
    def __init__(self, cfg):
        super().__init__()
        self.proj = nn.Linear(cfg.vit_patch_dim, cfg.lm_hidden_dim, bias=False)

    def forward(self, x):
        return self.proj(x)


class VisionLanguageModel(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.decoder = LanguageModel(cfg)
        self.MP = ModalityProjector(cfg)

    @torch.inference_mode()
    def generate(self, input_ids, image, max_new_tokens=5, greedy=True, use_kv_cache: bool = True):
        B = image.size(0)
        image_embd = self.MP(image)
        prompt_token_embeds = self.decoder.token_embedding(input_ids)
        initial_combined_embeds = torch.cat((image_embd, prompt_token_embeds), dim=1)
        current_total_seq_len = initial_combined_embeds.size(1)

        prefill_output, kv_cache_list = self.decoder(
            initial_combined_embeds, attention_mask=None, kv_cache=None, start_pos=0)
        last_token_output_from_prefill = prefill_output[:, -1, :]
        current_logits = self.decoder.head(last_token_output_from_prefill)

        newly_generated_ids_list = []
        step_logits = []
        for _ in range(max_new_tokens):
            next_token_id = torch.argmax(current_logits, dim=-1, keepdim=True)
            newly_generated_ids_list.append(next_token_id)
            next_token_embed = self.decoder.token_embedding(next_token_id)
            current_token_start_pos = current_total_seq_len
            current_total_seq_len += 1

            if not FIXED:
                decode_step_output, kv_cache_list = self.decoder(
                    next_token_embed,
                    attention_mask=None,
                    kv_cache=kv_cache_list if use_kv_cache else None,
                    start_pos=current_token_start_pos if use_kv_cache else 0
                )
            elif use_kv_cache:
                decode_step_output, kv_cache_list = self.decoder(
                    next_token_embed, attention_mask=None, kv_cache=kv_cache_list,
                    start_pos=current_token_start_pos)
            else:
                generated_token_embeds = torch.cat(
                    [self.decoder.token_embedding(tid) for tid in newly_generated_ids_list], dim=1)
                full_sequence_embeds = torch.cat([initial_combined_embeds, generated_token_embeds], dim=1)
                decode_step_output, _ = self.decoder(
                    full_sequence_embeds, attention_mask=None, kv_cache=None, start_pos=0)

            last_token_output = decode_step_output[:, -1, :]
            current_logits = self.decoder.head(last_token_output)
            step_logits.append(current_logits)

        return torch.cat(newly_generated_ids_list, dim=1), torch.stack(step_logits, dim=1)


def main():
    torch.manual_seed(0)
    cfg = VLMConfig()
    model = VisionLanguageModel(cfg).eval()
    B = 2
    image = torch.randn(B, cfg.mp_image_token_length, cfg.vit_patch_dim)
    input_ids = torch.randint(0, cfg.lm_vocab_size, (B, 6))
    # eval-style generation without a cache (as the README's "use_kv_cache=False" comparison runs it)
    ids, logits = model.generate(input_ids, image, max_new_tokens=6, greedy=True, use_kv_cache=False)
    print("generated:", ids.tolist())
    print("last-step logits[:, :4]:", [[round(v, 4) for v in row] for row in logits[:, -1, :4].tolist()])


if __name__ == "__main__":
    main()
