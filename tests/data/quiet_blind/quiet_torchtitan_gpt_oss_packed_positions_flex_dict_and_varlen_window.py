"""GPT-OSS pre-training on packed documents as torchtitan builds its masks, flex and varlen, tiny sizes.

Correct program (quiet batch quiet-r92b).  Ported from pytorch/torchtitan @b5bcd76c66d0acb1a08b176d9639425bc55e0b2a:
  torchtitan/components/data/packing.py  _packing_output_to_text_sequence (positions restart at 0 per
      document; padding from FirstFit packing carries positions 0, labels IGNORE_INDEX)
  torchtitan/models/common/attention.py  get_causal_mask_mod, get_efficient_causal_mask_mod_for_packed_document,
      get_sliding_window_mask_mod, create_varlen_metadata_for_document, VarlenAttention.forward,
      FlexAttention.forward ([T, N, H] <-> [1, N, T, H] at the kernel boundary, lse for out_transform)
  torchtitan/models/common/decoder.py     Decoder._create_flex_attention_mask (and_masks of the mask_mods)
  torchtitan/models/gpt_oss/model.py      GptOssModel.get_attention_masks (dict basic_mask / sliding_window_mask
      for flex, one VarlenMetadata for varlen), GptOssTransformerBlock.attn_mask_key, Attention._apply_sinks /
      apply_attention_sink_rescale
  torchtitan/models/gpt_oss/__init__.py   varlen layers with a window get window_size=(sliding_window_size - 1, 0)
Trimmed: MoE replaced by a dense MLP, no TP/CP/compile; flex_attention runs eagerly on CPU, and
torch.nn.attention.varlen.varlen_attn (CUDA only) is replaced by a plain-torch stand-in with its signature
(cu_seq_q / cu_seq_k, window_size=(left, right), return_aux lse).

Check: one packed row of three documents and a padded tail goes through the model with the flex backend and the
varlen backend; the logits of every document equal the document run alone (positions 0..n-1) through a dense
double-loop attention (causal, causal window of 3 on even layers, sinks), and both losses equal the reference loss.
"""
import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.flex_attention import AuxRequest, and_masks, create_block_mask, flex_attention

torch.manual_seed(0)
IGNORE_INDEX = -100


# ---------------------------------------------------------------- packing (components/data/packing.py)
def _packing_output_to_text_sequence(packing_output):
    labels = np.asarray(packing_output["labels"]).copy()
    labels[np.asarray(packing_output["input_ids_segment_ids"]) == 0] = IGNORE_INDEX
    boundaries = np.asarray(packing_output["positions"]) == 0
    token_indices = np.arange(len(boundaries), dtype=np.int64)
    segment_starts = np.maximum.accumulate(np.where(boundaries, token_indices, 0))
    return dict(input_ids=np.asarray(packing_output["input_ids"]), labels=labels,
                positions=token_indices - segment_starts)


def first_fit_pack(docs, num_tokens):
    ids, labels, positions, seg = [], [], [], []
    for i, d in enumerate(docs):
        ids += d[:-1]
        labels += d[1:]
        positions += list(range(len(d) - 1))
        seg += [i + 1] * (len(d) - 1)
    pad = num_tokens - len(ids)
    ids += [0] * pad
    labels += [0] * pad
    positions += [0] * pad  # FirstFitPackingConfig pads "positions" with 0
    seg += [0] * pad
    return dict(input_ids=ids, labels=labels, positions=positions, input_ids_segment_ids=seg)


# ---------------------------------------------------------------- masks (models/common/attention.py)
class VarlenMetadata:
    def __init__(self, cu_seq_q, cu_seq_k, max_q, max_k):
        self.cu_seq_q, self.cu_seq_k, self.max_q, self.max_k = cu_seq_q, cu_seq_k, max_q, max_k


def round_up(x, m):
    return (x + m - 1) // m * m


def get_causal_mask_mod():
    def _causal_mask(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx
    return _causal_mask


def get_efficient_causal_mask_mod_for_packed_document(positions):
    seq_len = positions.shape[0]
    document_starts = positions == 0
    document_id = torch.cumsum(document_starts.int(), dim=0).to(torch.int32) - 1
    token_idx = torch.arange(seq_len, device=positions.device, dtype=torch.int32)
    offsets = torch.full((round_up(seq_len + 1, 128),), seq_len, device=positions.device, dtype=torch.int32)
    offsets.scatter_(
        0,
        torch.where(document_starts, document_id, torch.full_like(document_id, seq_len)).to(torch.int64),
        torch.where(document_starts, token_idx, torch.full_like(token_idx, seq_len)),
    )

    def packed_document_mask(b, h, q_idx, kv_idx):
        return kv_idx >= offsets[document_id[q_idx]]
    return packed_document_mask


def get_sliding_window_mask_mod(window_size):
    def sliding_window_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx < window_size)
    return sliding_window_mod


def create_varlen_metadata_for_document(positions):
    num_tokens = positions.shape[0]
    doc_starts = (positions == 0).nonzero(as_tuple=True)[0].to(torch.int32)
    packed_cu_seqlens = torch.cat([doc_starts, torch.tensor([num_tokens], dtype=torch.int32)])
    seq_lengths = torch.diff(packed_cu_seqlens)
    max_seqlen = int(seq_lengths.max().item())
    return VarlenMetadata(packed_cu_seqlens, packed_cu_seqlens, max_seqlen, max_seqlen)


def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=False, scale=None,
                window_size=(-1, -1), enable_gqa=False):
    """Plain-torch stand-in for torch.nn.attention.varlen.varlen_attn: [T, N, H] in, [T, N, H] (+ lse [N, T]) out."""
    T, N, H = query.shape
    out = torch.zeros_like(query)
    lse = torch.zeros(N, T, dtype=torch.float32)
    left, right = window_size
    for i in range(cu_seq_q.numel() - 1):
        qs, qe = int(cu_seq_q[i]), int(cu_seq_q[i + 1])
        ks, ke = int(cu_seq_k[i]), int(cu_seq_k[i + 1])
        q = query[qs:qe].transpose(0, 1)
        k = key[ks:ke].transpose(0, 1)
        v = value[ks:ke].transpose(0, 1)
        if enable_gqa:
            k = k.repeat_interleave(N // k.shape[0], dim=0)
            v = v.repeat_interleave(N // v.shape[0], dim=0)
        s = (q.float() @ k.float().transpose(-1, -2)) * (scale if scale is not None else H ** -0.5)
        qi = torch.arange(qe - qs)[:, None] + (ke - ks) - (qe - qs)  # bottom-right aligned
        kj = torch.arange(ke - ks)[None, :]
        allowed = torch.ones(qe - qs, ke - ks, dtype=torch.bool)
        if left >= 0:
            allowed &= kj >= qi - left
        if right >= 0:
            allowed &= kj <= qi + right
        s = s.masked_fill(~allowed, float("-inf"))
        lse[:, qs:qe] = torch.logsumexp(s, dim=-1)
        out[qs:qe] = (torch.softmax(s, dim=-1) @ v.float()).transpose(0, 1).to(query.dtype)
    return (out, lse) if return_aux else out


class VarlenAttention(nn.Module):
    def __init__(self, window_size=(-1, 0)):
        super().__init__()
        self.window_size = window_size

    def forward(self, q_TNH, k_TNH, v_TNH, *, attention_masks, scale=None, out_transform=None, **kwargs):
        assert isinstance(attention_masks, VarlenMetadata)
        result = varlen_attn(q_TNH, k_TNH, v_TNH, attention_masks.cu_seq_q, attention_masks.cu_seq_k,
                             attention_masks.max_q, attention_masks.max_k, scale=scale,
                             window_size=self.window_size, enable_gqa=kwargs.get("enable_gqa", False),
                             return_aux=out_transform is not None)
        if out_transform is None:
            return result
        out_TNH, lse_NT = result
        return out_transform(out_TNH, lse_NT.transpose(0, 1))


class FlexAttention(nn.Module):
    def forward(self, q_TNH, k_TNH, v_TNH, *, attention_masks, scale=None, enable_gqa=False, out_transform=None,
                **kwargs):
        q_BNTH = q_TNH.transpose(0, 1).unsqueeze(0)
        k_BNTH = k_TNH.transpose(0, 1).unsqueeze(0)
        v_BNTH = v_TNH.transpose(0, 1).unsqueeze(0)
        out_BNTH, aux = flex_attention(q_BNTH, k_BNTH, v_BNTH, block_mask=attention_masks, scale=scale,
                                       enable_gqa=enable_gqa, return_aux=AuxRequest(lse=out_transform is not None))
        out_TNH = out_BNTH.squeeze(0).transpose(0, 1)
        if out_transform is None:
            return out_TNH
        lse_TN = aux.lse.squeeze(0).transpose(0, 1)
        return out_transform(out_TNH, lse_TN)


# ---------------------------------------------------------------- model (models/gpt_oss/model.py, trimmed)
@dataclass
class GptOssConfig:
    vocab_size: int = 40
    dim: int = 32
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 8
    sliding_window: int = 3
    attn_backend: str = "flex"

    def sliding_window_size(self, layer_id):
        return self.sliding_window if layer_id % 2 == 0 else None


def rope(x_TNH, positions, theta=10000.0):
    H = x_TNH.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, H, 2, dtype=torch.float32) / H)
    ang = positions.float()[:, None] * inv[None, :]
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    x1, x2 = x_TNH[..., : H // 2], x_TNH[..., H // 2:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def apply_attention_sink_rescale(out, lse, sinks):
    sinks = sinks.view(*([1] * (lse.ndim - 1)), -1)
    sink_scale = torch.sigmoid(lse - sinks).unsqueeze(-1)
    return out * sink_scale.to(out.dtype)


class Attention(nn.Module):
    def __init__(self, cfg, layer_id):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.enable_gqa = self.n_heads > self.n_kv_heads
        self.softmax_scale = 1.0 / math.sqrt(self.head_dim)
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim)
        self.sinks = nn.Parameter(torch.randn(cfg.n_heads))
        window = cfg.sliding_window_size(layer_id)
        if cfg.attn_backend == "varlen":
            self.inner_attention = VarlenAttention((window - 1, 0) if window is not None else (-1, 0))
        else:
            self.inner_attention = FlexAttention()

    def forward(self, x, attention_masks, positions):
        T = x.shape[0]
        q = self.wq(x).view(T, -1, self.head_dim)
        k = self.wk(x).view(T, -1, self.head_dim)
        v = self.wv(x).view(T, -1, self.head_dim)
        q, k = rope(q, positions), rope(k, positions)
        out = self.inner_attention(q, k, v, attention_masks=attention_masks, scale=self.softmax_scale,
                                   enable_gqa=self.enable_gqa, out_transform=self._apply_sinks)
        return self.wo(out.reshape(T, -1).contiguous())

    def _apply_sinks(self, out, lse):
        return apply_attention_sink_rescale(out, lse, self.sinks)


class GptOssTransformerBlock(nn.Module):
    def __init__(self, cfg, layer_id):
        super().__init__()
        self.attn_mask_key = "sliding_window_mask" if cfg.sliding_window_size(layer_id) is not None else "basic_mask"
        self.attention = Attention(cfg, layer_id)
        self.attention_norm = nn.RMSNorm(cfg.dim)
        self.ffn_norm = nn.RMSNorm(cfg.dim)
        self.mlp = nn.Sequential(nn.Linear(cfg.dim, 2 * cfg.dim), nn.SiLU(), nn.Linear(2 * cfg.dim, cfg.dim))

    def forward(self, x, attention_masks, positions):
        if isinstance(attention_masks, dict):  # flex
            attention_masks = attention_masks[self.attn_mask_key]
        x = x + self.attention(self.attention_norm(x), attention_masks, positions)
        return x + self.mlp(self.ffn_norm(x))


class GptOssModel(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(GptOssTransformerBlock(cfg, i) for i in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.dim)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def _create_flex_attention_mask(self, positions, mask_mods):
        seq_len = positions.shape[0]
        return create_block_mask(and_masks(*mask_mods), 1, None, seq_len, seq_len, device=positions.device)

    def get_attention_masks(self, positions):
        if self.cfg.attn_backend == "varlen":
            return create_varlen_metadata_for_document(positions)
        base_mask_mods = [get_causal_mask_mod(), get_efficient_causal_mask_mod_for_packed_document(positions)]
        masks = {"basic_mask": self._create_flex_attention_mask(positions, base_mask_mods)}
        window = None
        for i in range(self.cfg.n_layers):
            if self.cfg.sliding_window_size(i) is not None:
                window = self.cfg.sliding_window_size(i)
                break
        if window is not None:
            masks["sliding_window_mask"] = self._create_flex_attention_mask(
                positions, [*base_mask_mods, get_sliding_window_mask_mod(window)])
        return masks

    def forward(self, tokens, attention_masks, positions):
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, attention_masks, positions)
        return self.output(self.norm(h))


# ---------------------------------------------------------------- reference: one document alone, double loop
def reference_attention(attn, x, window):
    n = x.shape[0]
    pos = torch.arange(n)
    q = rope(attn.wq(x).view(n, -1, attn.head_dim), pos)
    k = rope(attn.wk(x).view(n, -1, attn.head_dim), pos)
    v = attn.wv(x).view(n, -1, attn.head_dim)
    rep = attn.n_heads // attn.n_kv_heads
    out = torch.zeros(n, attn.n_heads, attn.head_dim)
    for h in range(attn.n_heads):
        for i in range(n):
            js = [j for j in range(n) if j <= i and (window is None or i - j < window)]
            s = torch.stack([(q[i, h] * k[j, h // rep]).sum() * attn.softmax_scale for j in js])
            p = torch.softmax(s, 0)
            o = sum(p[t] * v[j, h // rep] for t, j in enumerate(js))
            out[i, h] = o * torch.sigmoid(torch.logsumexp(s, 0) - attn.sinks[h])
    return attn.wo(out.reshape(n, -1))


def reference_forward(model, ids):
    h = model.tok_embeddings(ids)
    for i, layer in enumerate(model.layers):
        h = h + reference_attention(layer.attention, layer.attention_norm(h), model.cfg.sliding_window_size(i))
        h = h + layer.mlp(layer.ffn_norm(h))
    return model.output(model.norm(h))


def main():
    g = torch.Generator().manual_seed(1)
    docs = [torch.randint(1, 40, (n,), generator=g).tolist() for n in (7, 5, 9)]
    num_tokens = 24
    seq = _packing_output_to_text_sequence(first_fit_pack(docs, num_tokens))
    tokens = torch.as_tensor(seq["input_ids"])
    labels = torch.as_tensor(seq["labels"])
    positions = torch.as_tensor(seq["positions"])

    flex_model = GptOssModel(GptOssConfig(attn_backend="flex"))
    varlen_model = GptOssModel(GptOssConfig(attn_backend="varlen"))
    varlen_model.load_state_dict(flex_model.state_dict())

    with torch.no_grad():
        ref_logits, ref_labels = [], []
        for d in docs:
            ref_logits.append(reference_forward(flex_model, torch.tensor(d[:-1])))
            ref_labels.append(torch.tensor(d[1:]))
        ref_loss = F.cross_entropy(torch.cat(ref_logits), torch.cat(ref_labels))

        for model in (flex_model, varlen_model):
            masks = model.get_attention_masks(positions)
            logits = model(tokens, masks, positions)
            start = 0
            for d, ref in zip(docs, ref_logits):
                n = len(d) - 1
                torch.testing.assert_close(logits[start:start + n], ref, atol=1e-4, rtol=1e-4)
                start += n
            loss = F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX)
            torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-5)
            print(model.cfg.attn_backend, "loss", float(loss), "reference", float(ref_loss))
    print("ok")


if __name__ == "__main__":
    main()
