# Correct program (quiet batch quiet-r101a).
# Ported from InternLM/InternLM @aaaf4d7b0eef8a44d308806381f38a8bbd6e27de (the training code before it moved to
# InternEVO): internlm/data/packed_dataset.py (PackedDataset.mapping / build_pack: samples packed into one row of
# packed_length tokens, `cu_seqlens` per sample, `indexes` restarting at 0 per sample and per max_length_per_sample
# chunk, a sample cut at the pack's end continuing in the next pack), internlm/data/collaters.py (packed_collate_fn),
# internlm/model/modeling_internlm.py (PackedFlashInternLm1D.forward squeezes the batch of 1, max_seqlen from
# cu_seqlens), internlm/model/multi_head_attention.py (MHA._packed_forward: rotary at `indexes`, FlashSelfAttention
# with cu_seqlens / max_seqlen) and internlm/model/embedding.py (RotaryEmbedding._forward / _eval_forward).
# flash_attn_varlen_qkvpacked_func is written in plain torch (one causal softmax per cu_seqlens segment); the
# non-flash SelfAttention of flash_attn.modules.mha (triu -10000 bias) serves the unpacked reference run.
# Checks: every packed segment's logits and the packed loss equal a run of that segment alone.
import math
from copy import deepcopy
from types import SimpleNamespace
import itertools as it
import operator

import numpy as np
import torch
from torch import nn

torch.manual_seed(0)
DEFAULT_SEED = 1024

gpc = SimpleNamespace(config=SimpleNamespace(
    model=SimpleNamespace(use_flash_attn=True, dtype=torch.float32, num_layers=2, hidden_size=32,
                          num_attention_heads=4, vocab_size=97, mlp_ratio=2),
    data=SimpleNamespace(seq_len=16, micro_bsz=1, max_length_per_sample=8),
))


class JsonlDataset(torch.utils.data.Dataset):
    def __init__(self, docs):
        self.docs = docs
        self.lengths = np.array([len(d) for d in docs])

    def __len__(self):
        return len(self.docs)

    def __getitem__(self, idx):
        return {"tokens": self.docs[idx], "type_id": 0}


class PackedDataset(torch.utils.data.Dataset):
    def __init__(self, dataset, max_length_per_sample: int = 2048, packed_length: int = 4096):
        assert hasattr(dataset, "lengths")
        self.dataset = dataset
        self.max_length_per_sample = max_length_per_sample
        self.lengths = getattr(self.dataset, "lengths")
        self.packed_length = packed_length
        self.seed = DEFAULT_SEED
        self.sample_indices, self.len_samples_shuffled, self.acm_len_samples = self.accu_sample_len(seed=self.seed)
        self.num_tokens = sum(self.lengths)

    def accu_sample_len(self, seed=None):
        rng = np.random.RandomState(seed)
        sample_indices = np.arange(len(self.lengths))
        rng.shuffle(sample_indices)
        len_samples_shuffled = list(map(self.lengths.__getitem__, sample_indices))
        acm_len_samples = list(it.accumulate(len_samples_shuffled, operator.add))
        return sample_indices, len_samples_shuffled, acm_len_samples

    def __len__(self):
        return self.num_tokens // self.packed_length

    def cal_map(self, carriage_idx: int = 0):
        length_train = (carriage_idx + 1) * self.packed_length
        post_pos = np.searchsorted(self.acm_len_samples, length_train, side="left")
        return post_pos

    def mapping(self, pack_idx: int = 0):
        pre_pos, pre_token_id = 0, 0
        if pack_idx > 0:
            pre_pos = self.cal_map(pack_idx - 1)
            pre_token_id = self.len_samples_shuffled[pre_pos] - (
                self.acm_len_samples[pre_pos] - (pack_idx) * self.packed_length
            )
            if pre_token_id == self.len_samples_shuffled[pre_pos]:
                pre_pos += 1
                pre_token_id = 0
        pos = self.cal_map(pack_idx)
        token_id = self.len_samples_shuffled[pos] - (self.acm_len_samples[pos] - (pack_idx + 1) * self.packed_length)
        return pre_pos, pre_token_id, pos, token_id

    def build_pack(self, pre_pos: int, pre_token_id: int, pos: int, token_id: int):
        pack, cu_seqlens, indexes, labels, type_ids = [], [0], [], [], []

        while pre_pos < pos:
            sample_idx = self.sample_indices[pre_pos]
            sample = self.dataset[sample_idx]
            chunk = sample["tokens"][pre_token_id:]
            pack.extend(chunk)
            _labels = deepcopy(chunk)
            _labels = list(_labels[1:]) + [-100]
            labels.extend(_labels)
            type_ids.extend([sample.get("type_id", 0)] * len(chunk))
            num_new_samples, tokens_left = divmod(len(chunk), self.max_length_per_sample)
            for _ in range(num_new_samples):
                cu_seqlens.append(cu_seqlens[-1] + self.max_length_per_sample)
                indexes.extend(list(range(self.max_length_per_sample)))
            if tokens_left > 0:
                cu_seqlens.append(cu_seqlens[-1] + tokens_left)
                indexes.extend(list(range(tokens_left)))
            pre_pos = pre_pos + 1
            pre_token_id = 0

        sample_idx = self.sample_indices[pos]
        sample = self.dataset[sample_idx]
        chunk = sample["tokens"][pre_token_id:token_id]  # fragement of a sample
        pack.extend(chunk)
        _labels = deepcopy(chunk)
        if token_id == len(sample["tokens"]):
            _labels = list(_labels[1:]) + [-100]
        else:
            _labels = list(_labels[1:]) + [sample["tokens"][token_id]]
        labels.extend(_labels)
        type_ids.extend([sample.get("type_id", 0)] * len(chunk))
        num_new_samples, tokens_left = divmod(len(chunk), self.max_length_per_sample)
        for _ in range(num_new_samples):
            cu_seqlens.append(cu_seqlens[-1] + self.max_length_per_sample)
            indexes.extend(list(range(self.max_length_per_sample)))
        if tokens_left > 0:
            cu_seqlens.append(cu_seqlens[-1] + tokens_left)
            indexes.extend(list(range(tokens_left)))

        out = {"tokens": pack, "cu_seqlens": cu_seqlens, "indexes": indexes, "labels": labels, "type_ids": type_ids}
        return out

    def __getitem__(self, item: int):
        assert gpc.config.model.use_flash_attn
        pos_before, token_id_before, pos_after, token_id_after = self.mapping(item)
        return self.build_pack(pos_before, token_id_before, pos_after, token_id_after)


def packed_collate_fn(batch, packed_length):
    xs, ys, cu_seqlens, indexes, ts = [], [], [], [], []
    for b in batch:
        assert len(b["tokens"]) == packed_length
        assert len(b["labels"]) == packed_length
        tokens = [abs(w) for w in b["tokens"]]
        labels = [w if w > 0 else -100 for w in b["labels"]]
        xs.append(torch.LongTensor(tokens))
        ys.append(torch.LongTensor(labels))
        ts.append(torch.LongTensor(b["type_ids"]))
        cu_seqlens.append(torch.IntTensor(b["cu_seqlens"]))
        indexes.append(torch.LongTensor(b["indexes"]))
    xs = torch.nn.utils.rnn.pad_sequence(xs, batch_first=True)
    ys = torch.nn.utils.rnn.pad_sequence(ys, batch_first=True, padding_value=-100)
    ts = torch.nn.utils.rnn.pad_sequence(ts, batch_first=True, padding_value=0)
    indexes = torch.stack(indexes, dim=0)
    if len(set(map(len, cu_seqlens))) == 1:
        cu_seqlens = torch.stack(cu_seqlens, dim=0)
    assert xs.shape[1] == packed_length, (xs.shape[1], packed_length)
    return {"input_ids": xs, "cu_seqlens": cu_seqlens, "indexes": indexes, "type_ids": ts}, ys


# ---- flash_attn stand-ins (plain torch) -------------------------------------------------------------------------

def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False):
    """qkv: (total, 3, nheads, headdim); one attention per [cu_seqlens[i], cu_seqlens[i+1])."""
    out = torch.empty_like(qkv[:, 0])
    scale = softmax_scale or 1.0 / math.sqrt(qkv.shape[-1])
    for i in range(cu_seqlens.numel() - 1):
        s, e = int(cu_seqlens[i]), int(cu_seqlens[i + 1])
        assert e - s <= max_seqlen
        q, k, v = qkv[s:e].unbind(dim=1)  # (L, h, d)
        scores = torch.einsum("thd,shd->hts", q, k) * scale
        if causal:
            keep = torch.ones(e - s, e - s, dtype=torch.bool).tril()
            scores = scores.masked_fill(~keep, float("-inf"))
        out[s:e] = torch.einsum("hts,shd->thd", scores.softmax(-1), v)
    return out


class FlashSelfAttention(nn.Module):
    def __init__(self, causal=False, softmax_scale=None, attention_dropout=0.0):
        super().__init__()
        self.causal = causal
        self.softmax_scale = softmax_scale

    def forward(self, qkv, causal=None, cu_seqlens=None, max_seqlen=None):
        causal = self.causal if causal is None else causal
        assert cu_seqlens is not None and cu_seqlens.dtype == torch.int32
        return flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, 0.0, self.softmax_scale, causal)


class SelfAttention(nn.Module):
    """flash_attn.modules.mha.SelfAttention (the non-flash path)."""

    def __init__(self, causal=False, softmax_scale=None, attention_dropout=0.0):
        super().__init__()
        self.causal = causal
        self.softmax_scale = softmax_scale

    def forward(self, qkv, causal=None, key_padding_mask=None):
        batch_size, seqlen = qkv.shape[0], qkv.shape[1]
        causal = self.causal if causal is None else causal
        q, k, v = qkv.unbind(dim=2)
        softmax_scale = self.softmax_scale or 1.0 / math.sqrt(q.shape[-1])
        scores = torch.einsum("bthd,bshd->bhts", q, k * softmax_scale)
        if causal:
            causal_mask = torch.triu(torch.full((seqlen, seqlen), -10000.0, device=scores.device), 1)
            scores = scores + causal_mask.to(dtype=scores.dtype)
        attention = torch.softmax(scores, dim=-1, dtype=v.dtype)
        return torch.einsum("bhts,bshd->bthd", attention, v)


def _rotate(x1, x2, cos, sin):
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def apply_rotary_emb_qkv_(qkv, cos, sin):
    """qkv: (total, 3, nheads, headdim); cos, sin: (total, rotary_dim / 2) gathered at indexes."""
    rotary_dim = cos.shape[-1] * 2
    c, s = cos[:, None, :], sin[:, None, :]
    qkv = qkv.clone()
    for j in (0, 1):
        x1, x2 = qkv[:, j, :, :rotary_dim].chunk(2, dim=-1)
        qkv[:, j, :, :rotary_dim] = _rotate(x1, x2, c, s)
    return qkv


def legacy_apply_rotary_embed_qkv(qkv, cos, sin):
    """qkv: (batch, seqlen, 3, nheads, headdim); cos, sin: (>= seqlen, rotary_dim / 2)."""
    seqlen = qkv.shape[1]
    rotary_dim = cos.shape[-1] * 2
    c, s = cos[:seqlen][:, None, :], sin[:seqlen][:, None, :]
    qkv = qkv.clone()
    for j in (0, 1):
        x1, x2 = qkv[:, :, j, :, :rotary_dim].chunk(2, dim=-1)
        qkv[:, :, j, :, :rotary_dim] = _rotate(x1, x2, c, s)
    return qkv


class RotaryEmbedding(nn.Module):
    def __init__(self, dim: int, base=10000):
        super().__init__()
        self.inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        self._seq_len_cached = 0
        self._cos_cached = None
        self._sin_cached = None

    def _update_cos_sin_cache(self, x, indexes):
        if not isinstance(indexes, int):
            seqlen = indexes.max().item() + 1
        else:
            seqlen = indexes + 1
        if seqlen > self._seq_len_cached:
            self._seq_len_cached = seqlen
            t = torch.arange(seqlen, dtype=self.inv_freq.dtype)
            freqs = torch.outer(t, self.inv_freq)
            self._cos_cached = torch.cos(freqs).to(x.dtype)
            self._sin_cached = torch.sin(freqs).to(x.dtype)

    def forward(self, qkv, **kwargs):
        if kwargs.get("indexes", None) is not None:
            return self._forward(qkv, kwargs.pop("indexes"))
        return self._eval_forward(qkv)

    def _forward(self, qkv, indexes=0):
        self._update_cos_sin_cache(qkv, indexes)
        return apply_rotary_emb_qkv_(qkv, self._cos_cached[indexes], self._sin_cached[indexes])

    def _eval_forward(self, qkv, seqlen_offset=0):
        self._update_cos_sin_cache(qkv, seqlen_offset + qkv.shape[1])
        return legacy_apply_rotary_embed_qkv(qkv, self._cos_cached[seqlen_offset:], self._sin_cached[seqlen_offset:])


class MHA(nn.Module):
    def __init__(self, embed_dim, num_heads, causal=True, use_flash_attn=True):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.rotary_emb = RotaryEmbedding(self.head_dim)
        self.Wqkv = nn.Linear(embed_dim, 3 * embed_dim, bias=True)
        inner_attn_cls = FlashSelfAttention if use_flash_attn else SelfAttention
        self.inner_attn = inner_attn_cls(causal=causal)
        self.ref_attn = SelfAttention(causal=causal)
        self.out_proj = nn.Linear(embed_dim, embed_dim)

    def forward(self, x, seqlen=None, inference_params=None, **kwargs):
        if kwargs.get("indexes", None) is not None:
            return self._packed_forward(x=x, inference_params=inference_params, **kwargs)
        return self._forward(x=x, seqlen=seqlen, inference_params=inference_params, **kwargs)

    def _forward(self, x, seqlen=None, inference_params=None, **kwargs):
        qkv = self.Wqkv(x)
        b, s, _ = qkv.shape
        qkv = qkv.view(b, s, 3, self.num_heads, self.head_dim)
        qkv = self.rotary_emb(qkv)
        context = self.ref_attn(qkv)
        return self.out_proj(context.reshape(b, s, -1))

    def _packed_forward(self, x, inference_params=None, **kwargs):
        qkv = self.Wqkv(x)  # total x hsz'
        qkv = qkv.view(qkv.shape[0], 3, self.num_heads, self.head_dim)  # total x 3 x n_head x d
        qkv = self.rotary_emb(qkv, **kwargs)
        kwargs.pop("indexes")
        assert inference_params is None
        context = self.inner_attn(qkv, cu_seqlens=kwargs["cu_seqlens"], max_seqlen=kwargs["max_seqlen"])
        context = context.reshape(context.shape[0], -1)
        return self.out_proj(context)


class RMSNorm(nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class PackedFlashBaseLayer1D(nn.Module):
    def __init__(self, hidden_size, num_attention_heads, mlp_ratio):
        super().__init__()
        self.mixer = MHA(hidden_size, num_attention_heads, causal=True, use_flash_attn=gpc.config.model.use_flash_attn)
        self.norm1 = RMSNorm(hidden_size)
        self.norm2 = RMSNorm(hidden_size)
        h = int(hidden_size * mlp_ratio)
        self.w1 = nn.Linear(hidden_size, h, bias=False)
        self.w3 = nn.Linear(hidden_size, h, bias=False)
        self.w2 = nn.Linear(h, hidden_size, bias=False)

    def forward(self, hidden_states, cu_seqlens=None, indexes=None, inference_params=None, max_seqlen=None):
        mixer_kwargs = {
            "cu_seqlens": cu_seqlens,
            "max_seqlen": max_seqlen,
            "indexes": indexes,
            "inference_params": inference_params,
        }
        residual = hidden_states
        hidden_states = self.norm1(residual.float())
        hidden_states = self.mixer(hidden_states, **mixer_kwargs)
        residual = hidden_states + residual
        hidden_states = self.norm2(residual.float())
        hidden_states = self.w2(nn.functional.silu(self.w1(hidden_states)) * self.w3(hidden_states))
        return hidden_states + residual


class PackedFlashInternLm1D(nn.Module):
    def __init__(self, num_layers, hidden_size, num_attention_heads, vocab_size, mlp_ratio):
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, hidden_size)
        self.blocks = nn.ModuleList(
            [PackedFlashBaseLayer1D(hidden_size, num_attention_heads, mlp_ratio) for _ in range(num_layers)]
        )
        self.norm = RMSNorm(hidden_size)
        self.head = nn.Linear(hidden_size, vocab_size, bias=False)

    def forward(self, hidden_states=None, cu_seqlens=None, input_ids=None, indexes=None, inference_params=None):
        hidden_states = self.embedding(input_ids)
        if isinstance(cu_seqlens, list):
            assert len(cu_seqlens) == 1
            cu_seqlens = cu_seqlens[0].to(hidden_states.device)
        if cu_seqlens is not None:
            cu_seqlens = cu_seqlens.squeeze(0)
            hidden_states = hidden_states.squeeze(0)
        if indexes is not None:
            assert len(indexes) == 1
            indexes = indexes[0]
        max_seqlen = (cu_seqlens[1:] - cu_seqlens[:-1]).max().item() if cu_seqlens is not None else None
        for _, block in enumerate(self.blocks):
            hidden_states = block(
                hidden_states,
                cu_seqlens=cu_seqlens,
                indexes=indexes,
                inference_params=inference_params,
                max_seqlen=max_seqlen,
            )
        hidden_states = self.norm(hidden_states.float())
        return self.head(hidden_states)


def main():
    cfg = gpc.config
    vocab = cfg.model.vocab_size
    rng = np.random.RandomState(3)
    # document lengths: one longer than max_length_per_sample (split into chunks), several short ones
    doc_lens = [5, 14, 3, 7, 9, 4, 6]
    docs = [list(rng.randint(1, vocab, size=n)) for n in doc_lens]
    packed_length = cfg.data.seq_len * cfg.data.micro_bsz
    ds = PackedDataset(JsonlDataset(docs), cfg.data.max_length_per_sample, packed_length)

    model = PackedFlashInternLm1D(cfg.model.num_layers, cfg.model.hidden_size, cfg.model.num_attention_heads,
                                  vocab, cfg.model.mlp_ratio).eval()
    loss_fn = nn.CrossEntropyLoss(reduction="mean", ignore_index=-100)

    n_segments = 0
    with torch.no_grad():
        for pack_idx in range(len(ds)):
            data, label = packed_collate_fn([ds[pack_idx]], packed_length)
            logits = model(input_ids=data["input_ids"], cu_seqlens=data["cu_seqlens"], indexes=data["indexes"])
            loss = loss_fn(logits.view(-1, vocab), label.view(-1))

            cu = data["cu_seqlens"][0].tolist()
            assert cu[-1] == packed_length
            ref_logits = torch.empty_like(logits)
            for s, e in zip(cu[:-1], cu[1:]):
                assert data["indexes"][0, s:e].tolist() == list(range(e - s))
                ref_logits[s:e] = model(input_ids=data["input_ids"][:, s:e])[0]
                n_segments += 1
            ref_loss = loss_fn(ref_logits.view(-1, vocab), label.view(-1))
            err = (logits - ref_logits).abs().max().item()
            print(f"pack {pack_idx}: cu_seqlens={cu} max|diff|={err:.2e} loss={loss.item():.5f} ref={ref_loss.item():.5f}")
            assert err < 1e-4, err
            assert abs(loss.item() - ref_loss.item()) < 1e-5
    assert n_segments > len(ds)
    print("ok")


if __name__ == "__main__":
    main()
