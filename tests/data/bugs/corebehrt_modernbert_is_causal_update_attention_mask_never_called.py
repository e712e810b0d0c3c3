# FGA-DIKU/BONSAI#343 (CoreBEHRT EHR model): the encoder subclasses ModernBertModel and builds its causal mask in an
# `_update_attention_mask` override; newer transformers no longer call that hook, so `is_causal` does nothing.
import sys

import torch
from transformers import ModernBertConfig, ModernBertModel

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def create_causal_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, L) padding mask -> (B, 1, L, L) boolean mask, True = attend (past events and itself, no padding)."""
    L = attention_mask.shape[1]
    causal = torch.tril(torch.ones(L, L, dtype=torch.bool, device=attention_mask.device))
    return causal[None, None] & attention_mask.bool()[:, None, None, :]


class CorebehrtEncoder(ModernBertModel):
    """ModernBERT over a patient's sequence of medical concepts (diagnoses, medications, labs)."""

    def __init__(self, config):
        super().__init__(config)
        self.is_causal = getattr(config, "is_causal", False)

    def _update_attention_mask(self, attention_mask, output_attentions=False):
        # Old transformers: ModernBertModel.forward called this hook to get (global_mask, sliding_window_mask).
        global_attention_mask = create_causal_mask(attention_mask) if self.is_causal else attention_mask.bool()[:, None, None, :]
        rows = torch.arange(attention_mask.shape[1])
        window = (rows[None, :] - rows[:, None]).abs() <= self.config.local_attention // 2
        sliding_window_mask = global_attention_mask & window[None, None]
        return global_attention_mask, sliding_window_mask

    def forward(self, batch):
        attention_mask = (batch["concept"] != 0).long()
        if FIXED:
            # After the fix: build the masks here and hand them to the layers explicitly.
            global_mask, sliding_mask = self._update_attention_mask(attention_mask)
            attention_mask = {"full_attention": global_mask, "sliding_attention": sliding_mask}
        return super().forward(input_ids=batch["concept"], attention_mask=attention_mask,
                               position_ids=batch["abspos"]).last_hidden_state


config = ModernBertConfig(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
    max_position_embeddings=64, local_attention=8, global_attn_every_n_layers=2, pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2,
    attn_implementation="sdpa",
)
config.is_causal = True  # causal pretraining: predict the next medical event from the past ones
model = CorebehrtEncoder(config).eval()

concepts = torch.tensor([[5, 9, 11, 7, 13, 21, 4, 0],
                         [6, 8, 10, 12, 14, 16, 18, 20]])
batch = {"concept": concepts, "abspos": torch.arange(8)[None].expand(2, 8)}

with torch.no_grad():
    h = model(batch)
    # Change only the future events of patient 1 after position 3: a causal encoder must not notice at positions <= 3.
    future = concepts.clone()
    future[1, 4:] = torch.tensor([30, 31, 32, 33])
    h2 = model({"concept": future, "abspos": batch["abspos"]})

leak = (h[1, :4] - h2[1, :4]).abs().max().item()
print(f"is_causal={config.is_causal} fixed={FIXED}: change in past-position states from future events = {leak:.3e}")
