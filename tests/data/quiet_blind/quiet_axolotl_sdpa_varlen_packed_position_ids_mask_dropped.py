"""Axolotl's sdpa_varlen patch: packed rows run as variable-length attention with cu_seqlens from position_ids.

Correct program (quiet batch quiet-r92b).  Ported from axolotl-ai-cloud/axolotl
@8c42d32268a52b27bb8f97d1fbabc21b293e2b91 src/axolotl/monkeypatch/attention/sdpa_varlen.py (_is_packed,
_block_diagonal_causal_mask, _build_varlen_forward, _build_varlen_mask, patch_sdpa_varlen /
unpatch_sdpa_varlen): the registered "sdpa" attention is wrapped so that, for sample-packed rows whose 2-D
padding mask was dropped, cu_seqlens come from transformers' prepare_fa_kwargs_from_position_ids and
varlen_attn runs each document alone (window_size=(-1, 0), or (W - 1, 0) for a sliding layer); the "sdpa"
mask builder is wrapped to return None when no attention_mask was given, so the varlen path engages.
torch.nn.attention.varlen.varlen_attn needs CUDA; a plain-torch stand-in with its signature is used.

Check: a sample-packed batch of two rows (documents of 5+4+3 and 6+4 tokens, position_ids restarting at 0,
the second row's tail padded with position 0 and label -100) goes through a tiny GQA LlamaForCausalLM
(use_cache=False, no attention_mask, as in training) with the patched "sdpa"; every document's logits equal the
document run alone (unpatched SDPA, no mask), and the loss equals the mean over the documents run alone. The
patch is applied to a full-attention model only, as patch_sdpa_varlen's docstring requires. The stock
unpatched SDPA path with the same position_ids (transformers' packed-sequence mask) is checked against the same
reference.
"""
from typing import Any, Callable

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_flash_attention_utils import prepare_fa_kwargs_from_position_ids
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

_VARLEN_MAX_HEAD_DIM = 256


def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, window_size=(-1, -1), **kwargs):
    """Plain-torch stand-in for torch.nn.attention.varlen.varlen_attn ([T, N, H] packed tokens)."""
    out = torch.zeros_like(query)
    left, right = window_size
    for i in range(cu_seq_q.numel() - 1):
        qs, qe = int(cu_seq_q[i]), int(cu_seq_q[i + 1])
        ks, ke = int(cu_seq_k[i]), int(cu_seq_k[i + 1])
        q, k, v = (t.transpose(0, 1) for t in (query[qs:qe], key[ks:ke], value[ks:ke]))
        qi = torch.arange(qe - qs)[:, None] + (ke - ks) - (qe - qs)
        kj = torch.arange(ke - ks)[None, :]
        allowed = torch.ones(qe - qs, ke - ks, dtype=torch.bool)
        if left >= 0:
            allowed &= kj >= qi - left
        if right >= 0:
            allowed &= kj <= qi + right
        out[qs:qe] = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed).transpose(0, 1)
    return out


def _is_packed(position_ids) -> bool:
    pid = position_ids if position_ids.dim() > 1 else position_ids[None]
    return int((pid == 0).sum()) > pid.shape[0]


def _block_diagonal_causal_mask(position_ids, seq_len: int):
    pid = position_ids if position_ids.dim() > 1 else position_ids[None]
    doc = (pid == 0).cumsum(-1)
    same_doc = doc[:, :, None] == doc[:, None, :]
    idx = torch.arange(seq_len, device=pid.device)
    causal = idx[:, None] >= idx[None, :]
    return (same_doc & causal[None])[:, None]


def _build_varlen_forward(original_sdpa: Callable) -> Callable:
    _supports_window = True

    def sdpa_varlen_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        position_ids = kwargs.get("position_ids")
        sliding_window = kwargs.get("sliding_window", None) or getattr(module, "sliding_window", None)
        head_dim = query.shape[-1]
        standard_scale = scaling is None or abs(scaling - head_dim**-0.5) < 1e-9
        use_varlen = (
            attention_mask is None
            and not dropout
            and head_dim <= _VARLEN_MAX_HEAD_DIM
            and position_ids is not None
            and standard_scale
        )
        packed = position_ids is not None and _is_packed(position_ids)
        use_varlen = use_varlen and packed
        if not use_varlen:
            if attention_mask is None and packed:
                attention_mask = _block_diagonal_causal_mask(position_ids, query.shape[2])
            return original_sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                 **kwargs)

        if sliding_window and not _supports_window:
            raise NotImplementedError("sdpa_varlen: sliding-window attention needs varlen_attn(window_size=...)")

        B, Hq, S, D = query.shape
        Hkv = key.shape[1]
        if Hq != Hkv:
            n = Hq // Hkv
            key = key.repeat_interleave(n, dim=1)
            value = value.repeat_interleave(n, dim=1)
        pid = position_ids if position_ids.dim() > 1 else position_ids[None]
        (cu_q, cu_k), (max_q, max_k) = prepare_fa_kwargs_from_position_ids(pid)
        qf = query.transpose(1, 2).reshape(B * S, Hq, D)
        kf = key.transpose(1, 2).reshape(B * S, Hq, D)
        vf = value.transpose(1, 2).reshape(B * S, Hq, D)
        window = (sliding_window - 1, 0) if sliding_window else (-1, 0)
        out = varlen_attn(qf, kf, vf, cu_q.to(torch.int32), cu_k.to(torch.int32), int(max_q), int(max_k),
                          window_size=window)
        if isinstance(out, tuple):
            out = out[0]
        return out.reshape(B, S, Hq, D), None

    return sdpa_varlen_forward


def _build_varlen_mask(original_mask: Callable) -> Callable:
    def sdpa_varlen_mask(*args: Any, **kwargs: Any):
        if kwargs.get("attention_mask") is None:
            return None
        return original_mask(*args, **kwargs)

    return sdpa_varlen_mask


def patch_sdpa_varlen():
    original = ALL_ATTENTION_FUNCTIONS["sdpa"]
    original_mask = ALL_MASK_ATTENTION_FUNCTIONS["sdpa"]
    wrapper = _build_varlen_forward(original)
    wrapper._axolotl_sdpa_original = original
    mask_wrapper = _build_varlen_mask(original_mask)
    mask_wrapper._axolotl_sdpa_mask_original = original_mask
    ALL_ATTENTION_FUNCTIONS.register("sdpa", wrapper)
    ALL_MASK_ATTENTION_FUNCTIONS.register("sdpa", mask_wrapper)


def unpatch_sdpa_varlen():
    ALL_ATTENTION_FUNCTIONS.register("sdpa", ALL_ATTENTION_FUNCTIONS["sdpa"]._axolotl_sdpa_original)
    ALL_MASK_ATTENTION_FUNCTIONS.register("sdpa", ALL_MASK_ATTENTION_FUNCTIONS["sdpa"]._axolotl_sdpa_mask_original)


def multipack_batch(rows, pad_id=0):
    """Sample-packed rows as axolotl's V2 collator hands them over: position_ids restart per sample."""
    width = max(sum(len(d) for d in row) for row in rows)
    input_ids, position_ids, labels = [], [], []
    for row in rows:
        ids, pos, lab = [], [], []
        for d in row:
            ids += d
            pos += list(range(len(d)))
            lab += [-100] + d[1:]
        pad = width - len(ids)
        input_ids.append(ids + [pad_id] * pad)
        position_ids.append(pos + [0] * pad)
        labels.append(lab + [-100] * pad)
    return torch.tensor(input_ids), torch.tensor(position_ids), torch.tensor(labels)


def reference(model, rows):
    """Each document alone, unpatched SDPA, no mask, no packing."""
    ref_logits, ref_nll, ref_count = [], 0.0, 0
    with torch.no_grad():
        for row in rows:
            for d in row:
                out = model(input_ids=torch.tensor([d]))
                ref_logits.append(out.logits[0])
                ref_nll += F.cross_entropy(out.logits[0, :-1], torch.tensor(d[1:]), reduction="sum")
                ref_count += len(d) - 1
    return ref_logits, ref_nll / ref_count


def check(model, rows, input_ids, position_ids, labels, ref):
    ref_logits, ref_loss = ref
    with torch.no_grad():
        out = model(input_ids=input_ids, position_ids=position_ids, labels=labels, use_cache=False)
    i = 0
    for b, row in enumerate(rows):
        start = 0
        for d in row:
            torch.testing.assert_close(out.logits[b, start:start + len(d)], ref_logits[i], atol=1e-5, rtol=1e-5)
            start += len(d)
            i += 1
    torch.testing.assert_close(out.loss, ref_loss, atol=1e-5, rtol=1e-5)
    return float(out.loss)


def main():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(3)
    rows = [[torch.randint(1, 64, (n,), generator=g).tolist() for n in row] for row in ((5, 4, 3), (6, 4))]
    input_ids, position_ids, labels = multipack_batch(rows)

    common = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, attn_implementation="sdpa")
    model = LlamaForCausalLM(LlamaConfig(**common)).eval()
    ref = reference(model, rows)
    loss_stock = check(model, rows, input_ids, position_ids, labels, ref)
    patch_sdpa_varlen()
    try:
        loss_varlen = check(model, rows, input_ids, position_ids, labels, ref)
    finally:
        unpatch_sdpa_varlen()
    print("stock", loss_stock, "varlen", loss_varlen, "reference", float(ref[1]))
    print("ok")


if __name__ == "__main__":
    main()
