# Unified-Diffusion-VLA (UD-VLA, discrete-diffusion VLA on an Emu3 backbone): the JD3P training
# sequence is [text | first image | masked future image | action | pad] and the README's
# `--use_blockwise_attn_mask True` means: causal inside the text, bidirectional inside each
# image / action block, causal across blocks.
#
# Citation: OpenHelix-Team/Unified-Diffusion-VLA#5 (commit 0925911, "build attention mask by token
# level"; reference/Emu3/emu3/mllm/modeling_emu3.py + train/datasets.py Emu3SFTDatasetI2IA_mi).
# The call was commented back out in 5a04d88 pending inference changes; see issue #12.
#
# Before: Emu3Model.forward built the 4-D bias with build_blockwise_attn_mask(input_ids, ...),
# which finds blocks from the BOI/EOI/BOA/EOA token ids and starts a new block only where
# "is image" flips. The first image, the masked future image and the action chunk sit back to
# back, so they form one block.
# After: the dataset writes token_levels (-1 pad, 0 text, 1, 2, 3, ... one level per
# image / action block), and build_blockwise_causal_attn_mask(token_levels) starts a new block at
# every level change.
import math
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

BOS_ID = 151849
PAD_ID = 151643
BOI_ID, EOI_ID = 151852, 151853
BOA_ID, EOA_ID = 151844, 151845
MASK_ID = 151846
VOCAB = 151860


class Emu3Config:
    vocab_size = VOCAB
    hidden_size = 32
    intermediate_size = 64
    num_hidden_layers = 2
    num_attention_heads = 4
    rope_theta = 1000000.0
    rms_norm_eps = 1e-5
    use_blockwise_attn_mask = True
    model_max_length = 40


def build_blockwise_attn_mask(
    sequence,
    boi_token_id=151852,
    eoi_token_id=151853,
    boa_token_id=151844,
    eoa_token_id=151845,
    pad_token_id=151643,
    include_boundary_as_image=True,
    return_bool_mask=True,
    past_key_values_length=0,
):
    B, L = sequence.shape
    device = sequence.device
    P = int(past_key_values_length)

    is_pad = sequence == pad_token_id
    is_boi = (sequence == boi_token_id) | (sequence == boa_token_id)
    is_eoi = (sequence == eoi_token_id) | (sequence == eoa_token_id)

    starts_cum = torch.cumsum(is_boi, dim=1)
    ends_cum = torch.cumsum(is_eoi, dim=1)
    level = (starts_cum - ends_cum).clamp(min=0)
    is_image = (level > 0) | is_boi | is_eoi if include_boundary_as_image else (level > 0)
    is_text = ~is_image

    cur = is_image
    prev = torch.zeros_like(cur)
    prev[:, 1:] = cur[:, :-1]
    block_start = (cur != prev) | torch.zeros((B, 1), dtype=torch.bool, device=device)
    block_id = torch.cumsum(block_start.to(torch.int32), dim=1)

    query_block = block_id[:, :, None]
    key_block = block_id[:, None, :]
    allowed_cur = key_block <= query_block

    tril = torch.tril(torch.ones((L, L), dtype=torch.bool, device=device))
    allowed_cur &= (~is_text)[:, :, None] | tril[None, :, :]

    allowed_cur &= ~is_pad[:, None, :]

    if P > 0:
        allowed_past = torch.ones((B, L, P), dtype=torch.bool, device=device)
        allowed_full = torch.cat([allowed_past, allowed_cur], dim=-1)
    else:
        allowed_full = allowed_cur

    mask4d = allowed_full.unsqueeze(1)
    if return_bool_mask:
        return mask4d
    else:
        bias = (~mask4d).to(torch.float32)
        bias = bias.masked_fill(bias.bool(), float("-inf"))
        return bias


def build_blockwise_causal_attn_mask(token_levels, past_key_values_length=0):
    B, L = token_levels.shape
    device = token_levels.device

    is_change = token_levels[:, 1:] != token_levels[:, :-1]
    is_change = torch.cat([torch.zeros((B, 1), dtype=torch.bool, device=device), is_change], dim=1)
    block_ids = torch.cumsum(is_change.int(), dim=1)

    q_block = block_ids.unsqueeze(2)
    k_block = block_ids.unsqueeze(1)
    q_level = token_levels.unsqueeze(2)

    mask = k_block <= q_block

    is_same_block = k_block == q_block
    pos = torch.arange(L, device=device)
    causal_tril = (pos.unsqueeze(0) <= pos.unsqueeze(1)).unsqueeze(0)
    is_text_violation = is_same_block & (q_level == 0) & (~causal_tril)
    mask = mask & (~is_text_violation)

    k_is_pad = (token_levels == -1).unsqueeze(1)
    mask = mask & (~k_is_pad)

    if past_key_values_length > 0:
        mask_past = torch.ones((B, L, past_key_values_length), dtype=torch.bool, device=device)
        mask_final = torch.cat([mask_past, mask], dim=-1)
    else:
        mask_final = mask

    mask_float = torch.zeros_like(mask_final, dtype=torch.float32)
    mask_float = mask_float.masked_fill(~mask_final, float("-inf"))
    return mask_float.unsqueeze(1)


class Emu3RMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


class Emu3RotaryEmbedding(nn.Module):
    def __init__(self, dim, base):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, position_ids):
        freqs = position_ids[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos()[:, None], emb.sin()[:, None]


class Emu3SdpaAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // self.num_heads
        self.q_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.o_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)

    def forward(self, hidden_states, attention_mask, cos, sin):
        bsz, q_len, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        attn_output = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, dropout_p=0.0)
        attn_output = attn_output.transpose(1, 2).reshape(bsz, q_len, -1)
        return self.o_proj(attn_output)


class Emu3DecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self_attn = Emu3SdpaAttention(config)
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.input_layernorm = Emu3RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = Emu3RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden_states, attention_mask, cos, sin):
        residual = hidden_states
        hidden_states = self.self_attn(self.input_layernorm(hidden_states), attention_mask, cos, sin)
        hidden_states = residual + hidden_states
        residual = hidden_states
        h = self.post_attention_layernorm(hidden_states)
        hidden_states = residual + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))
        return hidden_states


class Emu3Model(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([Emu3DecoderLayer(config) for _ in range(config.num_hidden_layers)])
        self.norm = Emu3RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = Emu3RotaryEmbedding(config.hidden_size // config.num_attention_heads, config.rope_theta)
        self.use_blockwise_attn_mask = config.use_blockwise_attn_mask

    def forward(self, input_ids, attention_mask=None, token_levels=None):
        batch_size, seq_length = input_ids.shape
        past_key_values_length = 0
        position_ids = torch.arange(past_key_values_length, seq_length + past_key_values_length).unsqueeze(0)
        inputs_embeds = self.embed_tokens(input_ids)

        if self.use_blockwise_attn_mask:
            if attention_mask is not None and len(attention_mask.shape) == 4:
                attention_mask = attention_mask
            elif not FIXED:
                attention_mask = build_blockwise_attn_mask(
                    input_ids,
                    boi_token_id=151852,
                    eoi_token_id=151853,
                    pad_token_id=151643,
                    boa_token_id=151844,
                    eoa_token_id=151845,
                    include_boundary_as_image=True,
                    return_bool_mask=False,
                    past_key_values_length=past_key_values_length,
                ).to(dtype=inputs_embeds.dtype)
            else:
                attention_mask = build_blockwise_causal_attn_mask(
                    token_levels,
                    past_key_values_length=past_key_values_length,
                ).to(dtype=inputs_embeds.dtype)

        cos, sin = self.rotary_emb(position_ids)
        hidden_states = inputs_embeds
        for decoder_layer in self.layers:
            hidden_states = decoder_layer(hidden_states, attention_mask, cos, sin)
        return self.norm(hidden_states)


class Emu3ForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.model = Emu3Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, attention_mask=None, labels=None, token_levels=None):
        hidden_states = self.model(input_ids, attention_mask=attention_mask, token_levels=token_levels)
        logits = self.lm_head(hidden_states).float()
        loss = None
        if labels is not None:
            # UD-VLA's JD3P loss is taken on the masked positions themselves (no shift).
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1), ignore_index=-100)
        return loss, logits


def make_sample(text_ids, first_image, future_image, action_ids, mask_ratio, max_len, gen):
    """Emu3SFTDatasetI2IA_mi.__getitem__, interleave format, trimmed."""
    sample_input_ids = torch.tensor([BOS_ID] + text_ids)
    labels = torch.full((max_len,), fill_value=-100, dtype=torch.long)
    token_levels = torch.full((max_len,), fill_value=-1, dtype=torch.long)
    cur_level = 0
    cur_idx = 0
    text_end = len(sample_input_ids)
    token_levels[cur_idx:text_end] = cur_level
    cur_level += 1
    cur_idx = text_end

    # first (observed) image
    image_prompt = torch.tensor([BOI_ID] + first_image + [EOI_ID])
    sample_input_ids = torch.cat([sample_input_ids, image_prompt])
    token_levels[cur_idx:len(sample_input_ids)] = cur_level
    cur_level += 1
    cur_idx = len(sample_input_ids)

    # future image, partly masked (the discrete-diffusion target)
    image_input_ids = torch.tensor([BOI_ID] + future_image + [EOI_ID])
    body = torch.tensor(future_image)
    masked = torch.rand(len(body), generator=gen) < mask_ratio
    masked[0] = True
    masked_body = torch.where(masked, torch.full_like(body, MASK_ID), body)
    masked_image_input_ids = torch.cat([torch.tensor([BOI_ID]), masked_body, torch.tensor([EOI_ID])])
    masked_labels = torch.full_like(image_input_ids, -100)
    masked_labels[1:-1] = torch.where(masked, body, torch.full_like(body, -100))
    sample_input_ids = torch.cat([sample_input_ids, masked_image_input_ids])
    labels[cur_idx:cur_idx + len(masked_image_input_ids)] = masked_labels
    token_levels[cur_idx:cur_idx + len(masked_image_input_ids)] = cur_level
    cur_level += 1
    cur_idx += len(masked_image_input_ids)

    # action chunk (FAST tokens), all masked
    action = torch.tensor([BOA_ID] + action_ids + [EOA_ID])
    masked_action = torch.tensor([BOA_ID] + [MASK_ID] * len(action_ids) + [EOA_ID])
    action_start = len(sample_input_ids)
    sample_input_ids = torch.cat([sample_input_ids, masked_action])
    action_end = len(sample_input_ids)
    labels[action_start + 1:action_end - 1] = action[1:-1]
    token_levels[cur_idx:action_end] = cur_level
    cur_level += 1
    cur_idx = action_end

    # tokenizer.pad(padding="max_length"), right side
    n = len(sample_input_ids)
    input_ids = torch.full((max_len,), PAD_ID, dtype=torch.long)
    input_ids[:n] = sample_input_ids
    attention_mask = torch.zeros(max_len, dtype=torch.long)
    attention_mask[:n] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels, "token_levels": token_levels}


def main():
    config = Emu3Config()
    model = Emu3ForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(1)
    samples = [
        make_sample([11, 12, 13, 14, 15], [1001 + i for i in range(6)], [2001 + i for i in range(6)],
                    [151700, 151701, 151702, 151703], 0.5, config.model_max_length, gen),
        make_sample([21, 22, 23], [3001 + i for i in range(6)], [4001 + i for i in range(6)],
                    [151710, 151711, 151712, 151713], 0.5, config.model_max_length, gen),
    ]
    batch = {k: torch.stack([s[k] for s in samples]) for k in samples[0]}
    with torch.no_grad():
        loss, logits = model(batch["input_ids"], labels=batch["labels"], token_levels=batch["token_levels"])

    image_pos = (batch["labels"] != -100) & (batch["input_ids"] == MASK_ID) & (batch["labels"] < 151000)
    action_pos = (batch["labels"] >= 151000)
    img_loss = F.cross_entropy(logits[image_pos], batch["labels"][image_pos])
    act_loss = F.cross_entropy(logits[action_pos], batch["labels"][action_pos])
    print("fixed" if FIXED else "buggy")
    print("jd3p loss: %.6f" % loss.item())
    print("future-image loss: %.6f  action loss: %.6f" % (img_loss.item(), act_loss.item()))
    print("predicted future-image tokens:", logits[image_pos].argmax(-1).tolist())


if __name__ == "__main__":
    main()
