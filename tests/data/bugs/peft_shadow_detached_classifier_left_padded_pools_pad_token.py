# huggingface/peft#3620, fixed by huggingface/peft#3629 ("FIX ShadowPEFT last-token pooling with left padding").
# Pre-fix code read at huggingface/peft dc1dfdc1d (src/peft/tuners/shadow/layers.py DetachedShadowModel,
# src/peft/tuners/shadow/model.py _pool_last_token); the fixed helper follows the PR description (the #3629 diff
# itself was not read): "select the rightmost non-padding position instead".
#
# ShadowPEFT's sequence-classification path (the standalone model returned by unload_shadow(), and the auxiliary
# loss) pools the "last non-padding token" with index attention_mask.sum(1) - 1. That is the last real token only
# for right padding. The shadow backbone is a decoder (Llama) whose tokenizer pads on the left, so for every padded
# row the classifier reads the hidden state of a position inside the real span counted from the left edge (or of a
# pad slot), and the logits / loss come from the wrong token. The fix takes the rightmost position whose mask is 1.
import sys
from typing import Any, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaModel
from transformers.modeling_outputs import SequenceClassifierOutput

FIXED = "--fixed" in sys.argv


def _pool_last_token(hidden: torch.Tensor, attention_mask: Optional[torch.Tensor]) -> torch.Tensor:
    """Pool the last non-padding token representation (used for sequence classification)."""
    if attention_mask is None:
        return hidden[:, -1, :]
    if FIXED:
        # rightmost non-padding position (all-padding row -> 0, as before)
        positions = torch.arange(attention_mask.size(1), device=hidden.device)
        last_idx = (attention_mask.long() * positions).argmax(dim=1)
        batch_idx = torch.arange(hidden.size(0), device=hidden.device)
        return hidden[batch_idx, last_idx]
    token_counts = (attention_mask.long().sum(dim=1) - 1).clamp(min=0)
    batch_idx = torch.arange(hidden.size(0), device=hidden.device)
    return hidden[batch_idx, token_counts]


class DetachedShadowModel(nn.Module):
    """A standalone shadow network (backbone + projection + head), as returned by ShadowModel.unload_shadow()."""

    _causal_lm_only_kwargs = ("logits_to_keep", "num_logits_to_keep")

    def __init__(
        self,
        backbone: nn.Module,
        projection: Optional[nn.Module] = None,
        head: Optional[nn.Module] = None,
        is_classification: bool = False,
        input_embeddings: Optional[nn.Module] = None,
    ) -> None:
        super().__init__()
        self.backbone = backbone
        self.config = backbone.config
        self.shadow_hidden_projection = projection if projection is not None else nn.Identity()
        self.head = head
        self.is_classification = is_classification
        self._shared_input_embeddings: list[Optional[nn.Module]] = [input_embeddings]

    def get_input_embeddings(self):
        shared = self._shared_input_embeddings[0]
        if shared is not None:
            return shared
        return self.backbone.get_input_embeddings()

    @staticmethod
    def _pool_last_token(hidden: torch.Tensor, attention_mask: Optional[torch.Tensor]) -> torch.Tensor:
        return _pool_last_token(hidden, attention_mask)

    def forward(
        self,
        input_ids: Optional[torch.Tensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        labels: Optional[torch.Tensor] = None,
        **kwargs: Any,
    ) -> Any:
        for key in self._causal_lm_only_kwargs:
            kwargs.pop(key, None)
        kwargs["return_dict"] = True
        if self._shared_input_embeddings[0] is not None and kwargs.get("inputs_embeds") is None:
            if input_ids is None:
                raise ValueError("Either `input_ids` or `inputs_embeds` must be provided.")
            kwargs["inputs_embeds"] = self.get_input_embeddings()(input_ids)
            input_ids = None
        out = self.backbone(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        hidden = self.shadow_hidden_projection(out.last_hidden_state)
        if self.head is None:
            return hidden

        if self.is_classification:
            pooled = self._pool_last_token(hidden, attention_mask)
            logits = self.head(pooled)
            loss = None
            if labels is not None:
                loss = F.cross_entropy(logits, labels.view(-1))
            return SequenceClassifierOutput(loss=loss, logits=logits)
        raise NotImplementedError


def left_pad(seqs, pad_id):
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, width - len(s):] = torch.tensor(s)
        mask[i, width - len(s):] = 1
    return ids, mask


def main():
    torch.manual_seed(0)
    pad_id = 0
    # shadow backbone: a small decoder, as ShadowPEFT builds from the base config
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=pad_id,
        attn_implementation="sdpa",
    )
    backbone = LlamaModel(config).eval()
    base_hidden = 48
    projection = nn.Linear(config.hidden_size, base_hidden)
    head = nn.Linear(base_hidden, 3, bias=False)  # score head, num_labels=3
    model = DetachedShadowModel(backbone, projection, head, is_classification=True).eval()

    # decoder tokenizer: padding_side="left"
    seqs = [[5, 17, 9, 33, 21, 8, 2], [12, 40, 7, 2], [30, 3, 2], [19, 25, 11, 6, 2]]
    input_ids, attention_mask = left_pad(seqs, pad_id)
    labels = torch.tensor([0, 2, 1, 2])

    with torch.no_grad():
        out = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
    print("logits:\n", out.logits)
    print("loss:", round(out.loss.item(), 6))
    print("predictions:", out.logits.argmax(-1).tolist())


if __name__ == "__main__":
    main()
