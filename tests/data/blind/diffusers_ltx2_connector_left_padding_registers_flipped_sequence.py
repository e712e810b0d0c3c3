# diffusers (huggingface/diffusers#13931, regression from #13564), src/diffusers/pipelines/ltx2/connectors.py.
# Bug: LTX2ConnectorTransformer1d reads the Gemma left-padding mask, writes registers into the padded slots and then
# flips the whole sequence, so prompt tokens land reversed (and at the wrong RoPE positions) in front of reversed
# registers; the fix front-aligns the valid tokens in order and fills the tail with registers by absolute position.
import sys
import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def apply_interleaved_rotary_emb(x, freqs):
    cos, sin = freqs
    x_real, x_imag = x.unflatten(2, (-1, 2)).unbind(-1)  # [B, S, C // 2]
    x_rotated = torch.stack([-x_imag, x_real], dim=-1).flatten(2)
    return (x.float() * cos + x_rotated.float() * sin).to(x.dtype)


class LTX2RotaryPosEmbed1d(nn.Module):
    def __init__(self, dim, base_seq_len=4096, theta=10000.0, double_precision=True):
        super().__init__()
        self.dim, self.base_seq_len, self.theta, self.double_precision = dim, base_seq_len, theta, double_precision

    def forward(self, batch_size, pos, device):
        grid_1d = torch.arange(pos, dtype=torch.float32, device=device) / self.base_seq_len
        grid = grid_1d.unsqueeze(0).repeat(batch_size, 1)
        freqs_dtype = torch.float64 if self.double_precision else torch.float32
        pow_indices = torch.pow(self.theta, torch.linspace(0.0, 1.0, steps=self.dim // 2, dtype=freqs_dtype))
        freqs = (pow_indices * torch.pi / 2.0).to(dtype=torch.float32)
        freqs = (grid.unsqueeze(-1) * 2 - 1) * freqs
        return freqs.cos().repeat_interleave(2, dim=-1), freqs.sin().repeat_interleave(2, dim=-1)


class LTX2Attention(nn.Module):
    def __init__(self, query_dim, heads, dim_head, eps=1e-6):
        super().__init__()
        inner = heads * dim_head
        self.heads = heads
        self.to_q = nn.Linear(query_dim, inner)
        self.to_k = nn.Linear(query_dim, inner)
        self.to_v = nn.Linear(query_dim, inner)
        self.norm_q = nn.RMSNorm(inner, eps=eps)
        self.norm_k = nn.RMSNorm(inner, eps=eps)
        self.to_out = nn.ModuleList([nn.Linear(inner, query_dim), nn.Dropout(0.0)])

    def forward(self, hidden_states, attention_mask=None, query_rotary_emb=None):
        # LTX2AudioVideoAttnProcessor, self-attention path, interleaved RoPE
        batch_size = hidden_states.shape[0]
        if attention_mask is not None:
            attention_mask = attention_mask.expand(batch_size, self.heads, 1, attention_mask.shape[-1])
        query = self.norm_q(self.to_q(hidden_states))
        key = self.norm_k(self.to_k(hidden_states))
        value = self.to_v(hidden_states)
        if query_rotary_emb is not None:
            query = apply_interleaved_rotary_emb(query, query_rotary_emb)
            key = apply_interleaved_rotary_emb(key, query_rotary_emb)
        query, key, value = (t.unflatten(2, (self.heads, -1)).transpose(1, 2) for t in (query, key, value))
        hidden_states = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=0.0,
                                                       is_causal=False)
        hidden_states = hidden_states.transpose(1, 2).flatten(2, 3)
        return self.to_out[1](self.to_out[0](hidden_states))


class FeedForward(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.net = nn.ModuleList([nn.Linear(dim, 4 * dim), nn.Dropout(0.0), nn.Linear(4 * dim, dim)])

    def forward(self, x):
        return self.net[2](self.net[1](F.gelu(self.net[0](x), approximate="tanh")))


class LTX2TransformerBlock1d(nn.Module):
    def __init__(self, dim, num_attention_heads, attention_head_dim, eps=1e-6):
        super().__init__()
        self.norm1 = nn.RMSNorm(dim, eps=eps, elementwise_affine=False)
        self.attn1 = LTX2Attention(dim, num_attention_heads, attention_head_dim)
        self.norm2 = nn.RMSNorm(dim, eps=eps, elementwise_affine=False)
        self.ff = FeedForward(dim)

    def forward(self, hidden_states, attention_mask=None, rotary_emb=None):
        hidden_states = hidden_states + self.attn1(self.norm1(hidden_states), attention_mask=attention_mask,
                                                   query_rotary_emb=rotary_emb)
        return hidden_states + self.ff(self.norm2(hidden_states))


class LTX2ConnectorTransformer1d(nn.Module):
    def __init__(self, num_attention_heads=2, attention_head_dim=16, num_layers=2, num_learnable_registers=8,
                 rope_base_seq_len=4096, rope_theta=10000.0, eps=1e-6):
        super().__init__()
        self.num_attention_heads = num_attention_heads
        self.inner_dim = num_attention_heads * attention_head_dim
        self.num_learnable_registers = num_learnable_registers
        init_registers = torch.rand(num_learnable_registers, self.inner_dim) * 2.0 - 1.0
        self.learnable_registers = nn.Parameter(init_registers)
        self.rope = LTX2RotaryPosEmbed1d(self.inner_dim, base_seq_len=rope_base_seq_len, theta=rope_theta)
        self.transformer_blocks = nn.ModuleList([
            LTX2TransformerBlock1d(self.inner_dim, num_attention_heads, attention_head_dim) for _ in range(num_layers)])
        self.norm_out = nn.RMSNorm(self.inner_dim, eps=eps, elementwise_affine=False)

    def run_blocks(self, hidden_states, attention_mask):
        batch_size, seq_len, _ = hidden_states.shape
        rotary_emb = self.rope(batch_size, seq_len, device=hidden_states.device)
        for block in self.transformer_blocks:
            hidden_states = block(hidden_states, attention_mask=attention_mask, rotary_emb=rotary_emb)
        return self.norm_out(hidden_states)

    def forward(self, hidden_states, attention_mask=None, attn_mask_binarize_threshold=-9000.0):
        batch_size, seq_len, _ = hidden_states.shape
        if self.learnable_registers is not None:
            num_register_repeats = seq_len // self.num_learnable_registers
            registers = self.learnable_registers.unsqueeze(0).expand(num_register_repeats, -1, -1).reshape(seq_len, -1)
            binary_attn_mask = (attention_mask >= attn_mask_binarize_threshold).int()
            if binary_attn_mask.ndim == 4:
                binary_attn_mask = binary_attn_mask.squeeze(1).squeeze(1)  # [B, 1, 1, L] --> [B, L]
            if FIXED:
                # Move the valid tokens to the front in their original order and fill the tail
                # with registers indexed by absolute position.
                order = torch.argsort(1 - binary_attn_mask, dim=1, stable=True)  # [B, L]
                front_aligned = torch.gather(hidden_states, 1,
                                             order.unsqueeze(-1).expand(-1, -1, hidden_states.shape[-1]))
                num_valid = binary_attn_mask.sum(dim=1, keepdim=True)  # [B, 1]
                positions = torch.arange(seq_len, device=hidden_states.device).unsqueeze(0)  # [1, L]
                front_mask = (positions < num_valid).unsqueeze(-1)  # [B, L, 1]
                registers_expanded = registers.unsqueeze(0).expand(batch_size, -1, -1)  # [B, L, D]
                hidden_states = torch.where(front_mask, front_aligned, registers_expanded.to(hidden_states.dtype))
            else:
                # Replace padding positions with learned registers using vectorized masking
                mask = binary_attn_mask.unsqueeze(-1)  # [B, L, 1]
                registers_expanded = registers.unsqueeze(0).expand(batch_size, -1, -1)  # [B, L, D]
                hidden_states = mask * hidden_states + (1 - mask) * registers_expanded
                # Flip sequence: embeddings move to front, registers to back (from left padding layout)
                hidden_states = torch.flip(hidden_states, dims=[1])
            # Overwrite attention_mask with an all-zeros mask if using registers.
            attention_mask = torch.zeros_like(attention_mask)
        return self.run_blocks(hidden_states, attention_mask), attention_mask


connector = LTX2ConnectorTransformer1d().eval()
B, L, D = 2, 16, connector.inner_dim
lengths = [10, 3]                                    # prompt and a short negative prompt (CFG batch)
text_emb = torch.randn(B, L, D)                      # projected Gemma features, LEFT padded (pipeline tokenizer)
attention_mask = torch.zeros(B, L, dtype=torch.long)
for i, n in enumerate(lengths):
    attention_mask[i, L - n:] = 1
text_dtype = text_emb.dtype
# LTX2TextConnectors.forward: convert to an additive mask for the connectors
add_attn_mask = (attention_mask.to(torch.int64) - 1).to(text_dtype)
add_attn_mask = add_attn_mask.reshape(B, 1, -1, L) * torch.finfo(text_dtype).max

with torch.no_grad():
    out, _ = connector(text_emb, add_attn_mask)
    # reference: original LTX layout built per sample in a loop (valid tokens first, in order; then the register
    # tile at its absolute positions), run through the same blocks with no mask
    registers = connector.learnable_registers.unsqueeze(0).expand(L // 8, -1, -1).reshape(L, -1)
    ref_in = torch.stack([torch.cat([text_emb[i, L - n:], registers[n:]]) for i, n in enumerate(lengths)])
    ref = connector.run_blocks(ref_in, torch.zeros(B, 1, 1, L))
print(f"max |connector output - original-LTX register layout output| = {(out - ref).abs().max().item():.6f}")
