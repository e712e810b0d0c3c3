"""MaskGIT: bidirectional transformer over image tokens, run T times with a cosine masking schedule.

Follows dome272/MaskGIT-pytorch transformer.py (VQGANTransformer.sample_good, mask_by_random_topk, gamma_func
"cosine", sos token prepended, _CONFIDENCE_OF_KNOWN_TOKENS) for the decoding loop; the network is the BERT-style
post-LayerNorm encoder of google-research/maskgit maskgit/nets/maskgit_transformer.py, written with
nn.TransformerEncoderLayer (dome272's own Attention takes its softmax over dim=1, which is not what MaskGIT means).
Mask: none, on purpose. MaskGIT predicts every [MASK] token from ALL other tokens of the 4x4 grid (left, right,
above, below) and from the class/sos token; nothing is causal and nothing is padded (every image has exactly
num_image_tokens tokens). The same unmasked attention runs at each of the T steps; what changes between steps is
which inputs are the [MASK] id, not the attention pattern.
"""
import math
from types import SimpleNamespace

import numpy as np
import torch
from torch import nn
import torch.nn.functional as F

_CONFIDENCE_OF_KNOWN_TOKENS = torch.Tensor([torch.inf])


class BidirectionalTransformer(nn.Module):
    def __init__(self, args):
        super().__init__()
        vocab = args.num_codebook_vectors + 2  # codebook + [MASK] + sos
        self.tok_emb = nn.Embedding(vocab, args.dim)
        self.pos_emb = nn.Parameter(0.02 * torch.randn(1, args.num_image_tokens + 1, args.dim))
        self.ln = nn.LayerNorm(args.dim)
        layer = nn.TransformerEncoderLayer(args.dim, args.n_heads, args.hidden_dim, dropout=0.1,
                                           activation="gelu", batch_first=True, norm_first=False)
        self.EncoderLayers = nn.TransformerEncoder(layer, args.n_layers, enable_nested_tensor=False)
        self.Token_Prediction = nn.Linear(args.dim, args.num_codebook_vectors)

    def forward(self, x):
        embed = self.ln(self.tok_emb(x) + self.pos_emb[:, :x.shape[1]])
        # No src_mask and no src_key_padding_mask: every token sees every token.
        embed = self.EncoderLayers(embed)
        return self.Token_Prediction(embed)


class VQGANTransformer(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.num_image_tokens = args.num_image_tokens
        self.sos_token = args.num_codebook_vectors + 1
        self.mask_token_id = args.num_codebook_vectors
        self.choice_temperature = 4.5
        self.gamma = self.gamma_func("cosine")
        self.transformer = BidirectionalTransformer(args)

    def gamma_func(self, mode="cosine"):
        if mode == "linear":
            return lambda r: 1 - r
        elif mode == "cosine":
            return lambda r: np.cos(r * np.pi / 2)
        raise NotImplementedError(mode)

    def create_input_tokens_normal(self, num):
        return (self.mask_token_id * torch.ones((num, self.num_image_tokens))).to(torch.int64)

    def tokens_to_logits(self, seq):
        return self.transformer(seq)

    def mask_by_random_topk(self, mask_len, probs, temperature=1.0, generator=None):
        gumbel = -torch.log(-torch.log(torch.rand(probs.shape, generator=generator).clamp_min(1e-20)))
        confidence = torch.log(probs) + temperature * gumbel
        sorted_confidence, _ = torch.sort(confidence, dim=-1)
        # Obtains cut off threshold given the mask lengths.
        cut_off = torch.take_along_dim(sorted_confidence, mask_len.to(torch.long), dim=-1)
        # Masks tokens with lower confidence.
        return confidence < cut_off

    @torch.no_grad()
    def sample_good(self, num=1, T=6, generator=None):
        inputs = self.create_input_tokens_normal(num)
        sos_tokens = torch.ones(inputs.shape[0], 1, dtype=torch.long) * self.sos_token
        inputs = torch.cat((sos_tokens, inputs), dim=1)
        unknown_number_in_the_beginning = torch.sum(inputs == self.mask_token_id, dim=-1)
        cur_ids = inputs
        history = []
        for t in range(T):
            logits = self.tokens_to_logits(cur_ids)
            sampled_ids = torch.distributions.Categorical(logits=logits).sample()
            unknown_map = cur_ids == self.mask_token_id
            sampled_ids = torch.where(unknown_map, sampled_ids, cur_ids)
            ratio = 1.0 * (t + 1) / T
            mask_ratio = self.gamma(ratio)
            probs = F.softmax(logits, dim=-1)
            selected_probs = torch.take_along_dim(probs, sampled_ids.clamp_max(probs.shape[-1] - 1)[..., None], -1)[..., 0]
            selected_probs = torch.where(unknown_map, selected_probs, _CONFIDENCE_OF_KNOWN_TOKENS)
            mask_len = torch.unsqueeze(torch.floor(unknown_number_in_the_beginning * mask_ratio), 1)
            mask_len = torch.maximum(torch.zeros_like(mask_len),
                                     torch.minimum(torch.sum(unknown_map, dim=-1, keepdim=True) - 1, mask_len))
            masking = self.mask_by_random_topk(mask_len, selected_probs,
                                               temperature=self.choice_temperature * (1.0 - ratio),
                                               generator=generator)
            new_ids = torch.where(masking, self.mask_token_id, sampled_ids)
            # A token decoded at an earlier step is never masked again.
            assert torch.equal(new_ids[~unknown_map], cur_ids[~unknown_map])
            cur_ids = new_ids
            history.append(int((cur_ids == self.mask_token_id).sum()))
        return cur_ids[:, 1:], history


def _reference_layer(layer, x):
    """Post-LN encoder layer written out with SDPA and no mask."""
    attn = layer.self_attn
    d = x.shape[-1]
    h = attn.num_heads
    q, k, v = F.linear(x, attn.in_proj_weight, attn.in_proj_bias).split(d, dim=-1)
    def split(t):
        return t.unflatten(-1, (h, d // h)).transpose(1, 2)
    a = F.scaled_dot_product_attention(split(q), split(k), split(v))
    a = attn.out_proj(a.transpose(1, 2).flatten(2))
    x = layer.norm1(x + a)
    return layer.norm2(x + layer.linear2(F.gelu(layer.linear1(x))))


def main():
    torch.manual_seed(0)
    args = SimpleNamespace(num_image_tokens=16, num_codebook_vectors=32, dim=32, n_heads=4,
                           hidden_dim=64, n_layers=2)
    model = VQGANTransformer(args).eval()
    ids, history = model.sample_good(num=2, T=6)
    assert not (ids == model.mask_token_id).any()
    assert history == sorted(history, reverse=True) and history[-1] == 0

    seq = torch.cat((torch.full((2, 1), model.sos_token), torch.randint(0, 33, (2, 16))), dim=1)
    with torch.no_grad():
        x = model.transformer.ln(model.transformer.tok_emb(seq) + model.transformer.pos_emb[:, :17])
        ref = x
        for layer in model.transformer.EncoderLayers.layers:
            ref = _reference_layer(layer, ref)
        got = model.transformer.EncoderLayers(x)
    assert torch.allclose(got, ref, atol=1e-5)
    print("maskgit masked tokens per step:", history)


if __name__ == "__main__":
    main()
