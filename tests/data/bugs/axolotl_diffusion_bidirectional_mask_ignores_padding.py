"""axolotl diffusion-LM plugin: the bidirectional 4D mask ignores padding when sample packing is off.

Citation: axolotl-ai-cloud/axolotl#3735 ("fix(diffusion): exclude padding from bidirectional attention
mask"); the same hole was pointed out in review of axolotl-ai-cloud/axolotl#3067.

Bug: ``create_bidirectional_attention_mask`` short-circuits to an all-to-all mask whenever
``sample_packing`` is False: ``if attention_mask is None or not sample_packing: return torch.ones(...)``.
``DiffusionTrainer._compute_diffusion_loss`` passes ``sample_packing=cfg.sample_packing`` (False by default)
and hands the 4D mask to the model, which replaces the model's own padding handling: in a padded batch
every real token attends the pad tokens, in both directions.
Fix: always honour ``attention_mask``: ``(mask_i == mask_j) & (mask_i > 0)`` for padding masks (0/1) and
packed segment ids alike; all-ones only when no mask is given.

This program: the trainer's loss step (random masking of the inputs with the mask token, 4D mask, forward,
masked-token cross-entropy) with a one-layer bidirectional decoder (SDPA, boolean 4D ``attention_mask``)
on a right-padded batch of lengths [7, 4] of 7, ``cfg.sample_packing = False``.
"""
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv


class DictDefault(dict):
    """Attribute-access dict as axolotl's config object (missing keys read as None)."""

    def __getattr__(self, name):
        value = self.get(name)
        return DictDefault(value) if isinstance(value, dict) else value


def create_bidirectional_attention_mask(input_ids, attention_mask=None, sample_packing=False):
    """Create bidirectional attention mask to override default causal masking."""
    batch_size, seq_len = input_ids.shape
    device = input_ids.device

    if FIXED:
        if attention_mask is None:
            return torch.ones(batch_size, 1, seq_len, seq_len, dtype=torch.bool, device=device)
    elif attention_mask is None or not sample_packing:
        return torch.ones(batch_size, 1, seq_len, seq_len, dtype=torch.bool, device=device)

    mask_i = attention_mask.unsqueeze(2)  # [batch_size, seq_len, 1]
    mask_j = attention_mask.unsqueeze(1)  # [batch_size, 1, seq_len]
    # Tokens can attend to each other if they have the same non-zero sample ID
    bidirectional_mask = (mask_i == mask_j) & (mask_i > 0)
    return bidirectional_mask.unsqueeze(1)


class TinyDiffusionLM(nn.Module):
    def __init__(self, vocab_size=40, hidden=32, heads=4):
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(vocab_size, hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.o_proj = nn.Linear(hidden, hidden)
        self.lm_head = nn.Linear(hidden, vocab_size)

    def forward(self, input_ids, attention_mask):
        h = self.embed(input_ids)
        b, s, d = h.shape
        q, k, v = self.qkv(h).view(b, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask)
        h = h + self.o_proj(a.transpose(1, 2).reshape(b, s, d))
        return self.lm_head(h)


class DiffusionTrainer:
    def __init__(self, model, axolotl_cfg, mask_token_id):
        self.model, self.axolotl_cfg, self.mask_token_id = model, axolotl_cfg, mask_token_id

    def _forward_process(self, input_ids, attention_mask, eps=1e-3):
        batch_size, seq_len = input_ids.shape
        t = torch.rand(batch_size)
        p_mask = ((1 - eps) * t + eps)[:, None].repeat(1, seq_len)
        if attention_mask is not None:
            p_mask = p_mask * attention_mask.bool().float()
        masked_indices = torch.rand((batch_size, seq_len)) < p_mask
        if attention_mask is not None:
            masked_indices = masked_indices & attention_mask.bool()
        noisy_batch = torch.where(masked_indices, self.mask_token_id, input_ids)
        return noisy_batch, masked_indices, p_mask

    def _compute_diffusion_loss(self, input_ids, attention_mask=None):
        noisy_batch, masked_indices, p_mask = self._forward_process(input_ids, attention_mask)
        bidirectional_mask = create_bidirectional_attention_mask(
            input_ids, attention_mask, sample_packing=self.axolotl_cfg.sample_packing
        )
        logits = self.model(input_ids=noisy_batch, attention_mask=bidirectional_mask)
        token_loss = F.cross_entropy(logits[masked_indices], input_ids[masked_indices], reduction="none")
        return (token_loss / p_mask[masked_indices]).sum() / masked_indices.sum().clamp(min=1)


def main():
    torch.manual_seed(0)
    cfg = DictDefault({"sample_packing": False, "diffusion": {"mask_token_id": 39}})
    trainer = DiffusionTrainer(TinyDiffusionLM(), cfg, cfg.diffusion.mask_token_id)
    pad_token_id = 0
    input_ids = torch.tensor([[5, 8, 13, 21, 7, 9, 11], [6, 10, 14, 18, 0, 0, 0]])
    attention_mask = (input_ids != pad_token_id).long()
    with torch.no_grad():
        loss = trainer._compute_diffusion_loss(input_ids, attention_mask)
    print("diffusion loss %.4f" % loss)


if __name__ == "__main__":
    main()
