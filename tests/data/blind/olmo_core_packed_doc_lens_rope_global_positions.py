# allenai/OLMo-core#663 ("Fixes the Qwen3 implementation to match HF", commit 60d2487a).
# Packed pre-training rows with intra-document masking: the collator's doc_lens become
# cu_doc_lens and the attention kernel keeps each document to itself, but before the fix
# Attention.forward called RotaryEmbedding.forward without cu_doc_lens, so RoPE numbered every
# token by its place in the packed row (the second document starts at 10, not 0).  With RoPE
# applied in the input dtype (bf16, full_precision=False as in the Qwen3 config) a document's
# output then depends on where it was packed.  The fix passes cu_doc_lens to the rotary
# embedding, which restarts positions at 0 in every document (flat_idx - cu_doc_lens[doc_id]).
# Ported from src/olmo_core/nn/rope.py and src/olmo_core/nn/attention/__init__.py, trimmed.
import sys
from typing import Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


def compute_inv_freqs(theta: int, dim: int, device: torch.device) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, device=device, dtype=torch.float) / dim))


class RotaryEmbedding(nn.Module):
    def __init__(self, head_size: int, theta: int = 1_000_000, full_precision: bool = False):
        super().__init__()
        self.dim = head_size
        self.theta = theta
        self.full_precision = full_precision
        self._cache = {}

    def _get_rotary_embedding(self, seq_len: int, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
        if (
            (pos_sin := self._cache.get("rope_pos_sin")) is not None
            and (pos_cos := self._cache.get("rope_pos_cos")) is not None
            and pos_sin.shape[-2] >= seq_len
            and pos_cos.shape[-2] >= seq_len
        ):
            return pos_sin[:seq_len, :], pos_cos[:seq_len, :]
        with torch.autocast(device.type, enabled=False):
            inv_freq = compute_inv_freqs(self.theta, self.dim, device)
            seq = torch.arange(seq_len, device=device, dtype=torch.float)
            freqs = torch.einsum("i , j -> i j", seq, inv_freq)
            positions = torch.cat((freqs, freqs), dim=-1)
            pos_sin, pos_cos = positions.sin(), positions.cos()
        self._cache["rope_pos_sin"] = pos_sin
        self._cache["rope_pos_cos"] = pos_cos
        return pos_sin, pos_cos

    def _rotate_half(self, x: torch.Tensor) -> torch.Tensor:
        B, nh, T, hs = x.size()
        x = x.view(B, nh, T, 2, hs // 2)
        x1, x2 = x.unbind(dim=-2)
        return torch.cat((-x2, x1), dim=-1)

    def _apply_rotary_pos_emb(self, pos_sin, pos_cos, t):
        return ((t * pos_cos) + (self._rotate_half(t) * pos_sin)).to(t.dtype)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        head_first: bool = True,
        start_pos: Optional[int] = None,
        pos_sin: Optional[torch.Tensor] = None,
        pos_cos: Optional[torch.Tensor] = None,
        freqs_cis: Optional[torch.Tensor] = None,
        cu_doc_lens: Optional[torch.Tensor] = None,
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        if cu_doc_lens is not None and start_pos is not None:
            raise RuntimeError("'cu_doc_lens' and 'start_pos' are mutually exclusive")
        if head_first:
            q_len, k_len = q.size(2), k.size(2)
        else:
            q_len, k_len = q.size(1), k.size(1)
        if self.full_precision:
            q_, k_ = q.float(), k.float()
        else:
            q_, k_ = q, k

        with torch.autocast(q.device.type, enabled=False):
            seq_len_needed = (start_pos + k_len) if start_pos is not None else k_len
            if pos_sin is None or pos_cos is None:
                pos_sin, pos_cos = self._get_rotary_embedding(seq_len_needed, q_.device)
            pos_sin, pos_cos = pos_sin.type_as(q_), pos_cos.type_as(q_)

            def _broadcast(t: torch.Tensor) -> torch.Tensor:
                return t[None, None, :, :] if head_first else t[None, :, None, :]

            if cu_doc_lens is not None:
                B = q_.size(0)
                flat_idx = torch.arange(B * k_len, device=q_.device, dtype=cu_doc_lens.dtype)
                doc_id = torch.bucketize(flat_idx, cu_doc_lens[1:], right=True)
                pos_idx = (flat_idx - cu_doc_lens[doc_id]).view(B, k_len)
                sin_sel = pos_sin.index_select(0, pos_idx.reshape(-1)).view(B, k_len, -1)
                cos_sel = pos_cos.index_select(0, pos_idx.reshape(-1)).view(B, k_len, -1)
                if head_first:
                    sin_qk, cos_qk = sin_sel.unsqueeze(1), cos_sel.unsqueeze(1)
                else:
                    sin_qk, cos_qk = sin_sel.unsqueeze(2), cos_sel.unsqueeze(2)
                q_ = self._apply_rotary_pos_emb(sin_qk, cos_qk, q_)
                k_ = self._apply_rotary_pos_emb(sin_qk, cos_qk, k_)
            else:
                q_abs_start = start_pos if start_pos is not None else (k_len - q_len)
                k_abs_start = start_pos if start_pos is not None else 0
                sin_q = _broadcast(pos_sin[q_abs_start : q_abs_start + q_len, :])
                cos_q = _broadcast(pos_cos[q_abs_start : q_abs_start + q_len, :])
                sin_k = _broadcast(pos_sin[k_abs_start : k_abs_start + k_len, :])
                cos_k = _broadcast(pos_cos[k_abs_start : k_abs_start + k_len, :])
                q_ = self._apply_rotary_pos_emb(sin_q, cos_q, q_)
                k_ = self._apply_rotary_pos_emb(sin_k, cos_k, k_)
        return q_.type_as(q), k_.type_as(k)


def torch_varlen_sdpa(q, k, v, cu_doc_lens, max_doc_len):
    # Stand-in for flash_attn_varlen_func(causal=True) over the flattened batch:
    # q, k, v are (B * T, n_heads, head_dim); each document attends causally to itself.
    out = torch.empty_like(q)
    for i in range(cu_doc_lens.numel() - 1):
        s, e = int(cu_doc_lens[i]), int(cu_doc_lens[i + 1])
        qd, kd, vd = (t[s:e].transpose(0, 1) for t in (q, k, v))
        out[s:e] = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True).transpose(0, 1)
    return out


class Attention(nn.Module):
    def __init__(self, d_model: int, n_heads: int, rope_theta: int = 1_000_000):
        super().__init__()
        self.n_heads = n_heads
        self.head_dim = d_model // n_heads
        self.w_q = nn.Linear(d_model, d_model, bias=False)
        self.w_k = nn.Linear(d_model, d_model, bias=False)
        self.w_v = nn.Linear(d_model, d_model, bias=False)
        self.w_out = nn.Linear(d_model, d_model, bias=False)
        self.rope = RotaryEmbedding(head_size=self.head_dim, theta=rope_theta, full_precision=False)

    def _apply_rope(self, q, k, start_pos, pos_sin, pos_cos, freqs_cis, cu_doc_lens):
        rope_kwargs = {}
        if cu_doc_lens is not None:
            rope_kwargs["cu_doc_lens"] = cu_doc_lens
        return self.rope(q, k, head_first=False, start_pos=start_pos, pos_sin=pos_sin,
                         pos_cos=pos_cos, freqs_cis=freqs_cis, **rope_kwargs)

    def forward(self, x, max_doc_len=None, cu_doc_lens=None, pos_sin=None, pos_cos=None, freqs_cis=None):
        B, T, _ = x.shape
        q = self.w_q(x).view(B, T, self.n_heads, self.head_dim)
        k = self.w_k(x).view(B, T, self.n_heads, self.head_dim)
        v = self.w_v(x).view(B, T, self.n_heads, self.head_dim)
        start_pos = None
        if FIXED:
            q, k = self._apply_rope(q, k, start_pos, pos_sin, pos_cos, freqs_cis, cu_doc_lens)
        else:
            q, k = self.rope(q, k, head_first=False, start_pos=start_pos,
                             pos_sin=pos_sin, pos_cos=pos_cos, freqs_cis=freqs_cis)
        if cu_doc_lens is not None:
            att = torch_varlen_sdpa(q.reshape(B * T, self.n_heads, self.head_dim),
                                    k.reshape(B * T, self.n_heads, self.head_dim),
                                    v.reshape(B * T, self.n_heads, self.head_dim),
                                    cu_doc_lens, max_doc_len).view(B, T, -1)
        else:
            att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                 is_causal=True).transpose(1, 2).reshape(B, T, -1)
        return self.w_out(att)


def get_cumulative_document_lengths(doc_lens: torch.Tensor) -> torch.Tensor:
    # olmo_core.data.utils: doc_lens (B, max_docs) zero-padded -> cu_doc_lens over the flat batch
    return torch.cat(
        [torch.tensor([0], dtype=torch.int32), torch.cumsum(doc_lens.masked_select(doc_lens != 0), 0, dtype=torch.int32)]
    )


torch.manual_seed(0)
d_model, n_heads, vocab, T = 64, 4, 97, 32
embed = nn.Embedding(vocab, d_model).to(torch.bfloat16)
attn = Attention(d_model, n_heads).to(torch.bfloat16)

# Two packed rows of the pre-training batch; EOS = 0 closes each document.
docs = [torch.randint(1, vocab, (n,)) for n in (10, 21, 17, 14, 1)]
for d in docs:
    d[-1] = 0
input_ids = torch.stack([torch.cat([docs[0], docs[1], docs[4]]),
                         torch.cat([docs[2], docs[3], docs[4]])])
doc_lens = torch.tensor([[10, 21, 1], [17, 14, 1]], dtype=torch.int32)
cu_doc_lens = get_cumulative_document_lengths(doc_lens)
max_doc_len = int(doc_lens.max())

with torch.no_grad():
    x = embed(input_ids)
    out = attn(x, max_doc_len=max_doc_len, cu_doc_lens=cu_doc_lens)
    logits = out.float() @ embed.weight.float().T
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, vocab), input_ids[:, 1:].reshape(-1))

print("cu_doc_lens:", cu_doc_lens.tolist())
print("row 0, second document, last token output[:6]:", [round(v, 4) for v in out[0, 30, :6].float().tolist()])
print("row 1, second document, last token output[:6]:", [round(v, 4) for v in out[1, 30, :6].float().tolist()])
print(f"packed loss: {loss.item():.6f}")
