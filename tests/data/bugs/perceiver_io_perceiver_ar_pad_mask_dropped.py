# perceiver-io, Perceiver AR causal LM (krasserm/perceiver-io commit 6b2a825, PR #25 "Support key padding masks for Perceiver AR").
# Bug: LitCausalLanguageModel.step() discarded the batch's pad mask (`labels, x, _ = batch`), so PerceiverAR's causal
# cross-attention from the latents to the prefix (and its positions) treated padding tokens as real input.
import sys
from typing import Optional

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


# ---------------- perceiver/model/core/utils.py ----------------
class Sequential(nn.Sequential):
    def forward(self, *x, **kwargs):
        for i, module in enumerate(self):
            if type(x) == tuple:
                if i == 0:
                    x = module(*x, **kwargs)
                else:
                    x = module(*x)
            else:
                x = module(x)
        return x


class Residual(nn.Module):
    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs) + args[0]


def init_parameters(module, init_scale):
    for m in module.modules():
        if isinstance(m, nn.Linear):
            m.weight.data.normal_(mean=0.0, std=init_scale)
            if m.bias is not None:
                m.bias.data.zero_()
        elif isinstance(m, nn.Embedding):
            m.weight.data.normal_(mean=0.0, std=init_scale)


# ---------------- perceiver/model/core/position.py ----------------
def positions(b, n, shift: Optional[torch.Tensor] = None, device: Optional[torch.device] = None):
    pos = torch.arange(n, device=device).unsqueeze(0).expand(b, n)  # repeat "n -> b n"
    if shift is not None:
        if shift.shape != (b, 1):
            raise ValueError(f"shift must have shape {(1, b)} but has shape {shift.shape}")
        pos = pos - shift
    return torch.clamp(pos, min=0)


class RotaryPositionEmbedding:
    def __init__(self, frq_pos_enc: torch.Tensor, right_align: bool = False):
        self.frq_pos_enc = frq_pos_enc.unsqueeze(1)  # "b n c -> b 1 n c"
        self.rotate_dim = frq_pos_enc.shape[-1]
        self.right_align = right_align

    def rotate(self, t):
        seq_len = t.shape[-2]
        if self.right_align:
            pos_enc = self.frq_pos_enc[..., -seq_len:, :]
        else:
            pos_enc = self.frq_pos_enc[..., :seq_len, :]
        t_rot, t_pass = t[..., : self.rotate_dim], t[..., self.rotate_dim :]
        t_rot = (t_rot * pos_enc.cos()) + (self._rotate_half(t_rot) * pos_enc.sin())
        return torch.cat((t_rot, t_pass), dim=-1)

    @staticmethod
    def _rotate_half(x):
        x = x.unflatten(-1, (-1, 2))  # "... (c r) -> ... c r"
        x1, x2 = x.unbind(dim=-1)
        x = torch.stack((-x2, x1), dim=-1)
        return x.flatten(-2)  # "... c r -> ... (c r)"


class FrequencyPositionEncoding(nn.Module):
    def __init__(self, dim):
        super().__init__()
        inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
        self.register_buffer("inv_freq", inv_freq)

    def forward(self, abs_pos):
        pos_enc = torch.einsum("b n, f -> b n f", abs_pos.to(self.inv_freq.dtype), self.inv_freq)
        return pos_enc.repeat_interleave(2, dim=-1)  # "... pf -> ... (pf r)"


# ---------------- perceiver/model/core/modules.py ----------------
class MultiHeadAttention(nn.Module):
    def __init__(self, num_heads, num_q_input_channels, num_kv_input_channels, causal_attention=False,
                 dropout=0.0, qkv_bias=True, out_bias=True):
        super().__init__()
        num_qk_channels = num_q_input_channels
        num_v_channels = num_qk_channels
        self.dp_scale = (num_qk_channels // num_heads) ** -0.5
        self.num_heads = num_heads
        self.causal_attention = causal_attention
        self.q_proj = nn.Linear(num_q_input_channels, num_qk_channels, bias=qkv_bias)
        self.k_proj = nn.Linear(num_kv_input_channels, num_qk_channels, bias=qkv_bias)
        self.v_proj = nn.Linear(num_kv_input_channels, num_v_channels, bias=qkv_bias)
        self.o_proj = nn.Linear(num_v_channels, num_q_input_channels, bias=out_bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x_q, x_kv, pad_mask=None, rot_pos_emb_q=None, rot_pos_emb_k=None):
        q = self.q_proj(x_q)
        k = self.k_proj(x_kv)
        v = self.v_proj(x_kv)
        q, k, v = (x.unflatten(-1, (self.num_heads, -1)).transpose(1, 2) for x in [q, k, v])  # "b n (h c) -> b h n c"
        q = q * self.dp_scale
        if rot_pos_emb_q is not None:
            q = rot_pos_emb_q.rotate(q)
        if rot_pos_emb_k is not None:
            k = rot_pos_emb_k.rotate(k)

        attn = torch.einsum("b h i c, b h j c -> b h i j", q, k)
        attn_max_neg = -torch.finfo(attn.dtype).max

        if pad_mask is not None:
            pad_mask = pad_mask[:, None, None, :]  # "b j -> b 1 1 j"
            attn.masked_fill_(pad_mask, attn_max_neg)

        if self.causal_attention:
            i = q.shape[2]
            j = k.shape[2]
            # If q and k have different length, causal masking only works if they are right-aligned.
            causal_mask = torch.ones((i, j), device=x_q.device, dtype=torch.bool).triu(j - i + 1)
            attn.masked_fill_(causal_mask, attn_max_neg)

        attn = attn.softmax(dim=-1)
        attn = self.dropout(attn)
        o = torch.einsum("b h i j, b h j c -> b h i c", attn, v)
        o = o.transpose(1, 2).flatten(2)  # "b h n c -> b n (h c)"
        return self.o_proj(o)


class CrossAttention(nn.Module):
    def __init__(self, num_heads, num_q_input_channels, num_kv_input_channels, causal_attention=False, dropout=0.0,
                 qkv_bias=True, out_bias=True):
        super().__init__()
        self.q_norm = nn.LayerNorm(num_q_input_channels)
        self.kv_norm = nn.LayerNorm(num_kv_input_channels)
        self.attention = MultiHeadAttention(num_heads, num_q_input_channels, num_kv_input_channels,
                                            causal_attention=causal_attention, dropout=dropout,
                                            qkv_bias=qkv_bias, out_bias=out_bias)

    def forward(self, x_q, x_kv=None, x_kv_prefix=None, pad_mask=None, rot_pos_emb_q=None, rot_pos_emb_k=None):
        x_q = self.q_norm(x_q)
        if x_kv is None:
            x_kv_prefix = self.kv_norm(x_kv_prefix)
            x_kv = torch.cat([x_kv_prefix, x_q], dim=1)
        else:
            x_kv = self.kv_norm(x_kv)
        return self.attention(x_q, x_kv, pad_mask=pad_mask, rot_pos_emb_q=rot_pos_emb_q, rot_pos_emb_k=rot_pos_emb_k)


class SelfAttention(nn.Module):
    def __init__(self, num_heads, num_channels, causal_attention=False, dropout=0.0, qkv_bias=True, out_bias=True):
        super().__init__()
        self.norm = nn.LayerNorm(num_channels)
        self.attention = MultiHeadAttention(num_heads, num_channels, num_channels, causal_attention=causal_attention,
                                            dropout=dropout, qkv_bias=qkv_bias, out_bias=out_bias)

    def forward(self, x, pad_mask=None, rot_pos_emb=None):
        x = self.norm(x)
        return self.attention(x, x, pad_mask=pad_mask, rot_pos_emb_q=rot_pos_emb, rot_pos_emb_k=rot_pos_emb)


class MLP(Sequential):
    def __init__(self, num_channels: int, widening_factor: int, bias: bool = True):
        super().__init__(
            nn.LayerNorm(num_channels),
            nn.Linear(num_channels, widening_factor * num_channels, bias=bias),
            nn.GELU(),
            nn.Linear(widening_factor * num_channels, num_channels, bias=bias),
        )


class CrossAttentionLayer(Sequential):
    def __init__(self, num_heads, num_q_input_channels, num_kv_input_channels, causal_attention=False,
                 widening_factor=1, dropout=0.0, qkv_bias=True, out_bias=True, mlp_bias=True):
        cross_attn = CrossAttention(num_heads, num_q_input_channels, num_kv_input_channels,
                                    causal_attention=causal_attention, dropout=dropout, qkv_bias=qkv_bias,
                                    out_bias=out_bias)
        super().__init__(Residual(cross_attn), Residual(MLP(num_q_input_channels, widening_factor, bias=mlp_bias)))


class SelfAttentionLayer(Sequential):
    def __init__(self, num_heads, num_channels, causal_attention=False, widening_factor=1, dropout=0.0,
                 qkv_bias=True, out_bias=True, mlp_bias=True):
        self_attn = SelfAttention(num_heads, num_channels, causal_attention=causal_attention, dropout=dropout,
                                  qkv_bias=qkv_bias, out_bias=out_bias)
        super().__init__(Residual(self_attn), Residual(MLP(num_channels, widening_factor, bias=mlp_bias)))


class SelfAttentionBlock(Sequential):
    def __init__(self, num_layers, num_heads, num_channels, causal_attention=False, widening_factor=1, dropout=0.0,
                 qkv_bias=True, out_bias=True, mlp_bias=True):
        layers = [SelfAttentionLayer(num_heads, num_channels, causal_attention=causal_attention,
                                     widening_factor=widening_factor, dropout=dropout, qkv_bias=qkv_bias,
                                     out_bias=out_bias, mlp_bias=mlp_bias) for _ in range(num_layers)]
        super().__init__(*layers)


# ---------------- perceiver/model/core/adapter.py, perceiver/model/text/{common,clm}.py ----------------
class TextInputAdapter(nn.Module):
    # RotarySupport mixed into common.TextInputAdapter
    def __init__(self, rotated_channels_per_head: int, vocab_size: int, max_seq_len: int, num_input_channels: int):
        super().__init__()
        self.num_input_channels = num_input_channels
        self.txt_embedding = nn.Embedding(vocab_size, num_input_channels)
        self.pos_embedding = nn.Embedding(max_seq_len, num_input_channels)
        self.frq_pos_encoding = FrequencyPositionEncoding(dim=rotated_channels_per_head)

    def forward(self, x, abs_pos=None):
        if abs_pos is None:
            abs_pos = positions(*x.shape, device=x.device)
        return self.txt_embedding(x) + self.pos_embedding(abs_pos), self.frq_pos_encoding(abs_pos)


class TextOutputAdapter(nn.Module):
    def __init__(self, num_channels: int, vocab_size: int):
        super().__init__()
        self.linear = nn.Linear(num_channels, vocab_size)

    def forward(self, x):
        return self.linear(x)


class PerceiverAR(nn.Module):
    def __init__(self, input_adapter, output_adapter, num_latents, num_heads=8, num_self_attention_layers=6,
                 self_attention_widening_factor=4, cross_attention_widening_factor=4, cross_attention_dropout=0.5,
                 post_attention_dropout=0.0, init_scale=0.02):
        super().__init__()
        self.num_latents = num_latents
        self.input_adapter = input_adapter
        self.output_adapter = output_adapter
        self.cross_attention_dropout = cross_attention_dropout
        self.cross_attention = CrossAttentionLayer(
            num_heads=num_heads, num_q_input_channels=input_adapter.num_input_channels,
            num_kv_input_channels=input_adapter.num_input_channels, causal_attention=True,
            widening_factor=cross_attention_widening_factor, dropout=post_attention_dropout,
            qkv_bias=False, out_bias=True, mlp_bias=False)
        self.self_attention = SelfAttentionBlock(
            num_layers=num_self_attention_layers, num_heads=num_heads, num_channels=input_adapter.num_input_channels,
            causal_attention=True, widening_factor=self_attention_widening_factor, dropout=post_attention_dropout,
            qkv_bias=False, out_bias=False, mlp_bias=False)
        with torch.no_grad():
            init_parameters(self, init_scale)

    def forward(self, x, pad_mask=None):
        if FIXED:
            if pad_mask is None:
                shift = None
            else:
                # caller must ensure that x is left-padded
                shift = pad_mask.sum(dim=1, keepdim=True)
            x, frq_pos_enc = self.input_adapter(x, abs_pos=positions(*x.shape, shift=shift, device=x.device))
        else:
            x, frq_pos_enc = self.input_adapter(x)

        x_latent = x[:, -self.num_latents :]
        x_prefix = x[:, : -self.num_latents]

        frq_pos_enc_latent = frq_pos_enc[:, -self.num_latents :]
        frq_pos_enc_prefix = frq_pos_enc[:, : -self.num_latents]

        if FIXED:
            pad_mask_latent = None if pad_mask is None else pad_mask[:, -self.num_latents :]
            pad_mask_prefix = None if pad_mask is None else pad_mask[:, : -self.num_latents]

        n_prefix = x_prefix.shape[1]
        b, n, _ = x.shape

        if self.training and self.cross_attention_dropout > 0.0:
            rand = torch.rand(b, n_prefix, device=x.device)
            keep = n_prefix - int(n_prefix * self.cross_attention_dropout)
            keep_indices = rand.topk(keep, dim=-1).indices
            keep_mask = torch.zeros_like(rand, dtype=torch.bool).scatter_(dim=1, index=keep_indices, value=1)
            x_prefix = x_prefix[keep_mask].unflatten(0, (b, -1))  # "(b n) c -> b n c"
            frq_pos_enc_prefix = frq_pos_enc_prefix[keep_mask].unflatten(0, (b, -1))
            if FIXED:
                pad_mask_prefix = None if pad_mask is None else pad_mask_prefix[keep_mask].unflatten(0, (b, -1))

        frq_pos_enc_q = frq_pos_enc_latent
        frq_pos_enc_k = torch.cat([frq_pos_enc_prefix, frq_pos_enc_latent], dim=1)

        if FIXED:
            pad_mask_cross_attend = None if pad_mask is None else torch.cat([pad_mask_prefix, pad_mask_latent], dim=1)
            pad_mask_self_attend = None if pad_mask is None else pad_mask_latent
        else:
            pad_mask_cross_attend = None
            pad_mask_self_attend = None

        x_latent = self.cross_attention(
            x_latent,
            x_kv_prefix=x_prefix,
            pad_mask=pad_mask_cross_attend,
            rot_pos_emb_q=RotaryPositionEmbedding(frq_pos_enc_q, right_align=True),
            rot_pos_emb_k=RotaryPositionEmbedding(frq_pos_enc_k, right_align=True),
        )
        x_latent = self.self_attention(
            x_latent,
            pad_mask=pad_mask_self_attend,
            rot_pos_emb=RotaryPositionEmbedding(frq_pos_enc_latent, right_align=True),
        )
        return self.output_adapter(x_latent)


class CausalLanguageModel(PerceiverAR):
    def __init__(self, vocab_size=50, max_seq_len=32, num_channels=32, num_heads=4, num_latents=8,
                 num_self_attention_layers=2, cross_attention_dropout=0.5):
        input_adapter = TextInputAdapter(rotated_channels_per_head=num_channels // num_heads // 2,
                                         vocab_size=vocab_size, max_seq_len=max_seq_len,
                                         num_input_channels=num_channels)
        output_adapter = TextOutputAdapter(num_channels=num_channels, vocab_size=vocab_size)
        super().__init__(input_adapter=input_adapter, output_adapter=output_adapter, num_latents=num_latents,
                         num_heads=num_heads, num_self_attention_layers=num_self_attention_layers,
                         cross_attention_dropout=cross_attention_dropout)


# ---------------- LitCausalLanguageModel.step ----------------
loss_fn = nn.CrossEntropyLoss()


def step(model, batch):
    if FIXED:
        labels, x, pad_mask = batch
        labels[pad_mask] = -100
        logits = model(x, pad_mask=pad_mask)
    else:
        labels, x, _ = batch
        logits = model(x)
    logits = logits.transpose(1, 2)  # "b n c -> b c n"
    return loss_fn(logits, labels[:, -logits.shape[2]:])


def collate(seqs, pad_id=0):
    # DefaultCollator for clm with a left-padding tokenizer: (labels, input_ids, pad_mask)
    n = max(len(s) for s in seqs) - 1
    x = torch.full((len(seqs), n), pad_id, dtype=torch.long)
    y = torch.full((len(seqs), n), pad_id, dtype=torch.long)
    for i, s in enumerate(seqs):
        s = torch.tensor(s)
        x[i, n - (len(s) - 1):] = s[:-1]
        y[i, n - (len(s) - 1):] = s[1:]
    return y, x, x == pad_id


if __name__ == "__main__":
    model = CausalLanguageModel()
    seqs = [torch.randint(1, 50, (L,)).tolist() for L in (25, 17)]
    batch = collate(seqs)

    # one training step as LitCausalLanguageModel.training_step does
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.train()
    loss = step(model, tuple(t.clone() for t in batch))
    opt.zero_grad()
    loss.backward()
    opt.step()

    # eval: logits of the left-padded second sequence vs. that sequence run alone (no padding)
    model.eval()
    with torch.no_grad():
        labels, x, pad_mask = batch
        out_batch = model(x, pad_mask=pad_mask)
        alone = torch.tensor(seqs[1][:-1])[None]
        out_alone = model(alone, pad_mask=torch.zeros_like(alone, dtype=torch.bool))
        diff = (out_batch[1] - out_alone[0]).abs().max().item()
    print(f"train loss: {loss.item():.4f}")
    print(f"max |logits(left-padded in batch) - logits(alone)| over latent positions: {diff:.6e}")
