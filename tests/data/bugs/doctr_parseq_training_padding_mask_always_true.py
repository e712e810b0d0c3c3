"""docTR PARSeq (PyTorch) training: the target padding mask is a tautology, so EOS/padding is never masked.

Citation: mindee/doctr#1227 ("[Fix] PARSeq pytorch fixes", commit b4b613aa5), reviewed with the
PARSeq author in baudm/parseq#100. Read in the upstream git history
(doctr/models/recognition/parseq/pytorch.py and doctr/models/modules/transformer/pytorch.py at
the parent commit and at the fix).

Bug: ``PARSeq.forward`` (training branch) built the target padding mask as
``((gt != self.vocab_size + 2) | (gt != self.vocab_size)).unsqueeze(1).unsqueeze(1)`` -- "not PAD
or not EOS", which is True for every token. Combined with each permutation's
``target_mask`` (``mask = target_mask & padding_mask``), the decoder's content self-attention
let queries see the EOS and PAD positions of shorter words; under the reverse / random
permutations those keys are "earlier" in the order and so were visible.
Fix: ``padding_mask = ~(((gt_in == self.vocab_size + 2) | (gt_in == self.vocab_size)).int()
.cumsum(-1) > 0).unsqueeze(1).unsqueeze(1)`` -- EOS and everything after it are masked.

Reproduction: the PARSeq decoder (``decode`` with ``pos_queries``, ``PARSeqDecoder`` with docTR's
``MultiHeadAttention`` -> ``scaled_dot_product_attention``: masked_fill(mask == 0, -inf) + softmax),
random weights and random "memory" features instead of the ViT backbone. A batch of a 2-char and
a 5-char word runs the canonical and the reverse permutation of ``generate_permutations``.
The fix's other changes (loss over permutations, slicing ``gt`` to the batch's longest word, the
``gt_in``/``gt_out`` split) are applied in both modes; only the padding mask differs.
"""
import math
import sys
from typing import Optional, Tuple

import torch
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def scaled_dot_product_attention(query, key, value, mask=None):
    """Scaled Dot-Product Attention"""
    scores = torch.matmul(query, key.transpose(-2, -1)) / math.sqrt(query.size(-1))
    if mask is not None:
        # NOTE: to ensure the ONNX compatibility, masked_fill works only with int equal condition
        scores = scores.masked_fill(mask == 0, float("-inf"))
    p_attn = torch.softmax(scores, dim=-1)
    return torch.matmul(p_attn, value), p_attn


class MultiHeadAttention(nn.Module):
    """Multi-Head Attention"""

    def __init__(self, num_heads: int, d_model: int, dropout: float = 0.1) -> None:
        super().__init__()
        self.d_k = d_model // num_heads
        self.num_heads = num_heads
        self.linear_layers = nn.ModuleList([nn.Linear(d_model, d_model) for _ in range(3)])
        self.output_linear = nn.Linear(d_model, d_model)

    def forward(self, query, key, value, mask=None):
        batch_size = query.size(0)
        query, key, value = [
            linear(x).view(batch_size, -1, self.num_heads, self.d_k).transpose(1, 2)
            for linear, x in zip(self.linear_layers, (query, key, value))
        ]
        x, attn = scaled_dot_product_attention(query, key, value, mask=mask)
        x = x.transpose(1, 2).contiguous().view(batch_size, -1, self.num_heads * self.d_k)
        return self.output_linear(x)


class PARSeqDecoder(nn.Module):
    def __init__(self, d_model: int, num_heads: int = 4):
        super().__init__()
        self.attention = MultiHeadAttention(num_heads, d_model)
        self.cross_attention = MultiHeadAttention(num_heads, d_model)
        self.query_norm = nn.LayerNorm(d_model, eps=1e-5)
        self.content_norm = nn.LayerNorm(d_model, eps=1e-5)
        self.output_norm = nn.LayerNorm(d_model, eps=1e-5)

    def forward(self, target, content, memory, target_mask: Optional[torch.Tensor] = None):
        query_norm = self.query_norm(target)
        content_norm = self.content_norm(content)
        target = target.clone() + self.attention(query_norm, content_norm, content_norm, mask=target_mask)
        target = target.clone() + self.cross_attention(self.query_norm(target), memory, memory)
        return self.output_norm(target)


class PARSeq(nn.Module):
    def __init__(self, vocab_size=10, embedding_units=32, max_length=8):
        super().__init__()
        self.vocab_size = vocab_size
        self.max_length = max_length
        self.embed = nn.Embedding(vocab_size + 3, embedding_units)  # EOS, SOS, PAD
        self.pos_queries = nn.Parameter(torch.randn(1, max_length + 1, embedding_units))
        self.decoder = PARSeqDecoder(embedding_units)
        self.head = nn.Linear(embedding_units, vocab_size + 1)

    def generate_permutations(self, seqlen: torch.Tensor) -> torch.Tensor:
        # canonical and reverse orderings (the random ones are left out)
        max_num_chars = int(seqlen.max().item())
        perm = torch.arange(max_num_chars, device=seqlen.device)
        final_perms = torch.stack([perm, perm.flip(-1)])
        sos_idx = torch.zeros(len(final_perms), 1, device=seqlen.device)
        eos_idx = torch.full((len(final_perms), 1), max_num_chars + 1, device=seqlen.device)
        combined = torch.cat([sos_idx, final_perms + 1, eos_idx], dim=1).int()
        if len(combined) > 1:
            combined[1, 1:] = max_num_chars + 1 - torch.arange(max_num_chars + 1, device=seqlen.device)
        return combined

    def generate_permutations_attention_masks(self, permutation: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        # Generate source and target mask for the decoder attention.
        sz = permutation.shape[0]
        mask = torch.ones((sz, sz), device=permutation.device)
        for i in range(sz):
            query_idx = permutation[i]
            masked_keys = permutation[i + 1 :]
            mask[query_idx, masked_keys] = 0.0
        source_mask = mask[:-1, :-1].clone()
        mask[torch.eye(sz, dtype=torch.bool, device=permutation.device)] = 0.0
        target_mask = mask[1:, :-1]
        return source_mask.int(), target_mask.int()

    def decode(self, target, memory, target_mask=None, target_query=None):
        batch_size, sequence_length = target.shape
        # apply positional information to the target sequence excluding the SOS token
        null_ctx = self.embed(target[:, :1])
        content = self.pos_queries[:, : sequence_length - 1] + self.embed(target[:, 1:])
        content = torch.cat([null_ctx, content], dim=1)
        if target_query is None:
            target_query = self.pos_queries[:, :sequence_length].expand(batch_size, -1, -1)
        return self.decoder(target_query, content, memory, target_mask)

    def training_logits(self, features, gt, seq_len):
        gt = gt[:, : int(seq_len.max().item()) + 2]  # slice up to the max length of the batch + 2 (SOS + EOS)
        tgt_perms = self.generate_permutations(seq_len)
        gt_in = gt[:, :-1]  # remove EOS token from longest target sequence
        if FIXED:
            padding_mask = (
                ~(((gt_in == self.vocab_size + 2) | (gt_in == self.vocab_size)).int().cumsum(-1) > 0)
                .unsqueeze(1)
                .unsqueeze(1)
            )  # (N, 1, 1, seq_len)
        else:
            # [True, True, True, ..., False, False, False] -> False is masked
            padding_mask = ((gt_in != self.vocab_size + 2) | (gt_in != self.vocab_size)).unsqueeze(1).unsqueeze(1)
        all_logits = []
        for perm in tgt_perms:
            _, target_mask = self.generate_permutations_attention_masks(perm)  # (seq_len, seq_len)
            # combine both masks
            mask = (target_mask.bool() & padding_mask.bool()).int()  # (N, 1, seq_len, seq_len)
            all_logits.append(self.head(self.decode(gt_in, features, mask)))
        return all_logits


def build_target(words, vocab_size, max_length):
    """SOS + chars + EOS, then PAD (docTR encode_sequences with sos/eos/pad)."""
    gt = torch.full((len(words), max_length + 2), vocab_size + 2, dtype=torch.long)
    for i, w in enumerate(words):
        gt[i, 0] = vocab_size + 1
        gt[i, 1 : 1 + len(w)] = torch.tensor(w)
        gt[i, 1 + len(w)] = vocab_size
    return gt, torch.tensor([len(w) for w in words])


if __name__ == "__main__":
    model = PARSeq().eval()
    features = torch.randn(2, 6, 32)  # ViT memory stand-in
    words = [[3, 7], [1, 4, 2, 8, 5]]
    gt, seq_len = build_target(words, model.vocab_size, model.max_length)
    with torch.no_grad():
        batched = model.training_logits(features, gt, seq_len)
        gt0, len0 = build_target(words[:1], model.vocab_size, model.max_length)
        alone = model.training_logits(features[:1], gt0, len0)
    # reverse permutation: positions of the short word's chars (0..1) and its EOS output (2)
    diff = (batched[1][0, :3] - alone[1][0, :3]).abs().max().item()
    print("fixed" if FIXED else "buggy", "reverse-order logits, short word batched vs alone:", f"{diff:.4f}")
