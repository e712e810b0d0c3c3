# The same bug as fastembed#680 / Echo#24 from the other side: an embedder written for a left-padding tokenizer
# (Qwen3-Embedding's model card: `last_hidden_states[:, -1]`) run with a tokenizer that pads on the right, so every
# shorter row is pooled at a pad position. The fix gathers each row's last real token (`attention_mask.sum(1) - 1`).
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import MistralConfig, MistralModel

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


@dataclass
class RightPaddingTokenizer:
    """Stand-in for a tokenizer whose padding_side is "right" (texts are already ids)."""
    pad_token_id: int = 0
    eos_token_id: int = 2
    padding_side: str = "right"

    def __call__(self, texts):
        width = max(len(t) + 1 for t in texts)
        ids = torch.full((len(texts), width), self.pad_token_id)
        mask = torch.zeros(len(texts), width, dtype=torch.long)
        for row, text in enumerate(texts):
            ids[row, :len(text) + 1] = torch.tensor(text + [self.eos_token_id])
            mask[row, :len(text) + 1] = 1
        return {"input_ids": ids, "attention_mask": mask}


class Embedder:
    def __init__(self):
        config = MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, sliding_window=None, pad_token_id=0)
        self.model = MistralModel(config).eval()
        self.tokenizer = RightPaddingTokenizer()

    def pool(self, hidden, attention_mask):
        if FIXED:
            last = (attention_mask.sum(dim=1) - 1).view(-1, 1, 1).expand(-1, 1, hidden.shape[-1])
            return torch.gather(hidden, 1, last).squeeze(1)
        return hidden[:, -1]  # the model card's left-padding assumption

    @torch.no_grad()
    def encode(self, texts):
        batch = self.tokenizer(texts)
        outputs = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        return F.normalize(self.pool(outputs.last_hidden_state, batch["attention_mask"]), dim=-1)


embedder = Embedder()
texts = [[5, 9, 11, 3, 7, 21, 30], [8, 4], [17, 12, 6, 40]]
together = embedder.encode(texts)
alone = torch.cat([embedder.encode([t]) for t in texts])
print("cosine, batched vs alone:", [round(v, 4) for v in (together * alone).sum(-1).tolist()])
