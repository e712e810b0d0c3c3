# ZHZisZZ/dllm commit e76f2e59 (PR #107): LLaDA2.1 generate() built its block-diffusion attention mask as raw
# 0/1 bfloat16 values (no .log()); the 4D float mask is used as an additive bias, so later blocks were not masked.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
DTYPE = torch.bfloat16


def _prepare_4d_causal_attention_mask_for_sdpa(attention_mask, input_shape, inputs_embeds, past_key_values_length):
    # transformers helper: a 4D mask is taken as the final (additive) mask as it is
    if attention_mask is not None and attention_mask.dim() == 4:
        return attention_mask
    bsz, tgt = input_shape
    causal = torch.full((tgt, tgt), torch.finfo(inputs_embeds.dtype).min, dtype=inputs_embeds.dtype).triu(1)
    return causal[None, None].expand(bsz, 1, tgt, tgt)


class LLaDA2MoeSdpaAttention(nn.Module):
    def __init__(self, hidden, heads):
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.query_key_value = nn.Linear(hidden, 3 * hidden)
        self.dense = nn.Linear(hidden, hidden)

    def forward(self, hidden_states, attention_mask):
        B, L, _ = hidden_states.shape
        q, k, v = self.query_key_value(hidden_states).view(B, L, 3, self.heads, self.head_dim).unbind(2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=attention_mask, dropout_p=0.0)
        return self.dense(out.transpose(1, 2).reshape(B, L, -1))


class LLaDA2MoeDecoderLayer(nn.Module):
    def __init__(self, hidden, heads):
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = nn.RMSNorm(hidden), nn.RMSNorm(hidden)
        self.attention = LLaDA2MoeSdpaAttention(hidden, heads)
        self.mlp = nn.Sequential(nn.Linear(hidden, 2 * hidden), nn.SiLU(), nn.Linear(2 * hidden, hidden))

    def forward(self, h, attention_mask):
        h = h + self.attention(self.input_layernorm(h), attention_mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class LLaDA2MoeModelLM(nn.Module):
    def __init__(self, vocab_size=64, hidden=32, heads=2, layers=2, max_pos=64):
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab_size, hidden)
        self.position_embeddings = nn.Embedding(max_pos, hidden)  # stands in for RoPE at position_ids
        self.layers = nn.ModuleList([LLaDA2MoeDecoderLayer(hidden, heads) for _ in range(layers)])
        self.norm = nn.RMSNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab_size, bias=False)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        inputs_embeds = self.word_embeddings(input_ids) + self.position_embeddings(position_ids)
        batch_size, seq_length = input_ids.shape
        if attention_mask is not None and attention_mask.dim() == 4 and attention_mask.dtype == torch.bool:
            min_val = torch.finfo(inputs_embeds.dtype).min
            attention_mask = torch.zeros_like(attention_mask, dtype=inputs_embeds.dtype).masked_fill_(
                ~attention_mask, min_val)
        else:
            attention_mask = _prepare_4d_causal_attention_mask_for_sdpa(
                attention_mask, (batch_size, seq_length), inputs_embeds, 0)
        h = inputs_embeds
        for layer in self.layers:
            h = layer(h, attention_mask)
        return self.lm_head(self.norm(h))

    @torch.no_grad()
    def generate(self, inputs, block_length=4, gen_length=8, mask_id=63, first_step_logits=None):
        input_ids = inputs
        prompt_length = input_ids.shape[1]
        num_blocks = (prompt_length + gen_length + block_length - 1) // block_length
        total_length = num_blocks * block_length

        block_mask = torch.tril(torch.ones(num_blocks, num_blocks))
        block_diffusion_attention_mask = (
            block_mask.repeat_interleave(block_length, dim=0).repeat_interleave(block_length, dim=1)
            .unsqueeze(0).unsqueeze(0))
        if FIXED:
            block_diffusion_attention_mask = block_diffusion_attention_mask.log()
        block_diffusion_attention_mask = block_diffusion_attention_mask.to(torch.bfloat16)

        position_ids = torch.arange(total_length).unsqueeze(0)
        x = torch.full((1, total_length), mask_id, dtype=torch.long)
        x[:, :prompt_length] = input_ids.clone()
        prefill_blocks = prompt_length // block_length
        for num_block in range(prefill_blocks, num_blocks):
            current_window_end = (num_block + 1) * block_length
            cur_attn_mask = block_diffusion_attention_mask[:, :, :current_window_end, :current_window_end]
            cur_position_ids = position_ids[:, :current_window_end]
            while True:
                cur_x = x[:, :current_window_end]
                active_block_mask = cur_x[:, -block_length:] == mask_id
                if not active_block_mask.any():
                    break
                logits = self.forward(cur_x, attention_mask=cur_attn_mask, position_ids=cur_position_ids)
                if first_step_logits is None:
                    first_step_logits = logits.float()
                active_logits = logits[:, -block_length:, :].float()
                x0_p, x0 = F.softmax(active_logits, dim=-1).max(dim=-1)
                confidence = torch.where(active_block_mask, x0_p, -torch.inf)
                idx = confidence[0].argmax()
                x[0, num_block * block_length + idx] = x0[0, idx]
        return x[:, prompt_length:], first_step_logits


model = LLaDA2MoeModelLM().to(DTYPE).eval()
prompt = torch.tensor([[5, 17, 23, 9]])
generated, first_logits = model.generate(prompt)
print("generated:", generated.tolist())

# reference: the same first denoising step with a boolean block-causal mask
with torch.no_grad():
    L = 8
    blocks = torch.arange(L) // 4
    bool_mask = (blocks[None, :] <= blocks[:, None])[None, None]
    x = torch.tensor([[5, 17, 23, 9, 63, 63, 63, 63]])
    ref = model(x, attention_mask=bool_mask, position_ids=torch.arange(L)[None]).float()
print("max |first-step logits - block-causal reference|:", (first_logits - ref).abs().max().item())
