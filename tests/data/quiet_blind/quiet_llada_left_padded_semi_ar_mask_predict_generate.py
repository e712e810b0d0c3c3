# Citation: ML-GSAI/LLaDA generate.py @b7e6c35 (generate with attention_mask, left padding, semi-autoregressive
#   blocks, low-confidence remasking, CFG) and the model's modeling_llada.py (LLaDAModel.forward: 0/1 attention_mask
#   -> (1 - m) * finfo.min additive key bias; LLaDABlock._scaled_dot_product_attention with is_causal=False).
# Masking: LLaDA is a bidirectional mask predictor (no causal mask); the only mask is the left-padding key mask,
#   extended with ones over the gen_length [MASK] slots, and doubled for the CFG batch. Every real token and
#   every masked slot sees all real tokens; pads are never keys. Remasking confidence is -inf beyond the current block.
import math
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
MASK_ID, PAD_ID, VOCAB = 63, 0, 64


class LLaDABlock(nn.Module):
    def __init__(self, d_model, n_heads):
        super().__init__()
        self.n_heads = n_heads
        self.attn_norm = nn.LayerNorm(d_model)
        self.q_proj = nn.Linear(d_model, d_model, bias=False)
        self.k_proj = nn.Linear(d_model, d_model, bias=False)
        self.v_proj = nn.Linear(d_model, d_model, bias=False)
        self.attn_out = nn.Linear(d_model, d_model, bias=False)
        self.ff_norm = nn.LayerNorm(d_model)
        self.ff = nn.Sequential(nn.Linear(d_model, 2 * d_model), nn.SiLU(), nn.Linear(2 * d_model, d_model))

    def forward(self, x, attention_bias, pos):
        B, T, C = x.shape
        h = self.attn_norm(x)
        q, k, v = (p(h).view(B, T, self.n_heads, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        d = q.shape[-1]
        inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
        ang = pos[..., None].float() * inv
        cos, sin = torch.cat([ang, ang], -1).cos()[:, None], torch.cat([ang, ang], -1).sin()[:, None]
        rot = lambda t: torch.cat((-t[..., d // 2:], t[..., :d // 2]), -1)
        q, k = q * cos + rot(q) * sin, k * cos + rot(k) * sin
        # Modify: MDM set causal to False.
        att = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_bias, dropout_p=0.0, is_causal=False)
        x = x + self.attn_out(att.transpose(1, 2).reshape(B, T, C))
        return x + self.ff(self.ff_norm(x))


class Out:
    def __init__(self, logits):
        self.logits = logits


class LLaDAModel(nn.Module):
    def __init__(self, vocab=VOCAB, d_model=32, n_heads=4, n_layers=2):
        super().__init__()
        self.wte = nn.Embedding(vocab, d_model)
        self.blocks = nn.ModuleList([LLaDABlock(d_model, n_heads) for _ in range(n_layers)])
        self.ln_f = nn.LayerNorm(d_model)
        self.ff_out = nn.Linear(d_model, vocab, bias=False)
        self.device = torch.device("cpu")

    def forward(self, input_ids, attention_mask=None):
        batch_size, seq_len = input_ids.shape
        if attention_mask is not None and 0.0 in attention_mask:
            # shape: (batch_size, 1, 1, seq_len)
            attention_mask = attention_mask.to(dtype=torch.float).view(batch_size, -1)[:, None, None, :]
            attention_mask = (1.0 - attention_mask) * torch.finfo(attention_mask.dtype).min
        else:
            attention_mask = None
        # positions: the model card uses plain positions; pads sit on the left and are masked as keys
        pos = torch.arange(seq_len)[None].expand(batch_size, -1)
        x = self.wte(input_ids)
        for blk in self.blocks:
            x = blk(x, attention_mask, pos)
        return Out(self.ff_out(self.ln_f(x)))


def add_gumbel_noise(logits, temperature):
    if temperature == 0:
        return logits
    logits = logits.to(torch.float64)
    noise = torch.rand_like(logits, dtype=torch.float64)
    gumbel_noise = (- torch.log(noise)) ** temperature
    return logits.exp() / gumbel_noise


def get_num_transfer_tokens(mask_index, steps):
    mask_num = mask_index.sum(dim=1, keepdim=True)
    base = mask_num // steps
    remainder = mask_num % steps
    num_transfer_tokens = torch.zeros(mask_num.size(0), steps, device=mask_index.device, dtype=torch.int64) + base
    for i in range(mask_num.size(0)):
        num_transfer_tokens[i, :remainder[i]] += 1
    return num_transfer_tokens


@torch.no_grad()
def generate(model, prompt, attention_mask=None, steps=128, gen_length=128, block_length=128, temperature=0.,
             cfg_scale=0., remasking='low_confidence', mask_id=MASK_ID):
    x = torch.full((prompt.shape[0], prompt.shape[1] + gen_length), mask_id, dtype=torch.long).to(model.device)
    x[:, :prompt.shape[1]] = prompt.clone()
    if attention_mask is not None:
        attention_mask = torch.cat([attention_mask, torch.ones((prompt.shape[0], gen_length), dtype=attention_mask.dtype, device=model.device)], dim=-1)
    prompt_index = (x != mask_id)
    assert gen_length % block_length == 0
    num_blocks = gen_length // block_length
    assert steps % num_blocks == 0
    steps = steps // num_blocks
    for num_block in range(num_blocks):
        block_mask_index = (x[:, prompt.shape[1] + num_block * block_length: prompt.shape[1] + (num_block + 1) * block_length:] == mask_id)
        num_transfer_tokens = get_num_transfer_tokens(block_mask_index, steps)
        for i in range(steps):
            mask_index = (x == mask_id)
            if cfg_scale > 0.:
                un_x = x.clone()
                un_x[prompt_index] = mask_id
                x_ = torch.cat([x, un_x], dim=0)
                attention_mask_ = None
                if attention_mask is not None:
                    attention_mask_ = torch.cat([attention_mask, attention_mask], dim=0)
                logits = model(x_, attention_mask=attention_mask_).logits
                logits, un_logits = torch.chunk(logits, 2, dim=0)
                logits = un_logits + (cfg_scale + 1) * (logits - un_logits)
            else:
                logits = model(x, attention_mask=attention_mask).logits
            logits_with_noise = add_gumbel_noise(logits, temperature=temperature)
            x0 = torch.argmax(logits_with_noise, dim=-1)
            if remasking == 'low_confidence':
                p = F.softmax(logits, dim=-1)
                x0_p = torch.squeeze(torch.gather(p, dim=-1, index=torch.unsqueeze(x0, -1)), -1)
            else:
                x0_p = torch.rand((x0.shape[0], x0.shape[1]), device=x0.device)
            x0_p[:, prompt.shape[1] + (num_block + 1) * block_length:] = -np.inf
            x0 = torch.where(mask_index, x0, x)
            confidence = torch.where(mask_index, x0_p, -np.inf)
            transfer_index = torch.zeros_like(x0, dtype=torch.bool, device=x0.device)
            for j in range(confidence.shape[0]):
                _, select_index = torch.topk(confidence[j], k=num_transfer_tokens[j, i])
                transfer_index[j, select_index] = True
            x[transfer_index] = x0[transfer_index]
    return x


model = LLaDAModel().eval()
# left-padded prompts (tokenizer.padding_side = 'left'), pad id != mask id
lens = [7, 4, 5]
L = max(lens)
prompt = torch.full((3, L), PAD_ID)
attention_mask = torch.zeros((3, L), dtype=torch.long)
for i, n in enumerate(lens):
    prompt[i, L - n:] = torch.randint(1, MASK_ID, (n,))
    attention_mask[i, L - n:] = 1
out = generate(model, prompt, attention_mask=attention_mask, steps=8, gen_length=8, block_length=4, cfg_scale=1.0)
assert (out[:, L:] != MASK_ID).all()
print(f"generated {out[:, L:].tolist()}")
