# Correct program (quiet batch quiet-ya).
# Ported from Stability-AI/stable-audio-tools @1b84e66ddcc91944fdc386f4f555d02a0056766c,
# stable_audio_tools/models/transformer.py: LayerNorm, GLU, FeedForward, Attention (the CPU fallback path:
# einsum, `final_attn_mask = ~or_reduce([~context_mask])`, masked_fill(-finfo.max), float32 softmax),
# TransformerBlock (adaLN global_cond branch, cross_attn over `context` with `context_mask`) and
# ContinuousTransformer (cross_attend=True, cond_token_dim, global_cond_dim). einops' rearrange is written
# with view/permute. A batch of 12 audio-latent frames (queries) cross-attends T5-like prompt embeddings
# right-padded to 5 tokens (prompts of 5, 2 and 3 tokens), the padded keys hidden by context_mask; the
# self-attention runs over the whole latent (no mask: every latent frame is real).
# Self-check: each sample run alone with only its own prompt tokens and no context_mask.
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


def rearrange_bnhd(t, h):      # 'b n (h d) -> b h n d'
    b, n, _ = t.shape
    return t.view(b, n, h, -1).permute(0, 2, 1, 3)


def or_reduce(masks):
    head, *body = masks
    for rest in body:
        head = head | rest
    return head


class LayerNorm(nn.Module):
    def __init__(self, dim, bias=False, fix_scale=False):
        super().__init__()
        self.gamma = nn.Parameter(torch.ones(dim))
        if bias:
            self.beta = nn.Parameter(torch.zeros(dim))
        else:
            self.register_buffer("beta", torch.zeros(dim))

    def forward(self, x):
        return F.layer_norm(x, x.shape[-1:], weight=self.gamma, bias=self.beta)


class GLU(nn.Module):
    def __init__(self, dim_in, dim_out, activation):
        super().__init__()
        self.act = activation
        self.proj = nn.Linear(dim_in, dim_out * 2)

    def forward(self, x):
        x = self.proj(x)
        x, gate = x.chunk(2, dim=-1)
        return x * self.act(gate)


class FeedForward(nn.Module):
    def __init__(self, dim, mult=4, zero_init_output=True):
        super().__init__()
        inner_dim = int(dim * mult)
        linear_in = GLU(dim, inner_dim, nn.SiLU())
        linear_out = nn.Linear(inner_dim, dim)
        if zero_init_output:
            nn.init.zeros_(linear_out.weight)
            nn.init.zeros_(linear_out.bias)
        self.ff = nn.Sequential(linear_in, nn.Identity(), linear_out, nn.Identity())

    def forward(self, x):
        return self.ff(x)


class Attention(nn.Module):
    def __init__(self, dim, dim_heads=64, dim_context=None, causal=False, zero_init_output=True):
        super().__init__()
        self.dim = dim
        self.dim_heads = dim_heads
        self.causal = causal
        dim_kv = dim_context if dim_context is not None else dim
        self.num_heads = dim // dim_heads
        self.kv_heads = dim_kv // dim_heads
        if dim_context is not None:
            self.to_q = nn.Linear(dim, dim, bias=False)
            self.to_kv = nn.Linear(dim_kv, dim_kv * 2, bias=False)
        else:
            self.to_qkv = nn.Linear(dim, dim * 3, bias=False)
        self.to_out = nn.Linear(dim, dim, bias=False)
        if zero_init_output:
            nn.init.zeros_(self.to_out.weight)

    def create_causal_mask(self, i, j, device):
        return torch.ones((i, j), device=device, dtype=torch.bool).triu(j - i + 1)

    def forward(self, x, context=None, mask=None, context_mask=None, causal=None):
        h, kv_h, has_context = self.num_heads, self.kv_heads, context is not None
        kv_input = context if has_context else x
        if hasattr(self, "to_q"):
            q = rearrange_bnhd(self.to_q(x), h)
            k, v = self.to_kv(kv_input).chunk(2, dim=-1)
            k, v = rearrange_bnhd(k, kv_h), rearrange_bnhd(v, kv_h)
        else:
            q, k, v = self.to_qkv(x).chunk(3, dim=-1)
            q, k, v = (rearrange_bnhd(t, h) for t in (q, k, v))

        input_mask = context_mask
        if input_mask is None and not has_context:
            input_mask = mask

        masks = []
        final_attn_mask = None
        if input_mask is not None:
            input_mask = input_mask[:, None, None, :]          # 'b j -> b 1 1 j'
            masks.append(~input_mask)
        if len(masks) > 0:
            final_attn_mask = ~or_reduce(masks)

        n, device = q.shape[-2], q.device
        causal = self.causal if causal is None else causal
        if n == 1 and causal:
            causal = False

        # Fall back to custom implementation (no CUDA here)
        if h != kv_h:
            heads_per_kv_head = h // kv_h
            k, v = (t.repeat_interleave(heads_per_kv_head, dim=1) for t in (k, v))
        scale = 1. / (q.shape[-1] ** 0.5)
        dots = torch.einsum("b h i d, b h j d -> b h i j", q, k) * scale
        i, j, dtype = *dots.shape[-2:], dots.dtype
        mask_value = -torch.finfo(dots.dtype).max
        if final_attn_mask is not None:
            dots = dots.masked_fill(~final_attn_mask, mask_value)
        if causal:
            causal_mask = self.create_causal_mask(i, j, device=device)
            dots = dots.masked_fill(causal_mask, mask_value)
        attn = F.softmax(dots, dim=-1, dtype=torch.float32)
        attn = attn.type(dtype)
        out = torch.einsum("b h i j, b h j d -> b h i d", attn, v)

        out = out.permute(0, 2, 1, 3).reshape(out.shape[0], out.shape[2], -1)   # 'b h n d -> b n (h d)'
        out = self.to_out(out.to(torch.float32)).to(out.dtype)
        if mask is not None:
            out = out.masked_fill(~mask[:, :, None], 0.)
        return out


class TransformerBlock(nn.Module):
    def __init__(self, dim, dim_heads=64, cross_attend=False, dim_context=None, global_cond_dim=None,
                 causal=False, zero_init_branch_outputs=True):
        super().__init__()
        self.pre_norm = LayerNorm(dim)
        self.self_attn = Attention(dim, dim_heads=dim_heads, causal=causal, zero_init_output=zero_init_branch_outputs)
        if cross_attend:
            self.cross_attend_norm = LayerNorm(dim)
            self.cross_attn = Attention(dim, dim_heads=dim_heads, dim_context=dim_context, causal=causal,
                                        zero_init_output=zero_init_branch_outputs)
        self.ff_norm = LayerNorm(dim)
        self.ff = FeedForward(dim, zero_init_output=zero_init_branch_outputs)
        self.global_cond_dim = global_cond_dim
        if global_cond_dim is not None:
            self.to_scale_shift_gate = nn.Sequential(nn.SiLU(), nn.Linear(global_cond_dim, dim * 6, bias=False))

    def forward(self, x, context=None, global_cond=None, mask=None, context_mask=None):
        if self.global_cond_dim is not None and self.global_cond_dim > 0 and global_cond is not None:
            scale_self, shift_self, gate_self, scale_ff, shift_ff, gate_ff = \
                self.to_scale_shift_gate(global_cond).unsqueeze(1).chunk(6, dim=-1)
            residual = x
            x = self.pre_norm(x)
            x = x * (1 + scale_self) + shift_self
            x = self.self_attn(x, mask=mask)
            x = x * torch.sigmoid(1 - gate_self)
            x = x + residual
            if context is not None:
                x = x + self.cross_attn(self.cross_attend_norm(x), context=context, context_mask=context_mask)
            residual = x
            x = self.ff_norm(x)
            x = x * (1 + scale_ff) + shift_ff
            x = self.ff(x)
            x = x * torch.sigmoid(1 - gate_ff)
            x = x + residual
        else:
            x = x + self.self_attn(self.pre_norm(x), mask=mask)
            if context is not None:
                x = x + self.cross_attn(self.cross_attend_norm(x), context=context, context_mask=context_mask)
            x = x + self.ff(self.ff_norm(x))
        return x


class ContinuousTransformer(nn.Module):
    def __init__(self, dim, depth, *, dim_in=None, dim_out=None, dim_heads=64, cross_attend=False,
                 cond_token_dim=None, global_cond_dim=None, causal=False, zero_init_branch_outputs=True):
        super().__init__()
        self.project_in = nn.Linear(dim_in, dim, bias=False) if dim_in is not None else nn.Identity()
        self.project_out = nn.Linear(dim, dim_out, bias=False) if dim_out is not None else nn.Identity()
        self.layers = nn.ModuleList([
            TransformerBlock(dim, dim_heads=dim_heads, cross_attend=cross_attend, dim_context=cond_token_dim,
                             global_cond_dim=global_cond_dim, causal=causal,
                             zero_init_branch_outputs=zero_init_branch_outputs)
            for _ in range(depth)])

    def forward(self, x, mask=None, global_cond=None, **kwargs):
        x = self.project_in(x)
        for layer in self.layers:
            x = layer(x, global_cond=global_cond, mask=mask, **kwargs)
        return self.project_out(x)


# --- conditioning as the T5 conditioner hands it: right-padded embeddings plus their attention mask ---
B, T_LAT, IO_CH, EMBED, COND, GCOND = 3, 12, 8, 32, 16, 16
prompt_lens = [5, 2, 3]
L_MAX = max(prompt_lens)
cross_attn_cond = torch.randn(B, L_MAX, COND)
cross_attn_cond_mask = torch.zeros(B, L_MAX, dtype=torch.bool)
for b, n in enumerate(prompt_lens):
    cross_attn_cond_mask[b, :n] = True
cross_attn_cond = cross_attn_cond * cross_attn_cond_mask.unsqueeze(-1).float()   # T5Conditioner zeroes pads
global_cond = torch.randn(B, GCOND)
x = torch.randn(B, T_LAT, IO_CH)

model = ContinuousTransformer(dim=EMBED, depth=2, dim_in=IO_CH, dim_out=IO_CH, dim_heads=8, cross_attend=True,
                              cond_token_dim=COND, global_cond_dim=GCOND, zero_init_branch_outputs=False).eval()
assert T_LAT > L_MAX   # more latent queries than prompt keys

with torch.no_grad():
    out = model(x, context=cross_attn_cond, context_mask=cross_attn_cond_mask, global_cond=global_cond)
    for b, n in enumerate(prompt_lens):
        ref = model(x[b:b + 1], context=cross_attn_cond[b:b + 1, :n], global_cond=global_cond[b:b + 1])
        assert torch.allclose(out[b:b + 1], ref, atol=1e-5), (b, (out[b] - ref[0]).abs().max())
    # the masked pads really are ignored: changing them leaves the output alone
    noisy = cross_attn_cond.masked_fill(~cross_attn_cond_mask.unsqueeze(-1), 3.0)
    out2 = model(x, context=noisy, context_mask=cross_attn_cond_mask, global_cond=global_cond)
    assert torch.allclose(out, out2, atol=1e-5)
print("ok")
