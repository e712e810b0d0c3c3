# Citation: facebookresearch/fairseq commit 229de008 ("Fix an issue for waitk when left_pad_source
#   is set", fairinternal/fairseq-py#1752, D27370799).
# Upstream: examples/simultaneous_translation/modules/monotonic_multihead_attention.py,
#   MonotonicMultiheadAttentionWaitK.p_choose (consumed by MonotonicAttention.expected_alignment_train
#   and MonotonicMultiheadAttentionInfiniteLookback.expected_attention), utils/functions.py helpers.
# Bug: the wait-k read/write pattern p_choose was a fixed diagonal starting at source column k-1
#   (torch.tril/triu of ones). fairseq translation batches are LEFT-padded (left_pad_source=True), so
#   for a padded sentence the diagonal is counted from the first pad, not from the first real token:
#   each target step of a shorter source reads (number of pads) fewer real source tokens than wait-k.
# Fix: p_choose is built by scattering 1.0 at n * (src_len + 1) + k - 1, shifted by the number of
#   pads per sentence when key_padding_mask[:, 0].any() (left padding), clamped, then viewed back.
import math
import sys
from types import SimpleNamespace
from typing import Dict, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

FIXED = "--fixed" in sys.argv


# ---- examples/simultaneous_translation/utils/functions.py ----------------------------------
def safe_cumprod(tensor, dim: int, eps: float = 1e-10):
    if (tensor + eps < 0).any().item():
        raise RuntimeError("Safe cumprod can only take non-negative tensors as input.")
    log_tensor = torch.log(tensor + eps)
    cumsum_log_tensor = torch.cumsum(log_tensor, dim)
    exp_cumsum_log_tensor = torch.exp(cumsum_log_tensor)
    return exp_cumsum_log_tensor


def exclusive_cumprod(tensor, dim: int, eps: float = 1e-10):
    tensor_size = list(tensor.size())
    tensor_size[dim] = 1
    return_tensor = safe_cumprod(
        torch.cat([torch.ones(tensor_size).type_as(tensor), tensor], dim=dim),
        dim=dim,
        eps=eps,
    )
    if dim == 0:
        return return_tensor[:-1]
    elif dim == 1:
        return return_tensor[:, :-1]
    elif dim == 2:
        return return_tensor[:, :, :-1]
    else:
        raise RuntimeError("Cumprod on dimension 3 and more is not implemented")


# ---- fairseq.modules.MultiheadAttention (the parts the monotonic attention uses) ------------
class MultiheadAttention(nn.Module):
    def __init__(self, embed_dim, num_heads, kdim=None, vdim=None, dropout=0.0,
                 encoder_decoder_attention=False):
        super().__init__()
        self.embed_dim = embed_dim
        self.kdim = kdim if kdim is not None else embed_dim
        self.vdim = vdim if vdim is not None else embed_dim
        self.qkv_same_dim = self.kdim == embed_dim and self.vdim == embed_dim
        self.num_heads = num_heads
        self.dropout_module = nn.Dropout(dropout)
        self.head_dim = embed_dim // num_heads
        self.scaling = self.head_dim ** -0.5
        self.encoder_decoder_attention = encoder_decoder_attention
        self.k_proj = nn.Linear(self.kdim, embed_dim, bias=True)
        self.v_proj = nn.Linear(self.vdim, embed_dim, bias=True)
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=True)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=True)
        nn.init.xavier_uniform_(self.k_proj.weight, gain=1 / math.sqrt(2))
        nn.init.xavier_uniform_(self.v_proj.weight, gain=1 / math.sqrt(2))
        nn.init.xavier_uniform_(self.q_proj.weight, gain=1 / math.sqrt(2))
        nn.init.xavier_uniform_(self.out_proj.weight)
        nn.init.constant_(self.out_proj.bias, 0.0)


# ---- examples/simultaneous_translation/modules/monotonic_multihead_attention.py ------------
class MonotonicAttention(nn.Module):
    def __init__(self, args):
        self.eps = args.attention_eps
        self.mass_preservation = args.mass_preservation
        self.noise_type = args.noise_type
        self.noise_mean = args.noise_mean
        self.noise_var = args.noise_var
        self.energy_bias_init = args.energy_bias_init
        self.energy_bias = (
            nn.Parameter(self.energy_bias_init * torch.ones([1]))
            if args.energy_bias is True
            else 0
        )


class MonotonicMultiheadAttentionHardAligned(MonotonicAttention, MultiheadAttention):
    def __init__(self, args):
        MultiheadAttention.__init__(
            self,
            embed_dim=args.decoder_embed_dim,
            num_heads=args.decoder_attention_heads,
            kdim=getattr(args, "encoder_embed_dim", None),
            vdim=getattr(args, "encoder_embed_dim", None),
            dropout=args.attention_dropout,
            encoder_decoder_attention=True,
        )
        MonotonicAttention.__init__(self, args)
        self.k_in_proj = {"monotonic": self.k_proj}
        self.q_in_proj = {"monotonic": self.q_proj}
        self.v_in_proj = {"output": self.v_proj}

    def attn_energy(self, q_proj, k_proj, key_padding_mask=None, attn_mask=None):
        bsz, tgt_len, embed_dim = q_proj.size()
        bsz = bsz // self.num_heads
        src_len = k_proj.size(1)
        attn_energy = torch.bmm(q_proj, k_proj.transpose(1, 2)) + self.energy_bias
        if attn_mask is not None:
            attn_mask = attn_mask.unsqueeze(0)
            attn_energy += attn_mask
        attn_energy = attn_energy.view(bsz, self.num_heads, tgt_len, src_len)
        if key_padding_mask is not None:
            attn_energy = attn_energy.masked_fill(
                key_padding_mask.unsqueeze(1).unsqueeze(2).to(torch.bool),
                float("-inf"),
            )
        return attn_energy

    def expected_alignment_train(self, p_choose, key_padding_mask: Optional[Tensor]):
        bsz_num_heads, tgt_len, src_len = p_choose.size()
        cumprod_1mp = exclusive_cumprod(1 - p_choose, dim=2, eps=self.eps)
        cumprod_1mp_clamp = torch.clamp(cumprod_1mp, self.eps, 1.0)
        init_attention = p_choose.new_zeros([bsz_num_heads, 1, src_len])
        init_attention[:, :, 0] = 1.0
        previous_attn = [init_attention]
        for i in range(tgt_len):
            alpha_i = (
                p_choose[:, i]
                * cumprod_1mp[:, i]
                * torch.cumsum(previous_attn[i][:, 0] / cumprod_1mp_clamp[:, i], dim=1)
            ).clamp(0, 1.0)
            previous_attn.append(alpha_i.unsqueeze(1))
        alpha = torch.cat(previous_attn[1:], dim=1)

        if self.mass_preservation:
            if key_padding_mask is not None and key_padding_mask[:, -1].any():
                # right padding
                batch_size = key_padding_mask.size(0)
                residuals = 1 - alpha.sum(dim=-1, keepdim=True).clamp(0.0, 1.0)
                src_lens = src_len - key_padding_mask.sum(dim=1, keepdim=True)
                src_lens = src_lens.expand(batch_size, self.num_heads).contiguous().view(-1, 1)
                src_lens = src_lens.expand(-1, tgt_len).contiguous()
                residuals += alpha.gather(2, src_lens.unsqueeze(-1) - 1)
                alpha = alpha.scatter(2, src_lens.unsqueeze(-1) - 1, residuals)
            else:
                residuals = 1 - alpha[:, :, :-1].sum(dim=-1).clamp(0.0, 1.0)
                alpha[:, :, -1] = residuals

        if torch.isnan(alpha).any():
            raise RuntimeError("NaN in alpha.")
        return alpha

    def forward(self, query, key, value, key_padding_mask=None, attn_mask=None,
                incremental_state=None, need_weights=True, static_kv=False,
                need_head_weights=False):
        assert query is not None
        assert value is not None
        tgt_len, bsz, embed_dim = query.size()
        src_len = value.size(0)

        p_choose = self.p_choose(query, key, key_padding_mask, incremental_state)
        # training path (teacher forcing): no incremental_state
        alpha = self.expected_alignment_train(p_choose, key_padding_mask)
        beta = self.expected_attention(
            alpha, query, key, value, key_padding_mask, attn_mask, incremental_state
        )
        attn_weights = beta
        v_proj = self.v_proj_output(value)
        attn = torch.bmm(attn_weights.type_as(v_proj), v_proj)
        attn = attn.transpose(0, 1).contiguous().view(tgt_len, bsz, embed_dim)
        attn = self.out_proj(attn)

        beta = beta.view(bsz, self.num_heads, tgt_len, src_len)
        alpha = alpha.view(bsz, self.num_heads, tgt_len, src_len)
        p_choose = p_choose.view(bsz, self.num_heads, tgt_len, src_len)
        return attn, {"alpha": alpha, "beta": beta, "p_choose": p_choose}

    def input_projections(self, query, key, value, name: str):
        if query is not None:
            bsz = query.size(1)
            q = self.q_proj(query)
            q *= self.scaling
            q = q.contiguous().view(-1, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        else:
            q = None
        if key is not None:
            bsz = key.size(1)
            k = self.k_proj(key)
            k = k.contiguous().view(-1, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        else:
            k = None
        if value is not None:
            bsz = value.size(1)
            v = self.v_proj(value)
            v = v.contiguous().view(-1, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        else:
            v = None
        return q, k, v

    def v_proj_output(self, value):
        _, _, v_proj = self.input_projections(None, None, value, "output")
        return v_proj


class MonotonicMultiheadAttentionInfiniteLookback(MonotonicMultiheadAttentionHardAligned):
    def __init__(self, args):
        super().__init__(args)
        self.init_soft_attention()

    def init_soft_attention(self):
        self.k_proj_soft = nn.Linear(self.kdim, self.embed_dim, bias=True)
        self.q_proj_soft = nn.Linear(self.embed_dim, self.embed_dim, bias=True)
        self.k_in_proj["soft"] = self.k_proj_soft
        self.q_in_proj["soft"] = self.q_proj_soft
        if self.qkv_same_dim:
            nn.init.xavier_uniform_(self.k_in_proj["soft"].weight, gain=1 / math.sqrt(2))
            nn.init.xavier_uniform_(self.q_in_proj["soft"].weight, gain=1 / math.sqrt(2))
        else:
            nn.init.xavier_uniform_(self.k_in_proj["soft"].weight)
            nn.init.xavier_uniform_(self.q_in_proj["soft"].weight)

    def expected_attention(self, alpha, query, key, value, key_padding_mask, attn_mask,
                           incremental_state):
        bsz_x_num_heads, tgt_len, src_len = alpha.size()
        bsz = int(bsz_x_num_heads / self.num_heads)

        q, k, _ = self.input_projections(query, key, None, "soft")
        soft_energy = self.attn_energy(q, k, key_padding_mask, attn_mask)
        assert list(soft_energy.size()) == [bsz, self.num_heads, tgt_len, src_len]
        soft_energy = soft_energy.view(bsz * self.num_heads, tgt_len, src_len)

        soft_energy = soft_energy - soft_energy.max(dim=2, keepdim=True)[0]
        exp_soft_energy = torch.exp(soft_energy) + self.eps
        inner_items = alpha / (torch.cumsum(exp_soft_energy, dim=2))
        beta = exp_soft_energy * torch.cumsum(inner_items.flip(dims=[2]), dim=2).flip(dims=[2])
        beta = beta.view(bsz, self.num_heads, tgt_len, src_len)
        if key_padding_mask is not None:
            beta = beta.masked_fill(key_padding_mask.unsqueeze(1).unsqueeze(2).to(torch.bool), 0)
        beta = beta / beta.sum(dim=3, keepdim=True)
        beta = beta.view(bsz * self.num_heads, tgt_len, src_len)
        beta = self.dropout_module(beta)

        if torch.isnan(beta).any():
            raise RuntimeError("NaN in beta.")
        return beta


class MonotonicMultiheadAttentionWaitK(MonotonicMultiheadAttentionInfiniteLookback):
    def __init__(self, args):
        super().__init__(args)
        self.q_in_proj["soft"] = self.q_in_proj["monotonic"]
        self.k_in_proj["soft"] = self.k_in_proj["monotonic"]
        self.waitk_lagging = args.waitk_lagging
        assert self.waitk_lagging > 0

    def p_choose(self, query, key, key_padding_mask=None, incremental_state=None):
        """
        query: bsz, tgt_len
        key: bsz, src_len
        key_padding_mask: bsz, src_len
        """
        if incremental_state is not None:
            tgt_len = int(incremental_state["steps"]["tgt"])
        else:
            tgt_len, bsz, _ = query.size()

        if not FIXED:
            src_len, bsz, _ = key.size()

            p_choose = torch.ones(bsz, tgt_len, src_len).to(query)
            p_choose = torch.tril(p_choose, diagonal=self.waitk_lagging - 1)
            p_choose = torch.triu(p_choose, diagonal=self.waitk_lagging - 1)
        else:
            max_src_len, bsz, _ = key.size()

            if max_src_len < self.waitk_lagging:
                return query.new_zeros(bsz * self.num_heads, tgt_len, max_src_len)

            activate_indices_offset = (
                (torch.arange(tgt_len) * (max_src_len + 1) + self.waitk_lagging - 1)
                .unsqueeze(0)
                .expand(bsz, tgt_len)
                .to(query)
                .long()
            )

            if key_padding_mask is not None:
                if key_padding_mask[:, 0].any():
                    # Left padding
                    activate_indices_offset += key_padding_mask.sum(dim=1, keepdim=True)

            # Need to clamp the indices that are too large
            activate_indices_offset = activate_indices_offset.clamp(
                0, min([tgt_len, max_src_len - self.waitk_lagging + 1]) * max_src_len - 1
            )

            p_choose = torch.zeros(bsz, tgt_len * max_src_len).to(query)
            p_choose = p_choose.scatter(1, activate_indices_offset, 1.0).view(
                bsz, tgt_len, max_src_len
            )
            src_len = max_src_len

        if incremental_state is not None:
            p_choose = p_choose[:, -1:]
            tgt_len = 1

        # Extend to each head
        p_choose = (
            p_choose.contiguous()
            .unsqueeze(1)
            .expand(-1, self.num_heads, -1, -1)
            .contiguous()
            .view(-1, tgt_len, src_len)
        )
        return p_choose


# ---- a tiny wait-k translation model trained with teacher forcing ---------------------------
PAD, EOS, BOS = 1, 2, 0
VOCAB, DIM, HEADS = 20, 16, 2


def sinusoidal(positions, dim):
    half = dim // 2
    freq = torch.exp(torch.arange(half, dtype=torch.float) * -(math.log(10000.0) / (half - 1)))
    ang = positions.float().unsqueeze(-1) * freq
    return torch.cat([ang.sin(), ang.cos()], dim=-1)


def make_positions(tokens, padding_idx):
    # fairseq utils.make_positions: pads keep padding_idx, real tokens count from padding_idx + 1
    mask = tokens.ne(padding_idx).int()
    return (torch.cumsum(mask, dim=1).type_as(mask) * mask).long() + padding_idx


class TinyWaitkModel(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.src_embed = nn.Embedding(VOCAB, DIM, padding_idx=PAD)
        self.tgt_embed = nn.Embedding(VOCAB, DIM, padding_idx=PAD)
        self.enc_fc = nn.Linear(DIM, DIM)
        self.encoder_attn = MonotonicMultiheadAttentionWaitK(args)
        self.encoder_attn_layer_norm = nn.LayerNorm(DIM)
        self.out = nn.Linear(DIM, VOCAB)

    def forward(self, src_tokens, prev_output_tokens):
        encoder_padding_mask = src_tokens.eq(PAD)
        x = self.src_embed(src_tokens) * math.sqrt(DIM)
        x = x + sinusoidal(make_positions(src_tokens, PAD), DIM)
        x = torch.tanh(self.enc_fc(x))
        x = x.masked_fill(encoder_padding_mask.unsqueeze(-1), 0.0)
        encoder_out = x.transpose(0, 1)  # T x B x C

        y = self.tgt_embed(prev_output_tokens) * math.sqrt(DIM)
        y = y + sinusoidal(make_positions(prev_output_tokens, PAD), DIM)
        y = y.transpose(0, 1)
        residual = y
        y, attn = self.encoder_attn(
            query=y, key=encoder_out, value=encoder_out,
            key_padding_mask=encoder_padding_mask, static_kv=True,
        )
        y = self.encoder_attn_layer_norm(residual + y)
        return self.out(y.transpose(0, 1)), attn


def main():
    torch.manual_seed(0)
    args = SimpleNamespace(
        decoder_embed_dim=DIM, decoder_attention_heads=HEADS, encoder_embed_dim=DIM,
        attention_dropout=0.0, attention_eps=1e-6, mass_preservation=True,
        noise_type="flat", noise_mean=0.0, noise_var=1.0, energy_bias=False,
        energy_bias_init=-2.0, waitk_lagging=3,
    )
    model = TinyWaitkModel(args)

    # a fairseq translation batch: sources LEFT-padded (left_pad_source=True), targets right-padded
    src_tokens = torch.tensor([
        [5, 6, 7, 8, 9, 10, 11, EOS],
        [PAD, 12, 13, 14, 15, 16, 17, EOS],
        [PAD, PAD, 3, 4, 18, 19, 5, EOS],
    ])
    target = torch.tensor([
        [7, 8, 9, 10, EOS],
        [13, 14, 15, 16, EOS],
        [4, 18, 19, EOS, PAD],
    ])
    prev_output_tokens = torch.cat([torch.full((3, 1), EOS), target[:, :-1]], dim=1)

    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model.train()
    for step in range(30):
        logits, attn = model(src_tokens, prev_output_tokens)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1), ignore_index=PAD)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 10 == 0:
            print(f"step {step:2d} loss {loss.item():.4f}")

    model.eval()
    with torch.no_grad():
        logits, attn = model(src_tokens, prev_output_tokens)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1), ignore_index=PAD)
    print(f"final loss {loss.item():.4f}")
    alpha = attn["alpha"][:, 0]  # head 0
    read_upto = alpha.argmax(-1)
    for b in range(src_tokens.size(0)):
        print(f"sentence {b}: monotonic step per target token {read_upto[b].tolist()}")
    print("beta[2, head 0, target 0]:", [round(v, 4) for v in attn["beta"][2, 0, 0].tolist()])


if __name__ == "__main__":
    main()
