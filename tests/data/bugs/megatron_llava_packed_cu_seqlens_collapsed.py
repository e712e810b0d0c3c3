"""Megatron-LM LLaVA with sequence packing: cu_seqlens left in collapsed (pre-image-expansion) space.

Citation: NVIDIA/Megatron-LM#3427 "Fix LLaVA packed sequence cu_seqlens after image token
expansion" (2026-02; the PR is closed on GitHub, as Megatron-LM PRs are when they land through the
internal mirror; I could not confirm from GitHub alone that it was merged).

When sequence packing is used with ``LLaVAModel``, ``PackedSeqParams.cu_seqlens_q/kv`` arrive in
collapsed space (one token per image placeholder), but ``_preprocess_data`` expands each image
placeholder into ``img_seq_len`` image embeddings. The cu_seqlens were never updated, so the
THD varlen attention of the language model saw wrong sub-sequence boundaries: the tail of one
packed sample was attended as part of the next sample, and the last tokens fell outside every
sub-sequence. The fix adds ``_remap_packed_seq_params_after_image_expansion`` which maps each
boundary through the same cumulative-sum position mapping as ``_preprocess_data``, called in
``forward`` right after ``_preprocess_data``.

This program: a LLaVA-shaped model (vision projection, ``_preprocess_data`` expansion, a GPT
language model whose core attention is a THD varlen call rendered on CPU as one causal
``F.scaled_dot_product_attention`` per cu_seqlens segment), and one packed row of two samples,
each holding one image (img_seq_len 3).
"""
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv

IMAGE_TOKEN = -200


@dataclass
class PackedSeqParams:
    qkv_format: str = "thd"
    cu_seqlens_q: torch.Tensor = None
    cu_seqlens_kv: torch.Tensor = None
    max_seqlen_q: int = None
    max_seqlen_kv: int = None


def thd_varlen_causal_attention(q, k, v, packed_seq_params: PackedSeqParams):
    # q, k, v: [t, h, d]. Each [cu[i], cu[i+1]) is attended on its own; tokens outside every
    # sub-sequence are not written (left zero), as the varlen kernels do.
    out = torch.zeros_like(q)
    cu_q = packed_seq_params.cu_seqlens_q.tolist()
    for start, end in zip(cu_q[:-1], cu_q[1:]):
        if end > start:
            o = F.scaled_dot_product_attention(
                q[start:end].transpose(0, 1), k[start:end].transpose(0, 1), v[start:end].transpose(0, 1), is_causal=True
            )
            out[start:end] = o.transpose(0, 1)
    return out


class SelfAttention(nn.Module):
    def __init__(self, hidden, heads):
        super().__init__()
        self.heads = heads
        self.linear_qkv = nn.Linear(hidden, 3 * hidden)
        self.linear_proj = nn.Linear(hidden, hidden)

    def forward(self, hidden_states, packed_seq_params):
        t, _, hdim = hidden_states.shape  # [s, b=1, h] in THD mode b is 1
        q, k, v = self.linear_qkv(hidden_states[:, 0]).view(t, 3, self.heads, hdim // self.heads).unbind(1)
        core = thd_varlen_causal_attention(q, k, v, packed_seq_params)
        return self.linear_proj(core.reshape(t, hdim))[:, None]


class TransformerLayer(nn.Module):
    def __init__(self, hidden, heads):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(hidden)
        self.self_attention = SelfAttention(hidden, heads)
        self.pre_mlp_layernorm = nn.LayerNorm(hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))

    def forward(self, x, packed_seq_params):
        x = x + self.self_attention(self.input_layernorm(x), packed_seq_params)
        return x + self.mlp(self.pre_mlp_layernorm(x))


class GPTModel(nn.Module):
    def __init__(self, vocab, hidden, heads, layers):
        super().__init__()
        self.embedding = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList([TransformerLayer(hidden, heads) for _ in range(layers)])
        self.output_layer = nn.Linear(hidden, vocab, bias=False)

    def forward(self, decoder_input, packed_seq_params):
        x = decoder_input
        for layer in self.layers:
            x = layer(x, packed_seq_params)
        return self.output_layer(x)


class LLaVAModel(nn.Module):
    def __init__(self, vocab=64, hidden=32, heads=4, layers=2, vision_dim=16, img_seq_len=3):
        super().__init__()
        self.img_seq_len = img_seq_len
        self.image_token_index = IMAGE_TOKEN
        self.vision_projection = nn.Linear(vision_dim, hidden)
        self.language_model = GPTModel(vocab, hidden, heads, layers)

    def _preprocess_data(self, image_embeddings, language_embeddings, input_ids):
        # input_ids: [1, s] collapsed; language_embeddings: [s, 1, h]; image_embeddings: [n_img, img_seq_len, h]
        out, img = [], 0
        for pos, tok in enumerate(input_ids[0].tolist()):
            if tok == self.image_token_index:
                out.append(image_embeddings[img])
                img += 1
            else:
                out.append(language_embeddings[pos])
        return torch.cat(out, dim=0)[:, None]  # [s_expanded, 1, h]

    def _remap_packed_seq_params_after_image_expansion(self, packed_seq_params, input_ids):
        widths = torch.where(input_ids[0] == self.image_token_index, self.img_seq_len, 1)
        expanded_start = torch.cat([torch.zeros(1, dtype=widths.dtype), torch.cumsum(widths, 0)])
        cu_q = expanded_start[packed_seq_params.cu_seqlens_q.long()].to(torch.int32)
        cu_kv = expanded_start[packed_seq_params.cu_seqlens_kv.long()].to(torch.int32)
        max_len = int((cu_q[1:] - cu_q[:-1]).max())
        return PackedSeqParams("thd", cu_q, cu_kv, max_len, max_len)

    def forward(self, images, input_ids, packed_seq_params):
        image_embeddings = self.vision_projection(images)
        text_ids = input_ids.clamp(min=0)
        language_embeddings = self.language_model.embedding(text_ids).transpose(0, 1)  # [s, 1, h]
        combined = self._preprocess_data(image_embeddings, language_embeddings, input_ids)
        if FIXED:
            packed_seq_params = self._remap_packed_seq_params_after_image_expansion(packed_seq_params, input_ids)
        return self.language_model(combined, packed_seq_params)


def main():
    torch.manual_seed(0)
    model = LLaVAModel().eval()
    sample_a = [5, IMAGE_TOKEN, 11, 12]
    sample_b = [7, 8, IMAGE_TOKEN, 21, 22]
    input_ids = torch.tensor([sample_a + sample_b])
    cu_seqlens = torch.tensor([0, len(sample_a), len(sample_a) + len(sample_b)], dtype=torch.int32)
    packed_seq_params = PackedSeqParams("thd", cu_seqlens, cu_seqlens, 5, 5)
    images = torch.randn(2, 3, 16)  # one image per sample, img_seq_len 3
    with torch.no_grad():
        logits = model(images, input_ids, packed_seq_params)
    print("expanded tokens:", logits.shape[0], "last-token logit[0]:", round(float(logits[-1, 0, 0]), 4))


if __name__ == "__main__":
    main()
