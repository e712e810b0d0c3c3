# huggingface/diffusers#13598 ("llada2 model/pipeline review", issue 1: "Tokenizer padding masks are discarded"),
# fixed by PR #13698 (commit 79de3064dd, "[LLADA2] Fix llada2 review #13598").
#
# LLaDA2Pipeline (src/diffusers/pipelines/llada2/pipeline_llada2.py) refines a template of mask tokens block by block.
# Before the fix `_prepare_input_ids` returned only the ids (the tokenizer's / caller's attention_mask was dropped) and
# `__call__` built `attn_mask = torch.ones((batch_size, total_length))`: the pad tokens of the shorter (right-padded)
# prompt and the block-aligned tail past `prompt_length + gen_length` were handed to the model as real context.
# The fix carries the prompt mask through and builds the runtime 2D mask as prompt mask + ones over the generated
# span + zeros over the tail.
#
# The model is a tiny LLaDA2-style bidirectional denoiser (RoPE, no causal mask) that turns the 2D padding mask into an
# additive 4D mask, as `_prepare_4d_attention_mask` does. The scheduler is BlockRefinementScheduler's greedy path.
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


# ---------------------------------------------------------------- model (LLaDA2-style, bidirectional)
class LLaDA2Config:
    def __init__(self, vocab_size=40, hidden_size=32, num_attention_heads=4, num_hidden_layers=2, rope_theta=10000.0):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_attention_heads = num_attention_heads
        self.num_hidden_layers = num_hidden_layers
        self.rope_theta = rope_theta
        self.head_dim = hidden_size // num_attention_heads


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin):
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


class LLaDA2RotaryEmbedding(nn.Module):
    def __init__(self, config):
        super().__init__()
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, config.head_dim, 2).float() / config.head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, position_ids):
        freqs = position_ids[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()


class LLaDA2Attention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.head_dim
        self.query_key_value = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=False)
        self.dense = nn.Linear(config.hidden_size, config.hidden_size, bias=False)

    def forward(self, hidden_states, attention_mask, position_embeddings):
        bsz, q_len, _ = hidden_states.shape
        qkv = self.query_key_value(hidden_states).view(bsz, q_len, 3, self.num_heads, self.head_dim)
        q, k, v = (t.transpose(1, 2) for t in qkv.unbind(2))
        q, k = apply_rotary_pos_emb(q, k, *position_embeddings)
        attn_weights = torch.matmul(q, k.transpose(2, 3)) / self.head_dim**0.5
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask
        attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(attn_weights, v).transpose(1, 2).reshape(bsz, q_len, -1)
        return self.dense(out)


class LLaDA2DecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(config.hidden_size)
        self.attention = LLaDA2Attention(config)
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size)
        self.mlp = nn.Sequential(
            nn.Linear(config.hidden_size, 4 * config.hidden_size), nn.GELU(), nn.Linear(4 * config.hidden_size, config.hidden_size)
        )

    def forward(self, hidden_states, attention_mask, position_embeddings):
        hidden_states = hidden_states + self.attention(self.input_layernorm(hidden_states), attention_mask, position_embeddings)
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


@dataclass
class CausalLMOutput:
    logits: torch.Tensor


def _prepare_4d_attention_mask(mask, dtype, tgt_len):
    bsz, src_len = mask.shape
    expanded = mask[:, None, None, :].expand(bsz, 1, tgt_len, src_len).to(dtype)
    inverted = 1.0 - expanded
    return inverted.masked_fill(inverted.to(torch.bool), torch.finfo(dtype).min)


class LLaDA2MoeModelLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rotary_emb = LLaDA2RotaryEmbedding(config)
        self.layers = nn.ModuleList([LLaDA2DecoderLayer(config) for _ in range(config.num_hidden_layers)])
        self.norm = nn.LayerNorm(config.hidden_size)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    @property
    def dtype(self):
        return self.lm_head.weight.dtype

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        hidden_states = self.word_embeddings(input_ids)
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        position_embeddings = self.rotary_emb(position_ids)
        # bidirectional (diffusion) attention: the 2D mask only removes padded keys
        mask_4d = None
        if attention_mask is not None:
            mask_4d = _prepare_4d_attention_mask(attention_mask, hidden_states.dtype, input_ids.shape[1])
        for layer in self.layers:
            hidden_states = layer(hidden_states, mask_4d, position_embeddings)
        return CausalLMOutput(logits=self.lm_head(self.norm(hidden_states)))


# ---------------------------------------------------------------- scheduler (BlockRefinementScheduler, greedy path)
@dataclass
class BlockRefinementSchedulerOutput:
    prev_sample: torch.LongTensor
    transfer_index: torch.BoolTensor
    sampled_tokens: torch.LongTensor
    sampled_probs: torch.Tensor


class BlockRefinementScheduler:
    def __init__(self, block_length=4, threshold=0.95, minimal_topk=1):
        self.block_length = block_length
        self.threshold = threshold
        self.minimal_topk = minimal_topk
        self._transfer_schedule = None

    def set_timesteps(self, num_inference_steps, device=None):
        self.num_inference_steps = num_inference_steps
        self._transfer_schedule = self.get_num_transfer_tokens(self.block_length, num_inference_steps)

    def get_num_transfer_tokens(self, block_length, num_inference_steps):
        base = block_length // num_inference_steps
        remainder = block_length % num_inference_steps
        out = torch.full((num_inference_steps,), base, dtype=torch.long)
        out[:remainder] += 1
        return out

    def step(self, model_output, timestep, sample, mask_token_id, threshold):
        probs = F.softmax(model_output.float(), dim=-1)
        sampled_probs, sampled_tokens = probs.max(dim=-1)
        batch_size, block_length = sample.shape
        active_block = sample == mask_token_id
        transfer_index = torch.zeros_like(sampled_tokens, dtype=torch.bool)
        if active_block.any():
            num_to_transfer = int(self._transfer_schedule[min(timestep, len(self._transfer_schedule) - 1)].item())
            confidence = torch.where(active_block, sampled_probs, torch.full_like(sampled_probs, -torch.inf))
            for b in range(batch_size):
                high_conf = confidence[b] > threshold
                if high_conf.sum().item() >= num_to_transfer:
                    transfer_index[b] = high_conf
                else:
                    k = min(num_to_transfer, int(active_block[b].sum().item()))
                    if k > 0:
                        _, idx = torch.topk(confidence[b], k=k)
                        transfer_index[b, idx] = True
        prev_sample = sample.clone()
        prev_sample[transfer_index] = sampled_tokens[transfer_index]
        return BlockRefinementSchedulerOutput(prev_sample, transfer_index, sampled_tokens, sampled_probs)


# ---------------------------------------------------------------- pipeline (LLaDA2Pipeline.__call__, trimmed)
class LLaDA2Pipeline:
    def __init__(self, model, scheduler):
        self.model = model
        self.scheduler = scheduler

    def _prepare_input_ids(self, *, input_ids, attention_mask=None):
        if input_ids.ndim == 1:
            input_ids = input_ids.unsqueeze(0)
        if not FIXED:
            return input_ids
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids, dtype=torch.long)
        else:
            if attention_mask.ndim == 1:
                attention_mask = attention_mask.unsqueeze(0)
            attention_mask = attention_mask.to(dtype=torch.long)
        return input_ids, attention_mask

    @torch.no_grad()
    def __call__(self, input_ids, attention_mask=None, gen_length=6, block_length=4, num_inference_steps=2,
                 threshold=0.95, mask_token_id=39):
        if FIXED:
            prompt_ids, prompt_attention_mask = self._prepare_input_ids(input_ids=input_ids, attention_mask=attention_mask)
        else:
            prompt_ids = self._prepare_input_ids(input_ids=input_ids, attention_mask=attention_mask)
        device = prompt_ids.device
        batch_size, prompt_length = prompt_ids.shape

        num_inference_steps = min(num_inference_steps, gen_length // self.scheduler.minimal_topk)
        self.scheduler.set_timesteps(num_inference_steps, device=device)

        num_blocks = (prompt_length + gen_length + block_length - 1) // block_length
        total_length = num_blocks * block_length

        if FIXED:
            attn_mask = torch.zeros((batch_size, total_length), device=device, dtype=torch.long)
            attn_mask[:, :prompt_length] = prompt_attention_mask
            attn_mask[:, prompt_length : prompt_length + gen_length] = 1
        else:
            # 2D attention mask (no padding) — the model handles backend-specific conversion internally.
            attn_mask = torch.ones((batch_size, total_length), device=device, dtype=torch.long)

        position_ids = torch.arange(total_length, device=device, dtype=torch.long).unsqueeze(0).expand(batch_size, -1)

        x = torch.full((batch_size, total_length), mask_token_id, device=device, dtype=torch.long)
        if prompt_length > 0:
            x[:, :prompt_length] = prompt_ids

        prefill_blocks = prompt_length // block_length
        for num_block in range(prefill_blocks, num_blocks):
            current_window_end = (num_block + 1) * block_length
            block_x = x[:, :current_window_end]
            block_attn_mask = attn_mask[:, :current_window_end]
            block_position_ids = position_ids[:, :current_window_end]

            step_idx = 0
            while step_idx < num_inference_steps:
                block_tokens = block_x[:, -block_length:]
                if not (block_tokens == mask_token_id).any():
                    break
                logits = self.model(block_x, attention_mask=block_attn_mask, position_ids=block_position_ids).logits
                block_logits = logits[:, -block_length:, :]
                out = self.scheduler.step(block_logits, step_idx, block_tokens, mask_token_id, threshold)
                if out.transfer_index.any():
                    block_x[:, -block_length:] = out.prev_sample
                step_idx += 1
            x[:, :current_window_end] = block_x

        generated = x[:, : prompt_length + gen_length]
        return generated[:, prompt_length:]


def main():
    torch.manual_seed(2)
    config = LLaDA2Config()
    model = LLaDA2MoeModelLM(config).eval()
    pipe = LLaDA2Pipeline(model=model, scheduler=BlockRefinementScheduler(block_length=4))

    # right-padded pre-tokenized batch (pad id 0), as a tokenizer with padding=True returns it
    input_ids = torch.tensor([[10, 11, 12, 13], [20, 21, 0, 0]], dtype=torch.long)
    attention_mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.long)

    sequences = pipe(input_ids=input_ids, attention_mask=attention_mask, gen_length=6, block_length=4,
                     num_inference_steps=2, threshold=0.95, mask_token_id=39)
    print("fixed" if FIXED else "buggy", "sequences:", sequences.tolist())


if __name__ == "__main__":
    main()
