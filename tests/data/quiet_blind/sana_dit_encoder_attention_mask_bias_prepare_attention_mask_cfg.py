# Follows huggingface/diffusers transformers/sana_transformer.py (SanaTransformer2DModel.forward turns the 1/0 caption mask into
# (1 - mask) * -10000.0 and unsqueezes it) and attention_processor.py (Attention.prepare_attention_mask repeat_interleave over heads,
# AttnProcessor2_0 view(batch, heads, -1, S) -> SDPA float mask). 16 image queries, 8 right-padded Gemma-caption keys; CFG batch.
import math
import torch
import torch.nn.functional as F

torch.manual_seed(0)
torch.set_default_dtype(torch.float64)
D, heads, n_img, max_txt, caption_dim = 32, 4, 16, 8, 24


class Attention(torch.nn.Module):
    def __init__(self, cross_dim=None):
        super().__init__()
        self.heads = heads
        self.to_q = torch.nn.Linear(D, D)
        self.to_k = torch.nn.Linear(cross_dim or D, D)
        self.to_v = torch.nn.Linear(cross_dim or D, D)
        self.to_out = torch.nn.Linear(D, D)

    def prepare_attention_mask(self, attention_mask, target_length, batch_size, out_dim=3):
        head_size = self.heads
        if attention_mask is None:
            return attention_mask
        current_length = attention_mask.shape[-1]
        if current_length != target_length:
            attention_mask = F.pad(attention_mask, (0, target_length), value=0.0)
        if out_dim == 3:
            if attention_mask.shape[0] < batch_size * head_size:
                attention_mask = attention_mask.repeat_interleave(head_size, dim=0)
        elif out_dim == 4:
            attention_mask = attention_mask.unsqueeze(1).repeat_interleave(head_size, dim=1)
        return attention_mask

    def forward(self, hidden_states, encoder_hidden_states, attention_mask=None):  # AttnProcessor2_0
        batch_size, sequence_length, _ = encoder_hidden_states.shape
        if attention_mask is not None:
            attention_mask = self.prepare_attention_mask(attention_mask, sequence_length, batch_size)
            attention_mask = attention_mask.view(batch_size, self.heads, -1, attention_mask.shape[-1])
        q = self.to_q(hidden_states).view(batch_size, -1, heads, D // heads).transpose(1, 2)
        k = self.to_k(encoder_hidden_states).view(batch_size, -1, heads, D // heads).transpose(1, 2)
        v = self.to_v(encoder_hidden_states).view(batch_size, -1, heads, D // heads).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask)
        return self.to_out(out.transpose(1, 2).reshape(batch_size, -1, D))


class LinearSelfAttention(torch.nn.Module):  # SanaLinearAttnProcessor2_0: ReLU kernels, no mask (every image token is real)
    def __init__(self):
        super().__init__()
        self.qkv, self.out = torch.nn.Linear(D, 3 * D, bias=False), torch.nn.Linear(D, D)

    def forward(self, x):
        q, k, v = (F.relu(t) if i < 2 else t for i, t in enumerate(self.qkv(x).chunk(3, -1)))
        kv = k.transpose(1, 2) @ v
        num = q @ kv
        den = q @ k.sum(1, keepdim=True).transpose(1, 2) + 1e-6
        return self.out(num / den)


class SanaBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1 = torch.nn.LayerNorm(D, elementwise_affine=False)
        self.attn1 = LinearSelfAttention()
        self.norm2 = torch.nn.LayerNorm(D, elementwise_affine=False)
        self.attn2 = Attention()
        self.ff = torch.nn.Sequential(torch.nn.Linear(D, 2 * D), torch.nn.SiLU(), torch.nn.Linear(2 * D, D))
        self.scale_shift_table = torch.nn.Parameter(torch.randn(6, D) / D**0.5)

    def forward(self, x, enc, encoder_attention_mask, timestep):
        sh_msa, sc_msa, g_msa, sh_mlp, sc_mlp, g_mlp = (self.scale_shift_table[None] + timestep.reshape(-1, 6, D)).chunk(6, 1)
        x = x + g_msa * self.attn1(self.norm1(x) * (1 + sc_msa) + sh_msa)
        x = x + self.attn2(x, enc, attention_mask=encoder_attention_mask)
        return x + g_mlp * self.ff(self.norm2(x) * (1 + sc_mlp) + sh_mlp)


class SanaTransformer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.caption_projection = torch.nn.Sequential(torch.nn.Linear(caption_dim, D), torch.nn.GELU(approximate="tanh"), torch.nn.Linear(D, D))
        self.time = torch.nn.Sequential(torch.nn.Linear(1, D), torch.nn.SiLU(), torch.nn.Linear(D, 6 * D))
        self.blocks = torch.nn.ModuleList([SanaBlock() for _ in range(2)])

    def forward(self, hidden_states, encoder_hidden_states, timestep, encoder_attention_mask=None):
        if encoder_attention_mask is not None and encoder_attention_mask.ndim == 2:
            encoder_attention_mask = (1 - encoder_attention_mask.to(hidden_states.dtype)) * -10000.0
            encoder_attention_mask = encoder_attention_mask.unsqueeze(1)  # [B, 1, S] additive bias
        t = self.time(timestep[:, None])
        enc = self.caption_projection(encoder_hidden_states)
        for blk in self.blocks:
            hidden_states = blk(hidden_states, enc, encoder_attention_mask, t)
        return hidden_states


model = SanaTransformer().eval()
lens = [1, 8, 5, 1]  # CFG batch: [negative "" (BOS only), prompt A (fills max_length), prompt B, negative ""]
B = len(lens)
caption = torch.randn(B, max_txt, caption_dim)
prompt_attention_mask = torch.zeros(B, max_txt, dtype=torch.long)
for i, n in enumerate(lens):
    prompt_attention_mask[i, :n] = 1
latents = torch.randn(B, n_img, D)
timestep = torch.tensor([0.7, 0.7, 0.2, 0.2])
with torch.no_grad():
    got = model(latents, caption, timestep, encoder_attention_mask=prompt_attention_mask)
    worst = 0.0
    for i, n in enumerate(lens):
        ref = model(latents[i : i + 1], caption[i : i + 1, :n], timestep[i : i + 1])  # caption cut to its real tokens, no mask
        worst = max(worst, (got[i] - ref[0]).abs().max().item())
print(f"padded-caption batch with -10000 bias vs each caption alone and unpadded: max diff = {worst:.3e}")
assert worst < 1e-12, worst
print(f"max difference: {worst:.3e}")
